"""The sampler-trainer mismatch of the students: how far the distribution mu they were sampled from is from
the policy pi_theta the loss scores them with.

With one optimizer step per generation the loop takes a student token's ratio pi_theta / mu as exactly 1
(objective/teacher.py). That holds when the sampler runs the policy itself; sampling from a bf16 copy of the
weights (rollout.sample_dtype, sampling/packed.py), a top_p < 1 nucleus (mu renormalised over it) or another
batch shape's rounding makes mu differ, and the ratio is then not corrected, only measured here
(docs/metrics.md, sample/*). Pure tensor functions; not here: the samplers, the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sampler_mismatch(logp: Tensor, logp_behaviour: Tensor, is_student: Tensor,
                     mask: Tensor) -> dict[str, Tensor]:
    """Means over the student tokens of r = logp - logp_behaviour = log(pi_theta / mu):

    sample/kl                 k3 = exp(r) - 1 - r, an unbiased, non-negative estimate of KL(mu || pi_theta)
                              from tokens drawn from mu (Schulman 2020, "Approximating KL divergence");
    sample/logratio_abs_mean  |r|, the typical size of the ignored log-ratio.
    logp, logp_behaviour, mask (N, T); is_student (N,) bool. Detached 0-d tensors; 0 without student tokens.
    """
    m = mask * is_student[:, None].to(mask.dtype)  # (N, T)
    n = m.sum().clamp(min=1.0)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    r = torch.where(m > 0, logp.detach() - logp_behaviour, zero)  # where: a masked inf must read 0
    return {"sample/kl": ((torch.expm1(r) - r) * m).sum() / n,
            "sample/logratio_abs_mean": (r.abs() * m).sum() / n}
