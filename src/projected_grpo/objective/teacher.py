"""How cached teacher rows enter the loss: `TEACHER_MODES[name]` (docs/losses.md, "Teacher rows").

With one optimizer step per generation the PPO ratio of a student token is exactly 1. A teacher row
was sampled by another model (or written by hand), so the honest choices differ:
`imitation` recomputes logp_old on the current policy (ratio forced to 1: advantage-weighted imitation,
the original study's), `importance` weights teacher tokens by the truncated ratio pi/mu of the stored
behaviour log-probs, `exclude` keeps teacher rewards in the group baseline but gives their tokens no loss.
Pure tensor functions; not here: the pool's storage (run/pool.py), the surrogate itself (losses.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Each mode: (logp (N, T) detached current policy, logp_behaviour (N, T), is_student (N,) bool,
# mask (N, T), is_trunc) -> (logp_old (N, T), weight (N, T), stats). The token loss is
# weight * (clip_surrogate(logp, logp_old, adv) + beta * kl); weight never changes the aggregation's
# denominators, so teacher rows count in the group baseline and the token counts in every mode.

TeacherFn = Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, dict]]


def _teacher_stats(mode: str, ratio: Tensor, weight: Tensor, is_student: Tensor, mask: Tensor,
                   trunc: Tensor) -> dict:
    m = mask * (~is_student)[:, None]
    n = m.sum().clamp(min=1.0)
    return {"teacher/mode": mode, "teacher/ratio_mean": (ratio * m).sum() / n,
            "teacher/is_weight_mean": (weight * m).sum() / n,
            "teacher/clip_frac": (trunc.float() * m).sum() / n}


def teacher_imitation(logp, logp_behaviour, is_student, mask, is_trunc):
    """The original study's: logp_old is the current policy for every row, so the teacher ratio is forced
    to 1 and the teacher half is advantage-weighted imitation of fixed completions (docs/losses.md)."""
    one = torch.ones_like(logp)
    return logp.detach(), one, _teacher_stats("imitation", one, one, is_student, mask, torch.zeros_like(mask))


def teacher_importance(logp, logp_behaviour, is_student, mask, is_trunc):
    """Off-policy correction from the stored behaviour log-probs (docs/losses.md): per teacher token the ratio
    rho = pi_theta / mu = exp(logp - logp_behaviour), truncated at is_trunc (truncated IS, Espeholt et al.
    2018 arXiv:1802.01561), multiplies the clip surrogate as a detached weight; the surrogate's own ratio
    is to the current policy (decoupled PPO, Hilton et al. 2021 arXiv:2110.00641). Students: weight 1."""
    rho = torch.exp(logp.detach() - logp_behaviour) * mask  # (N, T); 0 on padding
    w = torch.where(is_student[:, None], torch.ones_like(rho), rho.clamp(max=is_trunc))
    trunc = (~is_student)[:, None] & (rho > is_trunc)
    return logp.detach(), w, _teacher_stats("importance", rho, w, is_student, mask, trunc)


def teacher_exclude(logp, logp_behaviour, is_student, mask, is_trunc):
    """Teacher rewards join the group baseline (advantages use the whole mixed group) but teacher
    tokens carry no loss: weight 0 on teacher rows (docs/losses.md)."""
    w = is_student[:, None].to(logp.dtype).expand_as(logp)
    one = torch.ones_like(logp)
    return logp.detach(), w, _teacher_stats("exclude", one, w, is_student, mask, torch.zeros_like(mask))


TEACHER_MODES: dict[str, TeacherFn] = {
    "imitation": teacher_imitation, "importance": teacher_importance, "exclude": teacher_exclude,
}
