"""What a monitor's verdict does to training: reward penalty, screening, advantage modification (pure math).

A monitor (hack/monitors.py) gives every rollout of a step a flag and a score in [0, 1] (B, G); an
intervention turns them into a change of the training signal (docs/interventions.md):
  penalty    flagged rollouts' reward minus a constant, before the advantages (the rl-rewardhacking
             benchmark's "monitor with penalty"; with the ground-truth monitor, its ground-truth penalty)
  screen     flagged rollouts get no loss (weight 0 on their tokens: no gradient, the KL term included)
             and, with baseline "drop", no place in their group's baseline or scale either: the advantages
             are computed over each group's unflagged rows only, as if the flagged rows had never been
             sampled (the benchmark's screening: "advantage = 0 ... not used in advantage
             scaling/normalization"); baseline "keep" leaves them in the baseline
  advantage  adv - coef * (score - mean_g score): the score, centred within the group, folded into the
             advantage (Advantage Modification, Wu & Tang 2026, arXiv:2604.01476). Centred so a score
             every row of a group shares changes nothing, as a group-relative estimator ignores a reward
             every row shares; with 0/1 scores under `dr_grpo` it equals `penalty` with penalty = coef
Every function is `(value, stats)` with detached stats; shapes (B, G) throughout, B prompts, G group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from projected_grpo.objective.advantages import ADVANTAGES, STD_EPS, ZERO_VAR_EPS

Stats = dict[str, Tensor]


def _check(name: str, **tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1 or any(v.dim() != 2 for v in tensors.values()):
        raise ValueError(f"{name}: every input must have the same shape (B, G); got {shapes}")


def penalty(rewards: Tensor, flags: Tensor, amount: float) -> tuple[Tensor, Stats]:
    """rewards (B, G) float, flags (B, G) bool -> rewards - amount * flags (B, G).

    stats: monitor/penalised_frac, the fraction of the B*G rows penalised.
    """
    _check("penalty", rewards=rewards, flags=flags)
    if amount < 0:
        raise ValueError(f"penalty: amount must be >= 0, got {amount}")
    out = rewards - amount * flags.to(rewards.dtype)
    return out, {"monitor/penalised_frac": (flags.float().mean() if amount > 0 else torch.zeros(())).detach()}


def _masked_centred(rewards: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(R - mean over kept rows (B, G), kept count n (B, 1), kept-rows sum (B, 1)); rows not kept are 0."""
    k = keep.to(rewards.dtype)
    n = k.sum(1, keepdim=True)  # (B, 1)
    total = (rewards * k).sum(1, keepdim=True)  # (B, 1)
    mean = total / n.clamp(min=1)
    return (rewards - mean) * k, n, total


