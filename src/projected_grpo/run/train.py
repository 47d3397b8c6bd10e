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
import pathlib
import sys
import time

import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.hack import direction, resolve
from projected_grpo.knobs.split import Capture
from projected_grpo.objective.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Denominators,
    clip_surrogate,
    masked_mean,
)
from projected_grpo.objective.mismatch import sampler_mismatch
from projected_grpo.objective.schedule import lr_at
from projected_grpo.objective.teacher import TEACHER_MODES
from projected_grpo.run import batches, checkpoint, dist, dpo, intervene, metrics, ppo, session, setup
from projected_grpo.run.row import eval_rates, step_row
from projected_grpo.run.step import projected_step, set_lr
from projected_grpo.sampling.pack import pad_right
from projected_grpo.sampling.prefix import scoring


def grpo_backward(cfg: C.Config, model, knobs, score, tok, batch: batches.Batch, adv: torch.Tensor,
                  denoms: Denominators, in_loss: torch.Tensor) -> tuple[Capture | None, dict[str, float]]:
    """The loss and its backward over this rank's kept groups, one forward per micro-batch (students and
    teachers packed together): token losses (clip surrogate with loss.teacher's weights, + beta * KL to the
    reference = knobs zeroed), aggregated with the step's global denominators, backpropagated with the
    per-source capture. adv (B, G); in_loss (B, G) bool: rows outside it (screened) get weight 0. Returns
    (the step's per-source knob gradients, the loss stats: token-weighted means over micro-batches, losses as
    step-level sums)."""
    n_tok = sum(len(s.completion_ids) for b in batch.keep for s in batch.groups[b])
    n_tok_t = sum(len(s.completion_ids) for b in batch.keep for s in batch.groups[b] if not s.student)
    acc: dict[str, float] = {}
    split = None
    for chunk in batch.chunks(cfg.rollout.micro):  # this rank's kept groups, one view per micro-batch
        mb = [s for b in chunk for s in batch.groups[b]]
        mb_adv = adv[chunk].reshape(-1)  # (N,)
        mb_student = torch.tensor([s.student for s in mb], device=cfg.model.device)  # (N,)
        seqs = score.pack([s.prompt_ids for s in mb], [s.completion_ids for s in mb], tok.pad_token_id,
                          mb_student).to(cfg.model.device)
        mask = seqs.completion_mask  # (N, T)
        logp_b = pad_right([s.logp_behaviour for s in mb], seqs.T).to(mask.device)  # (N, T)
        if cfg.loss.beta > 0:  # at beta 0 the KL term has no weight: no reference forward at all
            with torch.inference_mode(), knobs.zeroed():  # the free reference: knobs zeroed = base model
                logp_ref, _ = score.logprobs(model, seqs, temperature=cfg.rollout.temperature)
            logp_ref = logp_ref.clone()  # an ordinary tensor: the KL term's autograd may save it
        with knobs.capture(mb_student) as cap:  # per-source knob grads from this one backward
            logp, entropy = score.logprobs(model, seqs, temperature=cfg.rollout.temperature,
                                           with_entropy=True, capture=cap)  # (N, T) each
            logp_old, weight, t_stats = TEACHER_MODES[cfg.loss.teacher](logp, logp_b, mb_student, mask,
                                                                        cfg.loss.is_trunc)
            weight = weight * in_loss[chunk].reshape(-1, 1).to(weight)  # screened rows: no loss, KL included
            # one optimizer step per generation: students' ratio is exactly 1 (the clip is inert for them)
            pg_tok, clip_stats = clip_surrogate(logp, logp_old, mb_adv.to(mask.device), mask,
                                                eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high)
            kl_tok, kl_stats = (KL_ESTIMATORS[cfg.loss.kl](logp, logp_ref, mask, logp_old=logp_old)
                                if cfg.loss.beta > 0 else (torch.zeros_like(logp), {}))
            bad = (~torch.isfinite(weight * (pg_tok + kl_tok)) & mask.bool()).any(1)  # (N,)
            if bad.any():
                raise FloatingPointError(f"step {batch.step}: non-finite token loss in a "
                                         f"{'student' if mb_student[bad][0] else 'teacher'} row")
            loss_pg, _ = AGGREGATIONS[cfg.loss.aggregation](weight * pg_tok, mask, denoms)
            loss_kl, _ = AGGREGATIONS[cfg.loss.aggregation](weight * kl_tok, mask, denoms)
            (loss_pg + cfg.loss.beta * loss_kl).backward()
        split = cap if split is None else split + cap
        w = float(mask.sum()) / n_tok
        w_t = float((mask * ~mb_student[:, None]).sum()) / max(1, n_tok_t)
        w_s = float((mask * mb_student[:, None]).sum()) / max(1, n_tok - n_tok_t)
        means = {**clip_stats, **kl_stats, "entropy/mean": masked_mean(entropy.detach(), mask)}
        parts = [(k, w * float(v)) for k, v in means.items()]
        parts += [(k, w_t * float(v)) for k, v in t_stats.items() if k != "teacher/mode"]
        # the students' ratio pi_theta / mu is taken as 1 above; how far from 1 it is (bf16 sampling)
        parts += [(k, w_s * float(v)) for k, v in sampler_mismatch(logp, logp_b, mb_student, mask).items()]
        parts += [("loss/policy", float(loss_pg.detach())),
                  ("loss/kl", cfg.loss.beta * float(loss_kl.detach()))]
        for k, v in parts:
            acc[k] = acc.get(k, 0.0) + v
        # the graph's outputs go now, not when the next micro-batch's forward rebinds them: what the graph
        # still holds after the backward would otherwise sit under that forward's peak memory
        del logp, entropy, logp_old, weight, pg_tok, kl_tok, loss_pg, loss_kl
    return split, acc


