"""PPO with a critic on the shared rollout step: `projected-grpo train --loss.algo ppo`.

Per step: the Batch of batches.py (the same prompts, students, teacher rows and grades as GRPO; every group
is trained on, zero-variance ones too, since the critic and not the group is the baseline) -> `score`: one
no-grad pass over the N = B·G sequences under the pre-update policy (logp_old, V_old) and the reference
(knobs zeroed, logp_ref) -> GAE per token with the episode reward on the last completion token (Schulman et
al. 2016), whitened -> ppo.epochs passes over ppo.minibatches seeded-shuffled minibatches, one optimizer
update each (`update`): clipped surrogate + β·KL (to the old policy or the reference) + entropy bonus on the
knobs, clipped value loss on the value head (knobs/value_head.py), then the projection arm, clipping, AdamW
and the update projection exactly as train.py does them -> one metrics row, the means over the updates ->
checkpoint (value head in its extra file). Teacher rows follow loss.teacher as in GRPO (its weight: 1, the
truncated π/μ, or 0); their logp_old, like the students', is the policy that scored the batch, so the clip
bounds them across epochs too (with one update it is GRPO's: the current policy, ratio 1).
Deterministic given the seed on CPU; --resume continues bit for bit. Formulas: docs/losses.md section 6.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from projected_grpo import config as C
from projected_grpo.errors import UserError
from projected_grpo.hack import resolve
from projected_grpo.knobs.value_head import ValueHead
from projected_grpo.objective.logprobs import entropy_from_logits, token_logprobs
from projected_grpo.objective.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Denominators,
    clip_surrogate,
    entropy_bonus,
    explained_variance,
    gae,
    value_loss,
    whiten,
    zero_pad,
)
from projected_grpo.objective.schedule import lr_at
from projected_grpo.objective.teacher import TEACHER_MODES
from projected_grpo.run import batches, checkpoint, intervene, metrics, session, setup
from projected_grpo.run.row import eval_rates, step_row
from projected_grpo.run.step import projected_step
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.pack import SeqBatch, pack, pad_right, position_ids_from_mask


def forward_with_values(model, head: ValueHead, seqs: SeqBatch, *, temperature: float):
    """One forward: per completion token logp, entropy (of softmax(logits / temperature)) and V, all (N, T)
    fp32 and 0 off the completion mask. V_t reads the last hidden state at the position predicting token t."""
    T = seqs.T
    keep = {"logits_to_keep": T + 1} if "logits_to_keep" in inspect.signature(model.forward).parameters \
        else {}
    out = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False,
                position_ids=position_ids_from_mask(seqs.attention_mask), output_hidden_states=True, **keep)
    logits = out.logits[:, -(T + 1):-1]  # (N, T, V)
    real = seqs.completion_mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    logp = torch.where(real, token_logprobs(logits, seqs.input_ids[:, -T:], temperature=temperature), zero)
    entropy = torch.where(real, entropy_from_logits(logits, temperature=temperature), zero)
    return logp, entropy, head(out.hidden_states[-1][:, -(T + 1):-1], seqs.completion_mask)


@dataclass
class Scored:
    """The step's N sequences (batch order) before the update; per-token tensors (N, T), T the longest."""

    mask: torch.Tensor
    logp_old: torch.Tensor
    values_old: torch.Tensor
    logp_ref: torch.Tensor
    logp_b: torch.Tensor
    is_student: torch.Tensor  # (N,) bool


def score(cfg: C.Config, model, knobs, head, tok, samples) -> Scored:
    """logp_old and V_old under the current knobs, logp_ref under knobs.zeroed(); in micro-batches."""
    T = max(len(s.completion_ids) for s in samples)
    out = {k: torch.zeros(len(samples), T) for k in ("mask", "logp_old", "values_old", "logp_ref")}
    chunk = cfg.rollout.micro * cfg.rollout.group_size
    with torch.no_grad():
        for c in range(0, len(samples), chunk):
            mb = samples[c:c + chunk]
            seqs = pack([s.prompt_ids for s in mb], [s.completion_ids for s in mb], tok.pad_token_id)
            seqs = seqs.to(cfg.model.device)
            logp, _, values = forward_with_values(model, head, seqs, temperature=cfg.rollout.temperature)
            with knobs.zeroed():
                logp_ref, _, _ = forward_with_values(model, head, seqs, temperature=cfg.rollout.temperature)
            for k, v in (("mask", seqs.completion_mask), ("logp_old", logp), ("values_old", values),
                         ("logp_ref", logp_ref)):
                out[k][c:c + len(mb), :seqs.T] = v.cpu()
    logp_b = pad_right([s.logp_behaviour for s in samples], T)
    return Scored(**out, logp_b=logp_b, is_student=torch.tensor([s.student for s in samples]))


