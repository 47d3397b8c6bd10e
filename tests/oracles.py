"""Test oracles: slow, plainly written references that the library's fast paths are checked against.

Nothing in src/ imports this file; tests and benchmarks do (benchmarks put tests/ on sys.path).
  branch_path         the pre-fusion knob forward: the plain layer plus a side branch differentiated by
                      autograd (the oracle of knobs/fused.py, the baseline of benchmarks/knob_step.py)
  two_backward_split  the per-source gradient split from two backwards (the oracle of knobs/split.Capture)
  pair_grads_isolated per-pair knob gradients from one isolated forward + backward per pair and label (the
                      oracle of hack/knob_grads.pair_grads)

The pre-fusion knob forward:
  svd : y = x·Wᵀ + b + ((x·Vhᵀ) ⊙ (δS + δS_hack))·Uᵀ        lora: y = x·Wᵀ + b + (x·Aᵀ)·(B + B_hack)ᵀ
with per-sequence capture through a tensor hook on the branch. `branch_path(knobs)` routes every wrapped
module through it for the duration of a `with`. It does not support gradient checkpointing (a replayed
forward registers hooks that never fire) and is not meant for training.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from projected_grpo.hack.knob_grads import _check_finite, _not_on_graph, _setup, _split_labels
from projected_grpo.hack.pairs import Pair
from projected_grpo.sampling.pack import pack
from projected_grpo.sampling.score import forward_logprobs

# --- the pre-fusion knob forward ---------------------------------------------------------------------------

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


# --- the two-backward split ---------------------------------------------------------------------------------

def two_backward_split(knobs, loss_student: torch.Tensor, loss_teacher: torch.Tensor
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The two-backward method (≈2× backward cost), kept as the oracle for `Capture`.

    loss_student, loss_teacher: scalars from ONE forward whose sum is the full loss. Returns
    (g_student, g_teacher): dict[name, (R,)] and leaves main knob .grad = g_student + g_teacher.
    The grad reset between the passes is load-bearing: .grad accumulates, so without it g_teacher
    would also contain g_student (seed note).
    """
    params = knobs.parameters()
    for p in params:
        p.grad = None
    loss_student.backward(retain_graph=True)
    g_s = {n: g.clone() for n, g in knobs.grads("main").items()}
    for p in params:
        p.grad = None
    loss_teacher.backward()
    g_t = {n: g.clone() for n, g in knobs.grads("main").items()}
    knobs.set_grads({n: g_s[n] + g_t[n] for n in g_s}, "main")
    return g_s, g_t


# --- isolated per-pair gradients ----------------------------------------------------------------------------

def pair_grads_isolated(model, knobs, tokenizer, pairs: Sequence[Pair], norm: str = "mean",
                        nll_const: float = 1.0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The test oracle for `pair_grads`: the same (P, R) outputs from one isolated forward +
    `torch.autograd.grad` per pair and label (2P backwards; slow). Needs only knobs.modules[n].delta."""
    nll_fn, seqs, names, params, pad_id, device = _setup(model, knobs, tokenizer, pairs, norm)
    rows: dict[str, list[Tensor]] = {n: [] for n in names}
    was_training = model.training
    model.eval()
    try:
        for s in seqs:
            batch = pack([s[2]], [s[3]], pad_id).to(device)
            with torch.enable_grad():
                logp, _ = forward_logprobs(model, batch)  # (1, T)
                nll = nll_fn(logp.float(), batch.completion_mask, nll_const)  # (1,)
                _check_finite(nll, [s], pairs)
                grads = torch.autograd.grad(nll[0], params, allow_unused=True)
            for n, g in zip(names, grads):
                if g is None:
                    raise _not_on_graph(n)
                rows[n].append(g.detach().reshape(-1).float().cpu())
    finally:
        model.train(was_training)
    return _split_labels({n: torch.stack(v) for n, v in rows.items()})
