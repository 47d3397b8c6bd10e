"""The knob Linear as one autograd Function per knob kind: the plain layer's matmul plus thin projections.

Forward: y = x·W_effᵀ + b with W_eff = W + ΔW merged by the caller (adapters.KnobLinear caches it), so a
knob forward costs what the plain model's does. Backward: ∂L/∂x = ∂L/∂y·W_eff, and the knob gradient
from what the forward kept (recomputed under checkpointing): the input x, or its thin projection x·Vhᵀ
(x·Aᵀ) where that is narrower than x and suffices, never a second (N, T, d_out) branch:
  svd : ∂L/∂δS = Σ_tokens (x·Vhᵀ) ⊙ (∂L/∂y·U)  (R,)       or diag(Uᵀ·G·Vhᵀ), G = Σ_tokens ∂L/∂yᵀ·x
  lora: ∂L/∂B  = Σ_tokens (∂L/∂y)ᵀ·(x·Aᵀ)      (d_out, r)
The svd knob takes the weight-gradient form when it costs fewer multiply-adds (full rank, many tokens).
W, b, U, Vh, A get no gradient (frozen). With a capture's `record` (a split.Watch), the backward hands
it the knob gradient per sequence (N, R), or per source; being the backward of the original graph
node, this works under gradient checkpointing too.
A low-rank knob can also run unmerged (SVDBranch, LoRABranch): y = x·Wᵀ + b + its branch, so no W_eff is
held for training, at the branch's cost per token (adapters.py chooses per module).
Not here: merging and caching W_eff, flags, capture bookkeeping (adapters.py, split.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Record = Callable[[Tensor], None]  # a split.Watch: per-sequence rows, or .sources(g_student, g_teacher)


def _wide(t: Tensor) -> Tensor:
    """t in at least fp32 (bf16 -> fp32, fp64 stays): the precision knob gradients are reduced in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _tokens(t: Tensor) -> Tensor:
    """(N, ..., d) -> (N·..., d): every token a row."""
    return t.reshape(-1, t.shape[-1])


def svd_knob_grad(x: Tensor, dy: Tensor, U: Tensor, Vh: Tensor, per_sequence: bool) -> Tensor:
    """∂L/∂δS = Σ_tokens (x·Vhᵀ) ⊙ (dy·U) from x (N, ..., d_in), dy (N, ..., d_out): (R,), or per sequence
    (N, R); ≥ fp32. The thin projections run in the activations' dtype, the product in ≥ fp32."""
    return _svd_grad_from_h(x @ Vh.T, dy, U, per_sequence)


def _svd_grad_from_h(h: Tensor, dy: Tensor, U: Tensor, per_sequence: bool) -> Tensor:
    """svd_knob_grad from h = x·Vhᵀ (N, ..., R), the thin projection the forward may keep instead of x."""
    return _svd_grad_from_hg(h, dy @ U, per_sequence)


def _svd_grad_from_hg(h: Tensor, g: Tensor, per_sequence: bool) -> Tensor:
    """svd_knob_grad from both thin projections, h = x·Vhᵀ and g = dy·U (N, ..., R)."""
    per_tok = _wide(h) * _wide(g)  # (N, ..., R): each token's term
    if per_sequence:
        return per_tok.reshape(per_tok.shape[0], -1, per_tok.shape[-1]).sum(1)  # (N, R)
    return _tokens(per_tok).sum(0)  # (R,)


def svd_knob_grad_dw(x: Tensor, dy: Tensor, U: Tensor, Vh: Tensor) -> Tensor:
    """The same ∂L/∂δS (R,) through the weight gradient G = Σ_tokens dyᵀ·x (d_out, d_in), as full
    fine-tuning computes it: ∂L/∂δS_i = u_iᵀ·G·v_i, the rows of (Uᵀ·G) ⊙ Vh summed. Costs
    tokens·d_in·d_out + R·d_out·d_in instead of tokens·R·(d_in + d_out): cheaper at full rank."""
    return _project_dw(_tokens(dy).T @ _tokens(x), U, Vh)


def _project_dw(G: Tensor, U: Tensor, Vh: Tensor) -> Tensor:
    """G (d_out, d_in) -> diag(Uᵀ·G·Vhᵀ) (R,)."""
    return ((U.T @ G) * Vh).sum(1)


