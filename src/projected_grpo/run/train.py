"""The GRPO loop on a mixed student/teacher pool with hack-direction projection (seeds 000, 002).

`train(cfg)` reads top to bottom: setup (run/setup.py) -> per step, from the rollout step (batches.py):
G_s student samples + G_t frozen teacher rows per group, graded -> group advantages over the mixed group
-> one forward per micro-batch -> token losses (+ beta * KL to the reference = knobs zeroed) -> backward
with the one-pass per-source split -> projection by arm -> clip -> AdamW -> metrics row -> checkpoint.
Departures from textbook GRPO, labelled where they happen: one optimizer step per generation (student
ratio = 1, the PPO clip inert for students), teacher rows handled by `loss.teacher` (objective/teacher.py),
Dr.GRPO (Liu et al. 2025) by default, projection of knob gradients / updates (docs/architecture.md).
Deterministic given the seed on CPU; `--resume` continues bit for bit. `main(argv)` is `projected-grpo train`.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import random
import sys
import time

import numpy as np
import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.hack import direction
from projected_grpo.knobs import projection
from projected_grpo.objective.advantages import ADVANTAGES
from projected_grpo.objective.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Denominators,
    clip_surrogate,
    masked_mean,
)
from projected_grpo.objective.teacher import TEACHER_MODES
from projected_grpo.run import batches, checkpoint, metrics, setup
from projected_grpo.run.pool import PoolCursor, PromptCursor
from projected_grpo.run.rollout import forward_logprobs, pack, pad_right, sample_and_grade
from projected_grpo.run.row import eval_rates, step_row
from projected_grpo.run.schedule import lr_at


def _finite(step: int, what: str, by_source: dict[str, dict[str, torch.Tensor]]) -> None:
    """Fail fast on NaN/inf: name the step, the source(s) (student/teacher) and the module (or tensor).

    by_source: source -> {module or tensor name: values}; split.Capture sums each source's rows apart, so a
    NaN is attributed to the source that produced it."""
    for name in next(iter(by_source.values())):
        bad = [src for src, named in by_source.items() if not torch.isfinite(named[name]).all()]
        if bad:
            raise FloatingPointError(f"step {step}: non-finite {what} from the {' and '.join(bad)} rows "
                                     f"in {name}")


def _run_dir(cfg: C.Config) -> tuple[C.Config, checkpoint.Checkpoint | None]:
    """The config with run.dir resolved, and the checkpoint to resume from (None for a fresh run)."""
    run_dir = pathlib.Path(cfg.run.dir or f"runs/{cfg.model.source}-{cfg.proj.arm}-s{cfg.run.seed}-"
                           f"{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / metrics.METRICS_FILE).exists() and not cfg.run.resume:
        raise FileExistsError(f"{run_dir} holds a run: pass --resume to continue it or a new --run-dir")
    cfg = C.replace(cfg, run={"dir": str(run_dir)})
    ckpt_path = checkpoint.latest_checkpoint(run_dir) if cfg.run.resume else None
    ck = checkpoint.load_checkpoint(ckpt_path) if ckpt_path else None
    if ck is not None:
        # run.dir may differ: a run directory can be moved or copied and resumed where it is now
        old = C.Config.from_dict(ck.config, where=f"{ckpt_path} config")
        if diff := C.diff(old, cfg, ("run.resume", "run.steps", "run.dir")):
            raise ValueError(f"--resume: {ckpt_path} was written with another config: {diff}")
        if old.run.steps != cfg.run.steps:  # allowed (extending a run), but the LR schedule's horizon moves
            print(f"--resume: run.steps {old.run.steps} -> {cfg.run.steps}: the cosine LR schedule now spans "
                  f"{cfg.run.steps} steps, so from step {ck.step} on this is not the run the first "
                  "command would have finished, nor an uninterrupted run of the new length", file=sys.stderr)
    return cfg, ck


def train(cfg: C.Config) -> dict:
    """Run GRPO as configured; returns the end-of-run summary (also written to run_dir/summary.json)."""
    # --- run directory, resolved config, seeding (TRY NOT TO MODIFY, cleanrl) ---
    cfg, ck = _run_dir(cfg)
    run_dir = pathlib.Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store.write_json_atomic(run_dir / "config.json", cfg.to_dict())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)

    # --- model, knobs, environment, prompts (run/setup.py) ---
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with contextlib.closing(setup.make_env(cfg)) as env:
        sets = env.problem_sets()
        problems = {p.id: p for ps in sets.values() for p in ps}
        prompts = setup.prompt_table(env, tok, problems.values())
        prompt_ids = {i: ids for i, (_, ids) in prompts.items()}

        # --- teacher pool: restrict / refuse / all-student groups for prompts it lacks (pool.missing) ---
        pool = setup.open_pool(cfg, env, tok, sets["train"], prompts, run_dir)
        ids = {stage: [p.id for p in ps] for stage, ps in sets.items() if stage != "eval"}
        missing = pool.missing(ids["train"]) if cfg.rollout.G_t else []
        if missing and cfg.pool.missing == "error":
            raise ValueError(f"teacher pool {pool.path}: no rows for {len(missing)} problems {missing[:8]}; "
                             "extend the pool or set --pool.missing restrict (or students)")
        if missing:  # reported, never silently trained with G_t = 0
            print(f"teacher pool {pool.path}: no rows for {len(missing)}/{len(ids['train'])} problems "
                  f"{missing}: " + ("they are left out of sampling" if cfg.pool.missing == "restrict" else
                                    "their groups are all student samples"), file=sys.stderr)
            if cfg.pool.missing == "restrict":
                ids["train"] = [i for i in ids["train"] if i not in missing]
        if cfg.loss.teacher == "importance" and cfg.rollout.G_t and not pool.has_behaviour_logp():
            raise ValueError(f"--loss.teacher importance needs behaviour log-probs, but {pool.path} has rows "
                             "with logp_behaviour=null (template rows); build it with --source teacher")
        cursors = {stage: PromptCursor(stage_ids, cfg.run.seed) for stage, stage_ids in ids.items()}
        pool_cur = PoolCursor(pool, cfg.run.seed)

        # --- resume (knobs, V_hack, optimizer, cursors, RNG) before V_hack is resolved: a resumed run
        # never re-extracts ---
        params = knobs.parameters() + knobs.hack_parameters()
        opt = torch.optim.AdamW([{"params": knobs.parameters()}, {"params": knobs.hack_parameters()}],
                                lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                weight_decay=cfg.optim.weight_decay)
        if ck is not None:
            ck.load_knobs(knobs)
            V_hack, v_line = ck.V_hack, f"V_hack from {ck.path}"
            opt.load_state_dict(ck.optimizer_state)
            for stage, state in ck.cursors["prompts"].items():
                cursors[stage].load_state_dict(state)
            pool_cur.load_state_dict(ck.cursors["pool"])
            checkpoint.restore_rng(ck)
        else:
            V_hack, v_line = setup.resolve_v_hack(cfg, model, knobs, tok, env, sets["train"])
        start = ck.step if ck is not None else 0
        metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard)
        bar = metrics.Progress(cfg.run.steps, initial=start)
        print(f"run {run_dir} from step {start} | arm {cfg.proj.arm} ({cfg.proj.target}) | teacher "
              f"{cfg.loss.teacher} | G_s {cfg.rollout.G_s} + G_t {cfg.rollout.G_t} | {v_line}",
              file=sys.stderr)
        # the arm acts on the gradient, on the AdamW update, or on both (proj.target); else it only measures
        grad_arm = cfg.proj.arm if cfg.proj.target in ("grad", "both") else "none"
        update_arm = cfg.proj.arm if cfg.proj.target in ("update", "both") else "none"
        lr = lambda s: lr_at(s, peak=cfg.optim.lr, total=cfg.run.steps, warmup=cfg.optim.warmup_steps,
                             floor_frac=cfg.optim.min_lr_frac)

        t_mark = time.perf_counter()  # a step's time runs from the end of the last one: sampling included
        steps = batches.batches(cfg, model, knobs, tok, env, problems, prompt_ids, cursors, pool_cur, start)
        for batch in steps:
            step = batch.step
            # --- advantages over each mixed group (estimator by name); zero-variance groups skipped ---
            adv, adv_stats = ADVANTAGES[cfg.loss.advantage](batch.rewards)  # (B, G); 0 if zero-variance
            is_student = batch.is_student  # (B, G)
            _finite(step, "advantages", {"student": {"adv": adv[is_student]},
                                         "teacher": {"adv": adv[~is_student]}})
            keep = batch.keep
            n_tok = sum(len(s.completion_ids) for b in keep for s in batch.groups[b])
            n_tok_t = sum(len(s.completion_ids) for b in keep for s in batch.groups[b] if not s.student)
            # Dr.GRPO (Liu et al. 2025): the constant G * max_new_tokens * B stays when groups are skipped
            denoms = Denominators(n_seqs=max(1, len(keep) * cfg.rollout.group_size), n_tokens=max(1, n_tok),
                                  const=float(cfg.rollout.dr_grpo_denom))

            # --- per micro-batch: one forward (students + teachers packed), token losses, backward ---
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            acc: dict[str, float] = {}
            split = None
            for chunk in batch.chunks(cfg.rollout.micro):  # micro-batches of kept groups, one view each
                mb = [s for b in chunk for s in batch.groups[b]]
                mb_adv = adv[chunk].reshape(-1)  # (N,)
                # proj.train_deploy: the deployed view's groups train with the quarantine zeroed
                deployed = batch.view(chunk[0]) == "deploy"
                view = knobs.ablate_quarantine() if deployed else contextlib.nullcontext()
                seqs = pack([s.prompt_ids for s in mb], [s.completion_ids for s in mb],
                            tok.pad_token_id).to(cfg.model.device)
                mask = seqs.completion_mask  # (N, T)
                mb_student = torch.tensor([s.student for s in mb], device=mask.device)  # (N,)
                logp_b = pad_right([s.logp_behaviour or [] for s in mb], seqs.T).to(mask.device)  # (N, T)
                with torch.no_grad(), knobs.zeroed():  # the free reference: zero knobs = the base model
                    logp_ref, _ = forward_logprobs(model, seqs, temperature=cfg.rollout.temperature)
                with view, knobs.capture(mb_student) as cap:  # per-source knob grads from this one backward
                    logp, entropy = forward_logprobs(model, seqs, temperature=cfg.rollout.temperature,
                                                     with_entropy=True)  # (N, T) each
                    logp_old, weight, t_stats = TEACHER_MODES[cfg.loss.teacher](
                        logp, logp_b, mb_student, mask, cfg.loss.is_trunc)
                    # one optimizer step per generation: students' ratio is exactly 1 (clip inert for them)
                    pg_tok, clip_stats = clip_surrogate(logp, logp_old, mb_adv.to(mask.device), mask,
                                                        eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high)
                    kl_tok, kl_stats = KL_ESTIMATORS[cfg.loss.kl](logp, logp_ref, mask, logp_old=logp_old)
                    bad = (~torch.isfinite(weight * (pg_tok + kl_tok)) & mask.bool()).any(1)  # (N,)
                    if bad.any():
                        raise FloatingPointError(f"step {step}: non-finite token loss in a "
                                                 f"{'student' if mb_student[bad][0] else 'teacher'} row")
                    loss_pg, _ = AGGREGATIONS[cfg.loss.aggregation](weight * pg_tok, mask, denoms)
                    loss_kl, _ = AGGREGATIONS[cfg.loss.aggregation](weight * kl_tok, mask, denoms)
                    (loss_pg + cfg.loss.beta * loss_kl).backward()
                split = cap if split is None else split + cap
                # token-weighted means over micro-batches; losses are already step-level sums
                w = float(mask.sum()) / n_tok
                w_t = float((mask * ~mb_student[:, None]).sum()) / max(1, n_tok_t)
                means = {**clip_stats, **kl_stats, "entropy/mean": masked_mean(entropy.detach(), mask)}
                parts = [(k, w * float(v)) for k, v in means.items()]
                parts += [(k, w_t * float(v)) for k, v in t_stats.items() if k != "teacher/mode"]
                parts += [("loss/policy", float(loss_pg.detach())),
                          ("loss/kl", cfg.loss.beta * float(loss_kl.detach()))]
                for k, v in parts:
                    acc[k] = acc.get(k, 0.0) + v
            t_bwd = time.perf_counter() - t0
            if split is not None:
                _finite(step, "gradient", {"student": split.g_student, "teacher": split.g_teacher})

            # --- projection by arm on the gradient and/or update; clip; AdamW step (docs/architecture.md) ---
            stats = projection.apply_arm(knobs, V_hack, grad_arm, cfg.proj.gate,
                                         cfg.proj.overshoot, cfg.proj.preserve_magnitude, split=split)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_norm or math.inf)
            if cfg.proj.purge_moments and cfg.proj.arm != "none":  # Adam bypass: drop hack-ward momentum
                stats |= projection.purge_moments(opt, knobs, V_hack, "no_gate" if cfg.proj.gate == "no_gate"
                                                  else "one_sided")
            before, before_hack = projection.snapshot(knobs), projection.snapshot(knobs, "hack")
            for group in opt.param_groups:
                group["lr"] = lr(step)
            if keep:  # every group zero-variance: no signal, no step (Adam's momentum alone would still move)
                opt.step()
            stats |= projection.project_update(knobs, before, V_hack, update_arm,
                                               cfg.proj.gate, cfg.proj.overshoot, cfg.proj.preserve_magnitude)
            stats |= projection.step_norms(knobs, before, before_hack)

            # --- optional: online V refresh and a greedy eval of the deployed model (quarantine zeroed) ---
            extra: dict = {}
            if cfg.proj.refresh_every and (step + 1) % cfg.proj.refresh_every == 0:
                with knobs.ablate_quarantine():
                    fresh = direction.extract_direction(model, knobs, tok,
                                                        setup.v_pairs(cfg, env, sets["train"]),
                                                        setup.extract_settings(cfg))
                V_new, _ = direction.postprocess(fresh.V, fresh.S, cfg.proj.k_use, cfg.proj.drop_bottom_frac)
                both = [n for n in V_new if n in V_hack]  # ||V_old V_new^T||_F^2 / K, mean over modules
                extra["proj/v_overlap"] = sum(float((V_hack[n] @ V_new[n].T).square().sum()) / min(
                    len(V_hack[n]), len(V_new[n])) for n in both) / max(1, len(both))
                V_hack = V_new
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                extra |= eval_rates(batches.eval_grades(cfg, model, knobs, tok, env,
                                                        sets.get("eval", sets["train"]), prompt_ids))

            # --- metrics row (run/row.py; every key in docs/metrics.md) ---
            row = step_row(batch, adv, {**adv_stats, **stats, **acc}, lr=lr(step), grad_norm=float(grad_norm),
                           knob_norms=knobs.norms(), teacher_mode=cfg.loss.teacher, t_backward=t_bwd) | extra
            for k in metrics.REQUIRED_METRICS:  # a step with every group skipped measured no loss: 0
                row.setdefault(k, 0.0)
            row["time/step"] = time.perf_counter() - t_mark
            bar.update(logger.log(step, row))

            # --- checkpoint (atomic): knobs, the V_hack in use, optimizer, RNG, cursors, config ---
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == cfg.run.steps:
                cur = {"prompts": {s: c.state_dict() for s, c in cursors.items()},
                       "pool": pool_cur.state_dict()}
                checkpoint.save_checkpoint(run_dir, step + 1, knobs=knobs, V_hack=V_hack, optimizer=opt,
                                           cursors=cur, config=cfg.to_dict())
            t_mark = time.perf_counter()
        bar.close()
        logger.close()

        # --- end: summary.json (last-5-step means) and one greedy sample of the deployed model ---
        first = problems[ids["train"][0]]
        with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
            sample = sample_and_grade(model, tok, env, [first], prompt_ids, 1,
                                      max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, seed=0)[0]
    summary = metrics.summarize(metrics.read_rows(run_dir / metrics.METRICS_FILE))
    summary |= {"run_dir": str(run_dir), "arm": cfg.proj.arm, "teacher": cfg.loss.teacher, "v_hack": v_line,
                "sample_problem": first.id, "sample": sample.text}
    store.write_json_atomic(run_dir / metrics.SUMMARY_FILE, summary)
    print("\n".join(f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v!r}"
                    for k, v in summary.items()))
    return summary


# --- CLI: projected-grpo train ------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """`projected-grpo train`: parse (presets.parse), run, print the summary."""
    cfg, _ = presets.parse(argv, prog="projected-grpo train")
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