def advantages(cfg: C.Config, rewards: torch.Tensor, old: Scored) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """GAE over each sequence's tokens, the sequence's reward on its last token; adv whitened when
    ppo.whiten. rewards (N,). Returns adv (N, T), returns (N, T), stats."""
    last = old.mask.sum(1).long() - 1  # (N,) index of the last completion token
    r_tok = torch.zeros_like(old.mask).scatter(1, last[:, None], rewards[:, None].float())
    adv, returns, stats = gae(r_tok, old.values_old, old.mask, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
    if cfg.ppo.whiten:
        adv, w_stats = whiten(adv, old.mask)
        stats |= w_stats
    stats["value/explained_var"] = explained_variance(old.values_old, returns, old.mask)
    return adv, returns, stats


def update(cfg: C.Config, model, knobs, head, tok, samples, idx: torch.Tensor, old: Scored, adv, returns,
           step: int) -> tuple[dict[str, float], object]:
    """Forward + backward of one minibatch (indices idx into the step's sequences) in micro-batches, with
    the minibatch's own Denominators (one optimizer update). Returns (token-weighted stats, the knob
    gradient's per-source split)."""
    n_tok = int(old.mask[idx].sum())
    n_tok_t = float((old.mask[idx] * ~old.is_student[idx, None]).sum())
    denoms = Denominators(n_seqs=len(idx), n_tokens=n_tok, const=float(len(idx) * cfg.rollout.max_new_tokens))
    agg = AGGREGATIONS[cfg.loss.aggregation]
    acc: dict[str, float] = {}
    split, kl_old = None, [0.0, 0.0]  # approx KL to the old policy: sum and count over student tokens
    chunk = cfg.rollout.micro * cfg.rollout.group_size
    for c in range(0, len(idx), chunk):
        ix = idx[c:c + chunk]
        mb = [samples[int(i)] for i in ix]
        seqs = pack([s.prompt_ids for s in mb], [s.completion_ids for s in mb], tok.pad_token_id)
        seqs = seqs.to(cfg.model.device)
        T, mask = seqs.T, seqs.completion_mask
        at = _rows(ix, T, mask.device)  # the micro-batch's rows of a step tensor (N, T_step) -> (n, T)
        st = old.is_student[ix].to(mask.device)
        with knobs.capture(st) as cap:
            logp, entropy, values = forward_with_values(model, head, seqs,
                                                        temperature=cfg.rollout.temperature)
            # the mode's weight; its logp_old (the current policy) becomes, across epochs, the policy that
            # scored the batch, for every row: the proximal policy of decoupled PPO (Hilton et al. 2021)
            _, weight, t_stats = TEACHER_MODES[cfg.loss.teacher](logp, at(old.logp_b), st, mask,
                                                                cfg.loss.is_trunc)
            logp_old = at(old.logp_old)
            pg_tok, clip_stats = clip_surrogate(logp, logp_old, at(adv), mask, eps_low=cfg.loss.eps_low,
                                                eps_high=cfg.loss.eps_high)
            kl_tok, kl_stats = KL_ESTIMATORS[cfg.loss.kl](logp, at(old.logp_ref), mask, logp_old=logp_old)
            # the β·KL penalty holds the policy to the pre-update policy (Schulman et al. 2017 sec. 4);
            # kl/mean above measures the distance to the reference
            pen_tok, _ = KL_ESTIMATORS[cfg.loss.kl](logp, logp_old, mask, logp_old=logp_old)
            ent_tok, ent_stats = entropy_bonus(entropy, mask, coef=cfg.ppo.ent_coef)
            vf_tok, vf_stats = value_loss(values, at(old.values_old), at(returns), mask,
                                          clip_range=cfg.ppo.vf_clip)
            tok_loss = weight * (pg_tok + cfg.loss.beta * pen_tok + ent_tok) + cfg.ppo.vf_coef * vf_tok
            if (bad := (~torch.isfinite(tok_loss) & mask.bool()).any(1)).any():
                raise FloatingPointError(f"step {step}: non-finite token loss in a "
                                         f"{'student' if st[bad][0] else 'teacher'} row")
            losses = {"loss/policy": agg(weight * pg_tok, mask, denoms)[0],
                      "loss/kl": cfg.loss.beta * agg(weight * pen_tok, mask, denoms)[0],
                      "loss/entropy": agg(weight * ent_tok, mask, denoms)[0],
                      "loss/value": cfg.ppo.vf_coef * agg(vf_tok, mask, denoms)[0]}
            sum(losses.values()).backward()
        split = cap if split is None else split + cap
        w = float(mask.sum()) / n_tok
        # k3 of pi_old vs pi on student tokens (the policy's own samples), cleanrl's approx_kl
        # (r - 1) - log r, r = pi / pi_old
        log_r = (logp - logp_old).detach()
        m_s = mask * st[:, None]
        kl_old[0] += float(zero_pad(torch.expm1(log_r) - log_r, m_s).sum())
        kl_old[1] += float(m_s.sum())
        means = {**clip_stats, **kl_stats, **ent_stats, **vf_stats}
        parts = [(k, w * float(v)) for k, v in means.items()]
        parts += [(k, float(v.detach())) for k, v in losses.items()]
        m_t = mask * ~st[:, None]  # teacher tokens; their ratio: the surrogate's pi / pi_old
        t_stats["teacher/ratio_mean"] = zero_pad(torch.exp(log_r), m_t).sum() / m_t.sum().clamp(min=1.0)
        w_t = float(m_t.sum()) / max(1.0, n_tok_t)  # teacher stats: weighted by teacher tokens, as train.py
        parts += [(k, w_t * float(v)) for k, v in t_stats.items() if k != "teacher/mode"]
        for k, v in parts:
            acc[k] = acc.get(k, 0.0) + v
    acc["ppo/approx_kl"] = kl_old[0] / max(1.0, kl_old[1])
    return acc, split


def knob_lr(cfg: C.Config) -> float:
    """Peak learning rate of the knobs: ppo.lr, else optim.lr spread over the batch's updates (Adam's step is
    about lr per coordinate whatever the gradient's scale, so epochs x minibatches updates at optim.lr would
    move the knobs that many times as far as GRPO's one update per batch)."""
    return cfg.ppo.lr or cfg.optim.lr / (cfg.ppo.epochs * cfg.ppo.minibatches)


def make_optimizer(cfg: C.Config, knobs, head: ValueHead) -> torch.optim.AdamW:
    """AdamW over three groups, knobs, quarantine knobs and value head, each with its own peak lr ("peak")."""
    return torch.optim.AdamW([{"params": knobs.parameters(), "peak": knob_lr(cfg)},
                              {"params": knobs.hack_parameters(), "peak": knob_lr(cfg)},
                              {"params": list(head.parameters()), "peak": cfg.ppo.value_lr}],
                             lr=knob_lr(cfg), betas=cfg.optim.betas, eps=cfg.optim.eps,
                             weight_decay=cfg.optim.weight_decay)


def optimize(cfg: C.Config, model, knobs, head: ValueHead, opt, tok, samples, rewards: torch.Tensor,
             V_hack: dict, step: int) -> tuple[list[dict[str, float]], Scored, torch.Tensor, dict]:
    """PPO's update on one batch: score it, GAE, then ppo.epochs x ppo.minibatches optimizer updates, each
    projected, clipped and stepped as in train.py. rewards (N,), one per sample. Returns (each update's stats
    in order, the scored batch, adv (N, T), the rollout's GAE stats)."""
    old = score(cfg, model, knobs, head, tok, samples)
    adv, returns, gae_stats = advantages(cfg, rewards, old)
    clip = cfg.optim.clip_norm or math.inf
    updates = []
    for epoch in range(cfg.ppo.epochs):
        perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(
            step_seed(cfg.run.seed, step, "ppo", epoch)))
        for idx in torch.tensor_split(perm, min(cfg.ppo.minibatches, len(samples))):
            opt.zero_grad(set_to_none=True)
            stats, split = update(cfg, model, knobs, head, tok, samples, idx, old, adv, returns, step)
            session.check_finite(step, "gradient", {"student": split.g_student, "teacher": split.g_teacher})
            # the head's gradient is the value loss's alone: clipped on its own scale
            st = {"value/grad_norm": torch.nn.utils.clip_grad_norm_(head.parameters(), clip)}
            for group in opt.param_groups:
                group["lr"] = lr_at(step, peak=group["peak"], total=cfg.run.steps,
                                    warmup=cfg.optim.warmup_steps, floor_frac=cfg.optim.min_lr_frac)
            st |= projected_step(cfg, opt, knobs, V_hack, split=split)
            updates.append(stats | {k: float(v) for k, v in st.items()})
    return updates, old, adv, gae_stats


