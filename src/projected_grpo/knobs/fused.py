"""The knob Linear as one autograd Function per knob kind: the plain layer's matmul plus thin projections.

Forward: y = x·W_effᵀ + b with W_eff = W + ΔW merged by the caller (adapters.KnobLinear caches it), so a
knob forward costs what the plain model's does. Backward: ∂L/∂x = ∂L/∂y·W_eff, and the knob gradient
from thin projections of the saved input, recomputed here rather than saved in the forward:
  svd : ∂L/∂δS = Σ_tokens (x·Vhᵀ) ⊙ (∂L/∂y·U)          (R,)      ΔW = U·diag(δS)·Vh
  lora: ∂L/∂B  = Σ_tokens (∂L/∂y)ᵀ·(x·Aᵀ)              (d_out, r) ΔW = B·A
W, b, U, Vh, A get no gradient (frozen). With `record` given, the knob gradient is first reduced per
sequence, (N, R) fp32, handed to `record` (the per-source split, split.py) and then summed: this runs
in the backward of the original graph node, so it works under gradient checkpointing too.
Not here: merging and caching W_eff, flags, capture bookkeeping (adapters.py, split.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Record = Callable[[Tensor], None]


def _wide(t: Tensor) -> Tensor:
    """t in at least fp32 (bf16 -> fp32, fp64 stays): the precision knob gradients are reduced in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _svd_per_token(x: Tensor, dy: Tensor, U: Tensor, Vh: Tensor) -> Tensor:
    """x (..., d_in), dy (..., d_out) -> (x·Vhᵀ) ⊙ (dy·U) (..., R) ≥ fp32: each token's term of ∂L/∂δS.
    The projections run in the activations' dtype (as the plain layer's matmuls), the product in ≥ fp32."""
    return _wide(x @ Vh.T) * _wide(dy @ U)


def svd_knob_grad(x: Tensor, dy: Tensor, U: Tensor, Vh: Tensor, per_sequence: bool) -> Tensor:
    """∂L/∂δS from x (N, ..., d_in) and dy (N, ..., d_out): (R,), or per sequence (N, R); ≥ fp32."""
    per_tok = _svd_per_token(x, dy, U, Vh)  # (N, ..., R)
    R = per_tok.shape[-1]
    if per_sequence:
        return per_tok.reshape(per_tok.shape[0], -1, R).sum(1)  # (N, R)
    return per_tok.reshape(-1, R).sum(0)  # (R,)


def lora_knob_grad(x: Tensor, dy: Tensor, A: Tensor, per_sequence: bool) -> Tensor:
    """∂L/∂B from x (N, ..., d_in), dy (N, ..., d_out): (d_out, r), or per sequence (N, d_out·r); ≥ fp32."""
    h = x @ A.T  # (N, ..., r)
    if per_sequence:
        N = h.shape[0]
        g = torch.einsum("nto,ntr->nor", _wide(dy).reshape(N, -1, dy.shape[-1]),
                         _wide(h).reshape(N, -1, h.shape[-1]))  # (N, d_out, r)
        return g.reshape(N, -1)
    # one matmul over all tokens, in the activations' dtype as autograd's own weight gradients are
    return _wide(dy.reshape(-1, dy.shape[-1]).T @ h.reshape(-1, h.shape[-1]))  # (d_out, r)


def _forward(ctx, x: Tensor, delta: Tensor, W_eff: Tensor, bias: Tensor | None, record: Record | None,
             frozen: tuple[Tensor, ...]) -> Tensor:
    ctx.knob_dtype = delta.dtype
    ctx.save_for_backward(x)  # autograd's copy; under checkpointing it is recomputed in the backward
    ctx.W_eff, ctx.frozen, ctx.record = W_eff, frozen, record  # constants, never written in place
    return F.linear(x, W_eff, bias)  # exactly what nn.Linear's forward does, with W_eff for W


def _backward(ctx, dy: Tensor, knob_grad) -> tuple[Tensor | None, Tensor | None]:
    """-> (∂L/∂x (..., d_in) or None, the knob gradient fp32 (flat or knob-shaped) or None)."""
    (x,) = ctx.saved_tensors
    dx = dy @ ctx.W_eff if ctx.needs_input_grad[0] else None  # as the plain layer's backward
    if ctx.record is not None:
        per_seq = knob_grad(x, dy, *ctx.frozen, per_sequence=True)  # (N, R)
        ctx.record(per_seq)
        return dx, per_seq.sum(0).to(ctx.knob_dtype)
    if ctx.needs_input_grad[1]:
        return dx, knob_grad(x, dy, *ctx.frozen, per_sequence=False).to(ctx.knob_dtype)
    return dx, None


class SVDLinear(torch.autograd.Function):
    """apply(x (..., d_in), delta_S (R,), W_eff (d_out, d_in), bias (d_out,)|None, record|None, U (d_out, R),
    Vh (R, d_in)) -> y (..., d_out); gradients for x and delta_S only (delta_S's in its dtype)."""

    @staticmethod
    def forward(ctx, x, delta, W_eff, bias, record, U, Vh):
        return _forward(ctx, x, delta, W_eff, bias, record, (U, Vh))

    @staticmethod
    def backward(ctx, dy):
        dx, d_delta = _backward(ctx, dy, svd_knob_grad)
        return dx, d_delta, None, None, None, None, None


class LoRALinear(torch.autograd.Function):
    """apply(x (..., d_in), B (d_out, r), W_eff (d_out, d_in), bias|None, record|None, A (r, d_in))
    -> y (..., d_out); gradients for x and B only (B's in its dtype)."""

    @staticmethod
    def forward(ctx, x, delta, W_eff, bias, record, A):
        return _forward(ctx, x, delta, W_eff, bias, record, (A,))

    @staticmethod
    def backward(ctx, dy):
        dx, d_delta = _backward(ctx, dy, lora_knob_grad)
        r = ctx.frozen[0].shape[0]
        return dx, None if d_delta is None else d_delta.reshape(-1, r), None, None, None, None
