"""The pre-fusion knob forward: the plain layer plus a side branch differentiated by autograd.

  svd : y = x·Wᵀ + b + ((x·Vhᵀ) ⊙ (δS + δS_hack))·Uᵀ        lora: y = x·Wᵀ + b + (x·Aᵀ)·(B + B_hack)ᵀ
with per-sequence capture through a tensor hook on the branch. This was adapters.KnobLinear's forward
until the fused Functions (fused.py); it is kept as the oracle the tests compare the fused gradients
with and as the baseline of benchmarks/knob_step.py. `branch_path(knobs)` routes every wrapped module
through it for the duration of a `with`. It does not support gradient checkpointing (a replayed
forward registers hooks that never fire) and is not meant for training.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor


def _svd_branch(m, x: Tensor, coef: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    h = x @ m.Vh.T  # (..., R)
    t = h * coef  # (..., R); its grad is ∂L/∂y·U, the per-token factor of ∂L/∂δS
    return t @ m.U.T, t, h


def _svd_per_sequence(h: Tensor, grad: Tensor) -> Tensor:
    return (h.float() * grad.float()).reshape(h.shape[0], -1, h.shape[-1]).sum(1)  # (N, R)


def _lora_branch(m, x: Tensor, coef: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    h = x @ m.A.T  # (..., r)
    out = h @ coef.T  # (..., d_out); its grad is ∂L/∂y
    return out, out, h


def _lora_per_sequence(h: Tensor, grad: Tensor) -> Tensor:
    N = h.shape[0]
    g = torch.einsum("nto,ntr->nor", grad.float().reshape(N, -1, grad.shape[-1]),
                     h.float().reshape(N, -1, h.shape[-1]))
    return g.reshape(N, -1)  # (N, d_out·r)


# kind -> (branch(m, x, coef) -> (out, tensor to hook, its features h), per_sequence(h, grad) -> (N, R))
BRANCHES = {"svd": (_svd_branch, _svd_per_sequence), "lora": (_lora_branch, _lora_per_sequence)}


def branch_forward(m, x: Tensor) -> Tensor:
    """The old KnobLinear.forward of module m (an adapters.KnobLinear) on x (..., d_in)."""
    y = m.base(x)
    if not m.use_main:
        return y
    coef = m.delta + m.delta_hack.detach() if m.use_hack else m.delta
    branch, per_sequence = BRANCHES[m.kind]
    out, watched, h = branch(m, x, coef.to(x.dtype))
    if m.capture is not None and watched.requires_grad:
        record = m.capture.watch(m.name, tuple(h.shape[:-1]))
        watched.register_hook(lambda grad: record(per_sequence(h, grad)))
    return y + out


@contextlib.contextmanager
def branch_path(knobs) -> Iterator[None]:
    """Context: every module of `knobs` (an adapters.Knobs) runs `branch_forward` instead of its fused
    forward; restored on exit."""
    try:
        for m in knobs.modules.values():
            m.forward = functools.partial(branch_forward, m)
        yield
    finally:
        for m in knobs.modules.values():
            vars(m).pop("forward", None)