def _svd_dw_by_source(x: Tensor, dy: Tensor, rec, U: Tensor, Vh: Tensor) -> Tensor:
    """svd_knob_grad_dw summed over the student rows and over the teacher rows, handed to rec.sources;
    returns their sum. One weight gradient per source, accumulated over its runs of consecutive rows
    (slices, no copies); never a 0/1-weighted sum, where 0 * NaN = NaN would leak one source's NaN into
    the other."""
    G: dict[bool, Tensor] = {}
    for a, b, student in rec.runs:
        dy_run, x_run = _tokens(dy[a:b]), _tokens(x[a:b])
        if student in G:
            G[student].addmm_(dy_run.T, x_run)
        else:
            G[student] = dy_run.T @ x_run  # (d_out, d_in)
    g = {k: _project_dw(G_k, U, Vh) for k, G_k in G.items()}
    zero = torch.zeros(U.shape[1], dtype=dy.dtype, device=dy.device)
    g_s, g_t = g.get(True, zero), g.get(False, zero)
    rec.sources(g_s, g_t)
    return g_s + g_t


def _svd_dw_pays(t: Tensor, U: Tensor, Vh: Tensor, groups: int) -> bool:
    """Whether svd_knob_grad_dw over `groups` row sets costs fewer multiply-adds than the thin projections
    for the tokens of t (x or dy, (..., d)). Only for fp32/fp64: G rounded to bf16 would lose what u_iᵀ·G·v_i
    cancels to."""
    if t.dtype not in (torch.float32, torch.float64):
        return False
    (d_out, R), d_in, n = U.shape, Vh.shape[1], t.numel() // t.shape[-1]
    return n * d_in * d_out + groups * R * d_out * d_in < n * R * (d_in + d_out)


def lora_knob_grad(x: Tensor, dy: Tensor, A: Tensor, per_sequence: bool) -> Tensor:
    """∂L/∂B from x (N, ..., d_in), dy (N, ..., d_out): (d_out, r), or per sequence (N, d_out·r); ≥ fp32."""
    return _lora_grad_from_h(x @ A.T, dy, per_sequence)


def _lora_grad_from_h(h: Tensor, dy: Tensor, per_sequence: bool) -> Tensor:
    """lora_knob_grad from h = x·Aᵀ (N, ..., r), the thin projection the forward keeps instead of x."""
    if per_sequence:
        N = h.shape[0]
        g = torch.einsum("nto,ntr->nor", _wide(dy).reshape(N, -1, dy.shape[-1]),
                         _wide(h).reshape(N, -1, h.shape[-1]))  # (N, d_out, r)
        return g.reshape(N, -1)
    # one matmul over all tokens, in the activations' dtype as autograd's own weight gradients are
    return _wide(_tokens(dy).T @ _tokens(h))  # (d_out, r)


def _forward(ctx, x: Tensor, delta: Tensor, W_eff: Tensor, bias: Tensor | None, record: Record | None,
             frozen: tuple[Tensor, ...], P: Tensor | None) -> Tensor:
    """y = x·W_effᵀ + b. Keeps for the backward W_eff and the narrower of x and h = x·Pᵀ (N, ..., R), P the
    knob's input projection (svd Vh, lora A) or None when the knob gradient needs x itself: h when R < d_in
    (the down projection at full svd rank, every lora module), so x, often an activation nothing else
    keeps, is freed after the forward (docs/benchmarks.md, memory). Saved with save_for_backward, not as ctx
    attributes, so autograd frees both after the backward: as an attribute W_eff lived as long as the graph,
    through the next step's re-merge and forward. Under checkpointing both are recomputed in the backward."""
    ctx.knob_dtype = delta.dtype
    ctx.keeps_h = P is not None and P.shape[0] < x.shape[-1]
    ctx.save_for_backward(x @ P.T if ctx.keeps_h else x, W_eff)
    ctx.frozen, ctx.record = frozen, record  # constants (frozen buffers, the capture's watch)
    return F.linear(x, W_eff, bias)  # exactly what nn.Linear's forward does, with W_eff for W