def refresh_v_hack(cfg: C.Config, model, knobs, tok, env, problems, V_hack: dict) -> tuple[dict, dict]:
    """proj.refresh_every: V_hack re-extracted from the current model (quarantine zeroed, findings 7.3), and
    proj/v_overlap = mean over modules of ||V_old V_new^T||_F^2 / min(K_old, K_new)."""
    with knobs.ablate_quarantine():
        fresh = direction.extract_direction(model, knobs, tok, resolve.v_pairs(cfg, env, problems),
                                            resolve.extract_settings(cfg))
    V_new = fresh.V
    both = [n for n in V_new if n in V_hack]
    overlap = sum(float((V_hack[n] @ V_new[n].T).square().sum()) / min(len(V_hack[n]), len(V_new[n]))
                  for n in both) / max(1, len(both))
    return V_new, {"proj/v_overlap": overlap}


def train(cfg: C.Config, env=None) -> dict:
    """Run GRPO as configured; returns the end-of-run summary (also written to run_dir/summary.json). env: an
    environment object to train in instead of cfg.env's (the Python API's reward callable, api.train)."""
    # --- run directory, resolved config, seeding (TRY NOT TO MODIFY, cleanrl) ---
    cfg = dist.init(cfg)  # torchrun: join the process group (run/dist.py); rollout.seed_scope auto resolved
    cfg, ck = session.open_run(cfg, cfg.proj.arm)  # run dir, resume checks, config.json, every RNG seeded
    run_dir = pathlib.Path(cfg.run.dir)
    rank0 = dist.is_main()  # only rank 0 writes: config, metrics, checkpoints, summary

    # --- model, knobs, environment, prompts (run/setup.py); under torchrun rank 0 fills the caches first ---
    with dist.main_first():
        model, tok = setup.load_model(cfg)
        knobs = setup.wrap_knobs(cfg, model)
    # each group's prompt run once (its completions in up to rollout.buckets like-length forwards), or per row
    score = scoring(model, cfg.rollout.share_prefix, cfg.rollout.buckets)
    with contextlib.closing(env or setup.make_env(cfg)) as env:
        data = session.open_data(cfg, env, tok, run_dir)  # prompts, teacher pool, cursors
        opt = torch.optim.AdamW([{"params": knobs.parameters()}, {"params": knobs.hack_parameters()}],
                                lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                weight_decay=cfg.optim.weight_decay)
        # --- resume (knobs, V_hack, optimizer, cursors, RNG) before V_hack is resolved: a resumed run never
        # re-extracts; then the intervention's monitor (docs/interventions.md): a probe is fitted here ---
        V_hack, v_line, start = session.resume(ck, knobs, opt, data, fresh=lambda: resolve.resolve_v_hack(
            cfg, model, knobs, tok, env, data.sets["train"]))
        guard = session.MovementGuard(knobs)  # fail closed: knobs that do not move stop the run
        monitor = intervene.open_monitor(cfg, model, knobs, tok, env, data.sets, data.prompt_ids, V_hack,
                                         run_dir if rank0 else None)
        if rank0:
            metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, cfg.run.report_to, cfg.to_dict()) if rank0 else None
        bar = metrics.Progress(cfg.run.steps, initial=start, disable=not rank0)
        print(f"run {run_dir} from step {start} | arm {cfg.proj.arm} ({cfg.proj.target}) | teacher "
              f"{cfg.loss.teacher} | G_s {cfg.rollout.G_s} + G_t {cfg.rollout.G_t} | {v_line}",
              file=sys.stderr)
        lr = lambda s: lr_at(s, peak=cfg.optim.lr, total=cfg.run.steps, warmup=cfg.optim.warmup_steps,
                             floor_frac=cfg.optim.min_lr_frac)

        t_mark = time.perf_counter()  # a step's time runs from the end of the last one: sampling included
        # --- rollout + grade: G_s student samples and G_t teacher rows per prompt, graded (batches.py) ---
        for batch in batches.batches(cfg, model, knobs, tok, env, data.problems, data.prompt_ids,
                                     data.cursors, data.pool_cur, start, monitor, data.train_prompt_ids):
            step = batch.step
            # --- advantage over each mixed group (estimator by name) under the intervention (screen: rows out
            # of the loss; advantage: the score folded in); a group left with all 0 is skipped ---
            adv, in_loss, adv_stats = intervene.advantages(cfg, batch.rewards, batch.verdict)  # (B, G) each
            batch.zero = (adv == 0).all(1)  # zero-variance groups, and those the intervention left so
            session.check_finite(step, "advantages", {"student": {"adv": adv[batch.is_student]},
                                                      "teacher": {"adv": adv[~batch.is_student]}})
            # Dr.GRPO (Liu et al. 2025): the constant G * max_new_tokens * B stays when groups are skipped
            n_tok = sum(len(s.completion_ids) for b in batch.keep for s in batch.groups[b])
            denoms = Denominators(n_seqs=max(1, len(batch.keep) * cfg.rollout.group_size),
                                  n_tokens=max(1, n_tok), const=float(cfg.rollout.dr_grpo_denom))

            # --- loss + backward: a forward per micro-batch, per-source knob gradients from one backward ---
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            split, acc = grpo_backward(cfg, model, knobs, score, tok, batch, adv, denoms, in_loss)
            t_bwd = time.perf_counter() - t0
            # data parallel (run/dist.py): sum knob grads, the per-source split and the loss stats over ranks
            # BEFORE projection, so every rank projects the same global gradient; one process: no-op
            split, acc = dist.all_reduce_grads(knobs, split), dist.sum_stats(acc)
            if split is not None:
                session.check_finite(step, "gradient", {"student": split.g_student,
                                                        "teacher": split.g_teacher})

            # --- project (gradient and/or update, by arm), clip, AdamW step (run/step.py) ---
            set_lr(opt, lr(step))
            # every group zero-variance: no signal, no step (Adam's momentum alone would still move the knobs)
            stats = projected_step(cfg, opt, knobs, V_hack, split=split, step_taken=bool(batch.keep))
            guard.after_step(step, informative=bool(batch.keep), grad_norm=float(stats["grad/norm"]))
            extra: dict = {}
            if cfg.proj.refresh_every and (step + 1) % cfg.proj.refresh_every == 0:
                V_hack, extra = refresh_v_hack(cfg, model, knobs, tok, env, data.sets["train"], V_hack)
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and rank0:
                held = data.sets.get("eval", data.sets["train"])
                extra |= eval_rates(batches.eval_grades(cfg, model, knobs, tok, env, held, data.prompt_ids))

            # --- log: the metrics row (run/row.py; every key in docs/metrics.md) ---
            grad_norm = float(stats.pop("grad/norm"))
            row = step_row(batch, adv, {**adv_stats, **stats, **acc}, lr=lr(step), grad_norm=grad_norm,
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
    with session.cleanup_on_failure():  # a run that fails before its first step leaves no directory
        dpo.pass_before(cfg)
        LOOPS[cfg.loss.algo](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