def _masked_std(centred: Tensor, n: Tensor) -> Tensor:
    """Bessel-corrected std of each group's kept rows (B, 1) from their centred values (0 elsewhere)."""
    return (centred.square().sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()


def _m_grpo(rewards, keep):
    c, n, _ = _masked_centred(rewards, keep)
    return c / (_masked_std(c, n) + STD_EPS)


def _m_dr_grpo(rewards, keep):
    return _masked_centred(rewards, keep)[0]


def _m_rloo(rewards, keep):
    _, n, total = _masked_centred(rewards, keep)
    return (rewards - (total - rewards) / (n - 1).clamp(min=1)) * keep.to(rewards.dtype)


def _m_batch_std(rewards, keep):
    c, _, _ = _masked_centred(rewards, keep)
    kept = rewards[keep]
    scale = kept.std(correction=1) if kept.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    return c / (scale + STD_EPS)


# advantage estimator (objective/advantages.ADVANTAGES) -> the same formula over each group's kept rows only
MASKED = {"grpo": _m_grpo, "dr_grpo": _m_dr_grpo, "rloo": _m_rloo, "batch_std": _m_batch_std}


def masked_advantages(rewards: Tensor, keep: Tensor, estimator: str) -> tuple[Tensor, Tensor]:
    """Advantages of `estimator` computed over the kept rows of each group only.

    rewards (B, G) float, keep (B, G) bool. Returns adv (B, G), exactly 0 on rows not kept and in groups
    with fewer than 2 kept rows or whose kept rewards span less than ZERO_VAR_EPS (no signal, as
    advantages.py), and that mask zero (B,) bool. With every row kept it is ADVANTAGES[estimator] (to
    rounding: tests/test_interventions.py).
    """
    _check("masked_advantages", rewards=rewards, keep=keep)
    if estimator not in MASKED:
        raise KeyError(f"unknown advantage estimator {estimator!r}; known: {', '.join(MASKED)}")
    big = torch.finfo(rewards.dtype).max
    hi = torch.where(keep, rewards, torch.full_like(rewards, -big)).amax(1)
    lo = torch.where(keep, rewards, torch.full_like(rewards, big)).amin(1)
    zero = (keep.sum(1) < 2) | ((hi - lo) < ZERO_VAR_EPS)  # (B,)
    adv = MASKED[estimator](rewards, keep)
    return torch.where(zero[:, None] | ~keep, torch.zeros_like(adv), adv), zero


def screen(rewards: Tensor, flags: Tensor, estimator: str, baseline: str) -> tuple[Tensor, Tensor, Stats]:
    """Screening: flagged rows leave the loss (and, with baseline "drop", their group's baseline).

    rewards (B, G) float, flags (B, G) bool. Returns adv (B, G) (0 on flagged rows), the rows kept in the
    loss (B, G) bool (= ~flags: the loop gives the others weight 0) and stats: monitor/screened_frac and
    groups/screened_out (groups left without signal by the screen that had it before).
    baseline "drop": adv = masked_advantages(rewards, ~flags); "keep": ADVANTAGES[estimator](rewards)
    with the flagged rows' advantages set to 0 (they still shift the baseline of the others).
    """
    _check("screen", rewards=rewards, flags=flags)
    before = ADVANTAGES[estimator](rewards)[0].abs().amax(1) > 0  # (B,) groups with signal unscreened
    if baseline == "drop":
        adv, _ = masked_advantages(rewards, ~flags, estimator)
    elif baseline == "keep":
        adv = torch.where(flags, torch.zeros_like(rewards), ADVANTAGES[estimator](rewards)[0])
    else:
        raise ValueError(f"screen: baseline must be 'drop' or 'keep', got {baseline!r}")
    after = adv.abs().amax(1) > 0
    return adv, ~flags, {"monitor/screened_frac": flags.float().mean().detach(),
                         "groups/screened_out": (before & ~after).float().sum().detach()}


def advantage(adv: Tensor, scores: Tensor, coef: float) -> tuple[Tensor, Stats]:
    """Advantage Modification: adv (B, G) - coef * (scores - mean_g scores); scores (B, G) in [0, 1].

    stats: monitor/adv_shift, the mean |coef * centred score| over the B*G rows (how much the score moved
    the advantages).
    """
    _check("advantage", adv=adv, scores=scores)
    if coef < 0:
        raise ValueError(f"advantage: coef must be >= 0, got {coef}")
    shift = coef * (scores - scores.mean(1, keepdim=True)).to(adv.dtype)  # (B, G)
    return adv - shift, {"monitor/adv_shift": shift.abs().mean().detach()}


def adv_stats(adv: Tensor) -> Stats:
    """adv/mean, adv/std, adv/abs_max of the advantages trained on (as advantages.py defines them)."""
    a = adv.detach()
    return {"adv/mean": a.mean(), "adv/std": a.std(), "adv/abs_max": a.abs().max()}


def precision_recall(flags: Tensor, truth: Tensor) -> Stats:
    """A monitor's flags (N,) bool against the oracle's exploited flags (N,) bool.

    monitor/precision = flagged hacks / flagged (absent when nothing is flagged), monitor/recall = flagged
    hacks / hacks (absent when there is no hack), monitor/flagged_frac = flagged / N. An undefined ratio
    has no key rather than a made-up 0 (as run/row.py's per-mode rates).
    """
    if flags.shape != truth.shape or flags.dim() != 1:
        raise ValueError(f"precision_recall: flags and truth must both be (N,); got {tuple(flags.shape)}, "
                         f"{tuple(truth.shape)}")
    tp = (flags & truth).sum()
    out = {"monitor/flagged_frac": flags.float().mean() if flags.numel() else torch.zeros(())}
    if flags.any():
        out["monitor/precision"] = tp / flags.sum()
    if truth.any():
        out["monitor/recall"] = tp / truth.sum()
    return {k: v.detach().float() for k, v in out.items()}