def _backward(ctx, dy: Tensor, per_seq_fn, total_fn, by_source_fn) -> tuple[Tensor | None, Tensor | None]:
    """-> (∂L/∂x (..., d_in) or None, the knob gradient (flat or knob-shaped) or None).

    s is what the forward kept (x, or h when ctx.keeps_h): per_seq_fn(s, dy) -> (N, R); total_fn(s, dy) ->
    the knob gradient summed over all rows; by_source_fn(x, dy, rec) -> the same, after handing rec its
    per-source sums, or None: then a capture that wants no per-sequence rows gets its per-source sums from
    the per-sequence rows."""
    s, W_eff = ctx.saved_tensors
    dx = dy @ W_eff if ctx.needs_input_grad[0] else None  # as the plain layer's backward
    rec = ctx.record
    if rec is None:
        d_delta = total_fn(s, dy) if ctx.needs_input_grad[1] else None
    elif by_source_fn is not None and not rec.per_sequence:
        d_delta = by_source_fn(s, dy, rec)
    else:
        per_seq = per_seq_fn(s, dy)  # (N, R)
        rec(per_seq)
        d_delta = per_seq.sum(0)
    return dx, None if d_delta is None else d_delta.to(ctx.knob_dtype)


class SVDLinear(torch.autograd.Function):
    """apply(x (..., d_in), delta_S (R,), W_eff (d_out, d_in), bias (d_out,)|None, record|None, U (d_out, R),
    Vh (R, d_in)) -> y (..., d_out); gradients for x and delta_S only (delta_S's in its dtype)."""

    @staticmethod
    def forward(ctx, x, delta, W_eff, bias, record, U, Vh):
        # h = x·Vhᵀ is enough unless the weight gradient pays (then x): decided from x alone, never from
        # `record`, so a checkpointed replay (record None) keeps what the original forward kept. Where even
        # one row set's weight gradient does not pay, two (per source) do not either.
        return _forward(ctx, x, delta, W_eff, bias, record, (U, Vh),
                        None if _svd_dw_pays(x, U, Vh, 1) else Vh)

    @staticmethod
    def backward(ctx, dy):
        U, Vh = ctx.frozen
        rec = ctx.record
        groups = 1 if rec is None else (rec.n_student > 0) + (rec.n_teacher > 0)
        if ctx.keeps_h:  # from the kept h = x·Vhᵀ
            thin = functools.partial(_svd_grad_from_h, U=U)
        else:
            thin = functools.partial(svd_knob_grad, U=U, Vh=Vh)
        if not ctx.keeps_h and _svd_dw_pays(dy, U, Vh, groups):  # full rank, many tokens: the weight gradient
            total = functools.partial(svd_knob_grad_dw, U=U, Vh=Vh)
            by_source = functools.partial(_svd_dw_by_source, U=U, Vh=Vh)
        else:
            total, by_source = functools.partial(thin, per_sequence=False), None
        dx, d_delta = _backward(ctx, dy, functools.partial(thin, per_sequence=True), total, by_source)
        return dx, d_delta, None, None, None, None, None


class LoRALinear(torch.autograd.Function):
    """apply(x (..., d_in), B (d_out, r), W_eff (d_out, d_in), bias|None, record|None, A (r, d_in))
    -> y (..., d_out); gradients for x and B only (B's in its dtype)."""

    @staticmethod
    def forward(ctx, x, delta, W_eff, bias, record, A):
        return _forward(ctx, x, delta, W_eff, bias, record, (A,), A)

    @staticmethod
    def backward(ctx, dy):
        (A,) = ctx.frozen
        grad = _lora_grad_from_h if ctx.keeps_h else functools.partial(lora_knob_grad, A=A)
        # per source from the per-sequence rows: the einsum costs what one matmul over all tokens does
        dx, d_delta = _backward(ctx, dy, functools.partial(grad, per_sequence=True),
                                functools.partial(grad, per_sequence=False), None)
        r = A.shape[0]
        return dx, None if d_delta is None else d_delta.reshape(-1, r), None, None, None, None


# --- low-rank knobs, unmerged: the plain layer plus the knob's branch, no W_eff -----------------------


