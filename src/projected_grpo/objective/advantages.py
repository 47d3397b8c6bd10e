"""Group-relative advantages over a (B, G) reward matrix: GRPO, Dr.GRPO, RLOO, batch-std.

Each estimator is a pure function `fn(rewards (B, G)) -> (adv (B, G), stats)`, chosen once by name
from `ADVANTAGES`. A mixed rollout pool is not special here: a prompt's group of G_s live student
samples and G_t cached teacher samples is just the (B, G_s + G_t) matrix `torch.cat([r_s, r_t], 1)`,
and every estimator treats all G columns alike (baseline and scale use the whole mixed group).

Every estimator returns exactly 0 for a zero-variance group, max_g R - min_g R < ZERO_VAR_EPS (the
original study's test): float rounding in the group mean would otherwise leave ~1e-17 residues, which grpo's
1/(std + eps) blows up to ~1e-13, and rewards that differ only by float noise carry no signal.
Not here: token-level advantages (GAE lives in losses.py) and reward shaping.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Stats = dict[str, torch.Tensor]

# TRL GRPOTrainer divides by (std + 1e-4) and uses torch.std (Bessel-corrected, unbiased);
# verl's GRPO estimator also uses torch.std but eps 1e-6. We follow TRL so runs are comparable to it.
STD_EPS = 1e-4

# A group whose rewards span less than this is zero-variance (`max(R) - min(R) < eps`).
# 1e-6: above float32 noise at the rewards' scale (an ulp of 3.5, the largest rl_rewardhacking reward,
# is 2.4e-7), far below the smallest real step between rewards (0.25, the format credit); verl's
# GRPO uses 1e-6 as its epsilon too. Absolute, so rewards in the thousands would need a larger one.
ZERO_VAR_EPS = 1e-6


def _check_rewards(rewards: torch.Tensor, what: str) -> tuple[int, int]:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"{what}: rewards must be a torch.Tensor of shape (B, G), "
                        f"got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"{what}: rewards must have shape (B prompts, G group), got {tuple(rewards.shape)}")
    B, G = rewards.shape
    if B < 1:
        raise ValueError(f"{what}: rewards has no prompts (B=0), shape {tuple(rewards.shape)}")
    if G < 2:
        raise ValueError(
            f"{what}: a group-relative advantage needs G >= 2 samples per prompt, got G={G} "
            f"(shape {tuple(rewards.shape)}); with one sample the group baseline is the sample itself")
    if not rewards.is_floating_point():
        raise TypeError(f"{what}: rewards must be a floating tensor, got dtype {rewards.dtype}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(f"{what}: rewards contain a non-finite value, first at (b, g)={tuple(bad)}")
    return B, G


def zero_variance_mask(rewards: torch.Tensor, eps: float = ZERO_VAR_EPS) -> torch.Tensor:
    """True for groups with no learning signal: max_g R - min_g R < eps (all G rewards equal up to eps).

    rewards: (B, G) float.  Returns (B,) bool.
    """
    _check_rewards(rewards, "zero_variance_mask")
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) < eps  # (B,)


def _finish(adv: torch.Tensor, rewards: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, Stats]:
    adv = torch.where(zero[:, None], torch.zeros_like(adv), adv)  # exact 0 for zero-variance groups
    r, a = rewards.detach(), adv.detach()
    stats = {
        "reward/mean": r.mean(),
        "reward/std": r.std(),
        "reward/frac_zero_std": zero.float().mean(),
        "reward/informative": (~zero).float().mean(),  # groups that teach something
        "adv/mean": a.mean(),
        "adv/std": a.std(),
        "adv/abs_max": a.abs().max(),
    }
    return adv, stats


def grpo_advantages(rewards: torch.Tensor, *, eps: float = STD_EPS) -> tuple[torch.Tensor, Stats]:
    """Std-normalised GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
    adv = (R - mean_g R) / (std_g R + eps), std Bessel-corrected (divides by G - 1), eps = 1e-4 (TRL).

    rewards: (B, G).  Returns adv (B, G) and stats.
    """
    _check_rewards(rewards, "grpo_advantages")
    mean = rewards.mean(dim=1, keepdim=True)  # (B, 1)
    std = rewards.std(dim=1, keepdim=True, correction=1)  # (B, 1)
    return _finish((rewards - mean) / (std + eps), rewards, zero_variance_mask(rewards))


def dr_grpo_advantages(rewards: torch.Tensor) -> tuple[torch.Tensor, Stats]:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): adv = R - mean_g R, no division by the std.

    # Dr. GRPO: dividing by the group std up-weights near-unanimous (too easy / too hard) prompts.
    rewards: (B, G).  Returns adv (B, G) and stats.
    """
    _check_rewards(rewards, "dr_grpo_advantages")
    return _finish(rewards - rewards.mean(dim=1, keepdim=True), rewards, zero_variance_mask(rewards))


def rloo_advantages(rewards: torch.Tensor) -> tuple[torch.Tensor, Stats]:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740): leave-one-out baseline,
    adv_i = R_i - (1 / (G - 1)) * sum_{j != i} R_j  ( = G / (G - 1) * (R_i - mean_g R) ).

    rewards: (B, G) with G >= 2.  Returns adv (B, G) and stats.
    """
    if isinstance(rewards, torch.Tensor) and rewards.dim() == 2 and rewards.shape[1] == 1:
        raise ValueError(
            f"rloo_advantages: RLOO needs G >= 2 samples per prompt, got G=1 (rewards shape "
            f"{tuple(rewards.shape)}): the leave-one-out baseline averages the *other* samples "
            "and there are none")
    B, G = _check_rewards(rewards, "rloo_advantages")
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)  # (B, G), mean of the others
    return _finish(rewards - baseline, rewards, zero_variance_mask(rewards))


def batch_std_advantages(rewards: torch.Tensor, *, eps: float = STD_EPS) -> tuple[torch.Tensor, Stats]:
    """Group-centred, batch-scaled: adv = (R - mean_g R) / (std over all B*G rewards + eps).

    TRL `scale_rewards="batch"`; "group mean, batch std" of Liu et al. 2025 ("Tricks or Traps",
    arXiv:2508.08221) and REINFORCE++-baseline (Hu 2025, arXiv:2501.03262). Std Bessel-corrected.
    rewards: (B, G).  Returns adv (B, G) and stats.
    """
    _check_rewards(rewards, "batch_std_advantages")
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (B, G)
    return _finish(centred / (rewards.std(correction=1) + eps), rewards, zero_variance_mask(rewards))


ADVANTAGES: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, Stats]]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "batch_std": batch_std_advantages,
}