def train_ppo(cfg: C.Config, env=None) -> dict:
    """Run PPO as configured; returns the end-of-run summary (also written to run_dir/summary.json). env: an
    environment object instead of cfg.env's (api.train)."""
    if cfg.proj.refresh_every:
        raise UserError("config: proj.refresh_every (online V_hack refresh) is run by the GRPO loop only; "
                        "with loss.algo ppo set it to 0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: its updates are not sharded over ranks
        raise UserError("config: loss.algo ppo trains in one process; run it without torchrun (data-parallel "
                        "training under torchrun is GRPO's: loss.algo grpo)")
    cfg, ck = session.open_run(cfg, f"ppo-{cfg.proj.arm}")
    run_dir = pathlib.Path(cfg.run.dir)
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    head = ValueHead(model.config.hidden_size, device=cfg.model.device)
    with contextlib.closing(env or setup.make_env(cfg)) as env:
        data = session.open_data(cfg, env, tok, run_dir)
        opt = make_optimizer(cfg, knobs, head)
        V_hack, v_line, start = session.resume(ck, knobs, opt, data, extra=head, fresh=lambda: (
            resolve.resolve_v_hack(cfg, model, knobs, tok, env, data.sets["train"])))
        guard = session.MovementGuard(knobs)  # fail closed: knobs that do not move stop the run
        # a monitor's verdict reaches PPO through the rewards (penalty); screen and advantage act on GRPO's
        # group advantages and are refused for PPO (config.py)
        monitor = intervene.open_monitor(cfg, model, knobs, tok, env, data.sets, data.prompt_ids, V_hack,
                                         run_dir)
        metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, cfg.run.report_to, cfg.to_dict())
        bar = metrics.Progress(cfg.run.steps, initial=start)
        print(f"run {run_dir} from step {start} | PPO, {cfg.ppo.epochs} epochs x {cfg.ppo.minibatches} "
              f"minibatches | arm {cfg.proj.arm} ({cfg.proj.target}) | teacher {cfg.loss.teacher} | "
              f"G_s {cfg.rollout.G_s} + G_t {cfg.rollout.G_t} | {v_line}", file=sys.stderr)
        t_mark = time.perf_counter()
        steps = batches.batches(cfg, model, knobs, tok, env, data.problems, data.prompt_ids, data.cursors,
                                data.pool_cur, start, monitor, data.train_prompt_ids)
        for batch in steps:
            step = batch.step
            t0 = time.perf_counter()
            updates, old, adv, gae_stats = optimize(cfg, model, knobs, head, opt, tok, batch.samples,
                                                    batch.rewards.reshape(-1), V_hack, step)
            t_bwd = time.perf_counter() - t0
            means = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
            grad_norm = means.pop("grad/norm")
            guard.after_step(step, grad_norm=grad_norm)  # PPO trains on every group: every step informative
            if not math.isfinite(float(gae_stats["value/explained_var"])):  # Var(returns) = 0: undefined
                del gae_stats["value/explained_var"]
            extra: dict = {}
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                extra |= eval_rates(batches.eval_grades(cfg, model, knobs, tok, env,
                                                        data.sets.get("eval", data.sets["train"]),
                                                        data.prompt_ids))
            adv_seq = per_sequence(adv, old.mask, batch.rewards.shape)
            gae_stats.pop("adv/mean")  # the row's adv/* are per sequence (reward_stats)
            row = step_row(batch, adv_seq, {**reward_stats(batch, adv_seq), **gae_stats, **means},
                           lr=opt.param_groups[0]["lr"], grad_norm=grad_norm, knob_norms=knobs.norms(),
                           teacher_mode=cfg.loss.teacher, t_backward=t_bwd) | extra
            row["groups/skipped"] = 0.0  # PPO trains on every group: the critic is the baseline
            for k in metrics.REQUIRED_METRICS:
                row.setdefault(k, 0.0)
            row["time/step"] = time.perf_counter() - t_mark
            bar.update(logger.log(step, row))
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == cfg.run.steps:
                checkpoint.save_checkpoint(run_dir, step + 1, knobs=knobs, V_hack=V_hack, optimizer=opt,
                                           cursors=session.cursor_state(data), config=cfg.to_dict(),
                                           extra=head.state())
            t_mark = time.perf_counter()
        bar.close()
        logger.close()
        return session.finish(cfg, model, knobs, tok, env, data, arm=cfg.proj.arm, algo="ppo",
                              teacher=cfg.loss.teacher, v_hack=v_line)


def _rows(ix: torch.Tensor, T: int, device):
    """x (N, T_step) -> x[ix, :T] on device: a micro-batch's rows of a step-wide per-token tensor."""
    return lambda x: x[ix, :T].to(device)


def per_sequence(adv: torch.Tensor, mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each sequence's mean token advantage, (N, T) -> (B, G): what the row's adv/* read."""
    return ((adv * mask).sum(1) / mask.sum(1).clamp(min=1.0)).reshape(shape)


def reward_stats(batch, adv: torch.Tensor) -> dict[str, torch.Tensor]:
    """reward/* of the batch and adv/* of the per-sequence advantages (B, G), named as ADVANTAGES' stats."""
    r = batch.rewards
    return {"reward/mean": r.mean(), "reward/std": r.std(), "reward/frac_zero_std": batch.zero.float().mean(),
            "reward/informative": (~batch.zero).float().mean(), "adv/mean": adv.mean(), "adv/std": adv.std(),
            "adv/abs_max": adv.abs().max()}
