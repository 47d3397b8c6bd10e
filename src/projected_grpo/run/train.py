"""The GRPO loop on a mixed student/teacher pool with hack-direction projection.

`train(cfg)` reads top to bottom: setup (run/setup.py) -> per step, from the rollout step (batches.py):
G_s student samples + G_t frozen teacher rows per group, graded -> group advantages over the mixed group
-> one forward per micro-batch -> token losses (+ beta * KL to the reference = knobs zeroed) -> backward
with the one-pass per-source split -> projection by arm -> clip -> AdamW -> metrics row -> checkpoint.
Departures from textbook GRPO, labelled where they happen: one optimizer step per generation (student
ratio = 1, the PPO clip inert for students), teacher rows handled by `loss.teacher` (objective/teacher.py),
Dr.GRPO (Liu et al. 2025) by default, projection of knob gradients / updates (docs/architecture.md).
Deterministic given the seed on CPU; `--resume` continues bit for bit. `main(argv)` is `projected-grpo train`;
under `torchrun` it trains data-parallel (run/dist.py: prompts sharded, gradients summed before projection,
rank 0 writes), a no-op in one process.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import sys
import time

import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.hack import direction, resolve
from projected_grpo.knobs import projection
from projected_grpo.objective.advantages import ADVANTAGES
from projected_grpo.objective.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Denominators,
    clip_surrogate,
    masked_mean,
)
from projected_grpo.objective.schedule import lr_at
from projected_grpo.objective.teacher import TEACHER_MODES
from projected_grpo.run import batches, checkpoint, dist, dpo, metrics, ppo, session, setup
from projected_grpo.run.row import eval_rates, step_row
from projected_grpo.sampling.pack import pad_right
from projected_grpo.sampling.prefix import scoring


def train(cfg: C.Config) -> dict:
    """Run GRPO as configured; returns the end-of-run summary (also written to run_dir/summary.json)."""
    # --- run directory, resolved config, seeding (TRY NOT TO MODIFY, cleanrl) ---
    dist.init(cfg)  # torchrun: join the process group (run/dist.py); one process: nothing
    cfg, ck = session.open_run(cfg, cfg.proj.arm)  # run dir, resume checks, config.json, every RNG seeded
    run_dir = pathlib.Path(cfg.run.dir)
    rank0 = dist.is_main()  # only rank 0 writes: config, metrics, checkpoints, summary

    # --- model, knobs, environment, prompts (run/setup.py); under torchrun rank 0 fills the caches first ---
    with dist.main_first():
        model, tok = setup.load_model(cfg)
        knobs = setup.wrap_knobs(cfg, model)
    score = scoring(model, cfg.rollout.share_prefix)  # each group's prompt run once, or per row (packed)
    with contextlib.closing(setup.make_env(cfg)) as env:
        # --- prompts, teacher pool (pool.missing: restrict / refuse / all-student groups), cursors ---
        data = session.open_data(cfg, env, tok, run_dir)
        sets, problems, prompt_ids = data.sets, data.problems, data.prompt_ids

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
            session.load_cursors(data, ck)
            checkpoint.restore_rng(ck)
        else:
            with dist.main_first():
                V_hack, v_line = resolve.resolve_v_hack(cfg, model, knobs, tok, env, sets["train"])
        start = ck.step if ck is not None else 0
        if rank0:
            metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) if rank0 else None
        bar = metrics.Progress(cfg.run.steps, initial=start, disable=not rank0)
        print(f"run {run_dir} from step {start} | arm {cfg.proj.arm} ({cfg.proj.target}) | teacher "
              f"{cfg.loss.teacher} | G_s {cfg.rollout.G_s} + G_t {cfg.rollout.G_t} | {v_line}",
              file=sys.stderr)
        # the arm acts on the gradient, on the AdamW update, or on both (proj.target); else it only measures
        grad_arm = cfg.proj.arm if cfg.proj.target in ("grad", "both") else "none"
        update_arm = cfg.proj.arm if cfg.proj.target in ("update", "both") else "none"
        lr = lambda s: lr_at(s, peak=cfg.optim.lr, total=cfg.run.steps, warmup=cfg.optim.warmup_steps,
                             floor_frac=cfg.optim.min_lr_frac)

        t_mark = time.perf_counter()  # a step's time runs from the end of the last one: sampling included
        steps = batches.batches(cfg, model, knobs, tok, env, problems, prompt_ids, data.cursors,
                                data.pool_cur, start)
        for batch in steps:
            step = batch.step
            # --- advantages over each mixed group (estimator by name); zero-variance groups skipped ---
            adv, adv_stats = ADVANTAGES[cfg.loss.advantage](batch.rewards)  # (B, G); 0 if zero-variance
            is_student = batch.is_student  # (B, G)
            session.check_finite(step, "advantages", {"student": {"adv": adv[is_student]},
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
            for chunk in batch.chunks(cfg.rollout.micro):  # this rank's kept groups, one view per micro-batch
                mb = [s for b in chunk for s in batch.groups[b]]
                mb_adv = adv[chunk].reshape(-1)  # (N,)
                mb_student = torch.tensor([s.student for s in mb], device=cfg.model.device)  # (N,)
                # proj.train_deploy: the deployed view's groups train with the quarantine zeroed
                deployed = batch.view(chunk[0]) == "deploy"
                view = knobs.ablate_quarantine() if deployed else contextlib.nullcontext()
                seqs = score.pack([s.prompt_ids for s in mb], [s.completion_ids for s in mb],
                                  tok.pad_token_id, mb_student).to(cfg.model.device)
                mask = seqs.completion_mask  # (N, T)
                logp_b = pad_right([s.logp_behaviour or [] for s in mb], seqs.T).to(mask.device)  # (N, T)
                if cfg.loss.beta > 0:  # at beta 0 the KL term has no weight: no reference forward at all
                    with torch.inference_mode(), knobs.zeroed():  # the free reference: knobs zeroed = base
                        logp_ref, _ = score.logprobs(model, seqs, temperature=cfg.rollout.temperature)
                    logp_ref = logp_ref.clone()  # an ordinary tensor: the KL term's autograd may save it
                with view, knobs.capture(mb_student) as cap:  # per-source knob grads from this one backward
                    logp, entropy = score.logprobs(model, seqs, temperature=cfg.rollout.temperature,
                                                   with_entropy=True, capture=cap)  # (N, T) each
                    logp_old, weight, t_stats = TEACHER_MODES[cfg.loss.teacher](
                        logp, logp_b, mb_student, mask, cfg.loss.is_trunc)
                    # one optimizer step per generation: students' ratio is exactly 1 (clip inert for them)
                    pg_tok, clip_stats = clip_surrogate(logp, logp_old, mb_adv.to(mask.device), mask,
                                                        eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high)
                    kl_tok, kl_stats = (KL_ESTIMATORS[cfg.loss.kl](logp, logp_ref, mask, logp_old=logp_old)
                                        if cfg.loss.beta > 0 else (torch.zeros_like(logp), {}))
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
                # the graph's outputs go now, not when the next step's forward rebinds them: what the graph
                # still holds after the backward would otherwise sit under that forward's peak
                del logp, entropy, logp_old, weight, pg_tok, kl_tok, loss_pg, loss_kl
            t_bwd = time.perf_counter() - t0
            # --- data parallel (run/dist.py): sum knob grads, the per-source split and the loss stats over
            # ranks BEFORE projection, so every rank projects the same global gradient; one process: no-op ---
            split = dist.all_reduce_grads(knobs, split)
            acc = dist.sum_stats(acc)
            if split is not None:
                session.check_finite(step, "gradient", {"student": split.g_student,
                                                        "teacher": split.g_teacher})

            # --- projection by arm on the gradient and/or update; clip; AdamW step (docs/architecture.md) ---
            stats = projection.apply_arm(knobs, V_hack, grad_arm, cfg.proj.gate, split=split)
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
                                               cfg.proj.gate)
            stats |= projection.step_norms(knobs, before, before_hack)

            # --- optional: online V refresh and a greedy eval of the deployed model (quarantine zeroed) ---
            extra: dict = {}
            if cfg.proj.refresh_every and (step + 1) % cfg.proj.refresh_every == 0:
                with knobs.ablate_quarantine():
                    fresh = direction.extract_direction(model, knobs, tok,
                                                        resolve.v_pairs(cfg, env, sets["train"]),
                                                        resolve.extract_settings(cfg))
                V_new, _ = direction.postprocess(fresh.V, fresh.S, cfg.proj.k_use, cfg.proj.drop_bottom_frac)
                both = [n for n in V_new if n in V_hack]  # ||V_old V_new^T||_F^2 / K, mean over modules
                extra["proj/v_overlap"] = sum(float((V_hack[n] @ V_new[n].T).square().sum()) / min(
                    len(V_hack[n]), len(V_new[n])) for n in both) / max(1, len(both))
                V_hack = V_new
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and rank0:
                extra |= eval_rates(batches.eval_grades(cfg, model, knobs, tok, env,
                                                        sets.get("eval", sets["train"]), prompt_ids))

            # --- metrics row (run/row.py; every key in docs/metrics.md) ---
            row = step_row(batch, adv, {**adv_stats, **stats, **acc}, lr=lr(step), grad_norm=float(grad_norm),
                           knob_norms=knobs.norms(), teacher_mode=cfg.loss.teacher, t_backward=t_bwd) | extra
            for k in metrics.REQUIRED_METRICS:  # a step with every group skipped measured no loss: 0
                row.setdefault(k, 0.0)
            row["time/step"] = time.perf_counter() - t_mark
            if rank0:
                bar.update(logger.log(step, row))

            # --- checkpoint (atomic): knobs, the V_hack in use, optimizer, RNG, cursors, config ---
            if rank0 and ((step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == cfg.run.steps):
                checkpoint.save_checkpoint(run_dir, step + 1, knobs=knobs, V_hack=V_hack, optimizer=opt,
                                           cursors=session.cursor_state(data), config=cfg.to_dict())
            t_mark = time.perf_counter()
        bar.close()
        if not rank0:  # rank 0 writes the summary
            dist.close()
            return {}
        logger.close()

        # --- end: summary.json (last-5-step means) and one greedy sample of the deployed model ---
        summary = session.finish(cfg, model, knobs, tok, env, data, arm=cfg.proj.arm,
                                 teacher=cfg.loss.teacher, v_hack=v_line)
    dist.close()
    return summary


# --- CLI: projected-grpo train ------------------------------------------------------------------------

# loss.algo -> the RL loop (docs/architecture.md, "To add an algorithm")
LOOPS = {"grpo": train, "ppo": ppo.train_ppo}


def main(argv: list[str]) -> int:
    """`projected-grpo train`: parse (presets.parse), a DPO pass first when dpo.before, the loop loss.algo
    names (LOOPS), print the summary."""
    cfg, _ = presets.parse(argv, prog="projected-grpo train")
    dpo.pass_before(cfg)
    LOOPS[cfg.loss.algo](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