def _knob_grad(ctx, per_seq_fn, total_fn) -> Tensor | None:
    """The knob gradient (flat or knob-shaped, the knob's dtype) from per_seq_fn() -> (N, R) and total_fn()
    -> summed over rows, handing the capture's watch its per-sequence rows (it sums them per source)."""
    rec = ctx.record
    if rec is None:
        d = total_fn() if ctx.needs_input_grad[1] else None
    else:
        per_seq = per_seq_fn()  # (N, R)
        rec(per_seq)
        d = per_seq.sum(0)
    return None if d is None else d.to(ctx.knob_dtype)


def svd_branch(x: Tensor, coef: Tensor, W: Tensor, bias: Tensor | None, U: Tensor, Vh: Tensor
               ) -> tuple[Tensor, Tensor]:
    """(y = x·Wᵀ + b + ((x·Vhᵀ) ⊙ coef)·Uᵀ (..., d_out), h = x·Vhᵀ (..., R)): the svd layer, unmerged."""
    h = x @ Vh.T
    return F.linear(x, W, bias) + (h * coef.to(h.dtype)) @ U.T, h


def lora_branch(x: Tensor, coef: Tensor, W: Tensor, bias: Tensor | None, A: Tensor) -> tuple[Tensor, Tensor]:
    """(y = x·Wᵀ + b + (x·Aᵀ)·coefᵀ (..., d_out), h = x·Aᵀ (..., r)): the lora knob's layer, unmerged."""
    h = x @ A.T
    return F.linear(x, W, bias) + h @ coef.to(h.dtype).T, h


class SVDBranch(torch.autograd.Function):
    """apply(x (..., d_in), delta_S (R,), coef (R,), W (d_out, d_in), bias|None, record|None, U (d_out, R),
    Vh (R, d_in)) -> y = x·Wᵀ + b + ((x·Vhᵀ) ⊙ coef)·Uᵀ, coef = δS (+ δS_hack): the merged forward's value
    without its W_eff (adapters.py decides which a module uses). Keeps h = x·Vhᵀ (N, ..., R); the backward's
    g = dy·U serves both ∂L/∂x = dy·W + (g ⊙ coef)·Vh and ∂L/∂δS = Σ_tokens h ⊙ g. Gradients for x and
    delta_S only (coef's quarantine part is moved by the route arm, never by a gradient)."""

    @staticmethod
    def forward(ctx, x, delta, coef, W, bias, record, U, Vh):
        y, h = svd_branch(x, coef, W, bias, U, Vh)
        ctx.save_for_backward(h, W, coef)
        ctx.frozen, ctx.record, ctx.knob_dtype = (U, Vh), record, delta.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        h, W, coef = ctx.saved_tensors
        U, Vh = ctx.frozen
        g = dy @ U  # (..., R)
        dx = dy @ W + (g * coef.to(g.dtype)) @ Vh if ctx.needs_input_grad[0] else None
        d = _knob_grad(ctx, lambda: _svd_grad_from_hg(h, g, True), lambda: _svd_grad_from_hg(h, g, False))
        return dx, d, None, None, None, None, None, None


class LoRABranch(torch.autograd.Function):
    """apply(x (..., d_in), B (d_out, r), coef (d_out, r), W (d_out, d_in), bias|None, record|None,
    A (r, d_in)) -> y = x·Wᵀ + b + (x·Aᵀ)·coefᵀ, coef = B (+ B_hack), without W_eff (as SVDBranch). Keeps
    h = x·Aᵀ; ∂L/∂x = dy·W + (dy·coef)·A, ∂L/∂B = Σ_tokens dyᵀ·h. Gradients for x and B only."""

    @staticmethod
    def forward(ctx, x, delta, coef, W, bias, record, A):
        y, h = lora_branch(x, coef, W, bias, A)
        ctx.save_for_backward(h, W, coef)
        ctx.frozen, ctx.record, ctx.knob_dtype = (A,), record, delta.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        h, W, coef = ctx.saved_tensors
        (A,) = ctx.frozen
        dx = dy @ W + (dy @ coef.to(dy.dtype)) @ A if ctx.needs_input_grad[0] else None
        d = _knob_grad(ctx, lambda: _lora_grad_from_h(h, dy, True), lambda: _lora_grad_from_h(h, dy, False))
        return dx, None if d is None else d.reshape(coef.shape), None, None, None, None, None
