"""Per-source (student vs teacher) knob gradients from ONE backward pass.

A knob's gradient is a sum over tokens of per-token terms (δS: (x·Vhᵀ) ⊙ (∂L/∂y·U); B: (∂L/∂y)ᵀ(x·Aᵀ)).
While `Knobs.capture(is_student)` is open, each knob forward with grad registers a watch, and the
backward of its fused Function (fused.py) reduces those terms per sequence, (N, R), and hands them to
the watch, which adds the student rows to `g_student` and the teacher rows to `g_teacher`. So
g_student + g_teacher = the knob's .grad from that backward, without the seed's second backward
(`two_backward_split`, kept as the test oracle). Nothing is kept alive between forward and backward
but the watch itself. Works under gradient checkpointing: the reduction runs in the original graph
node's backward, and a replayed forward registers no watch. One backward per forward: a second
backward through a retained graph raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class Capture:
    """Per-source knob grads of the backwards run inside one `Knobs.capture(is_student)` context.

    is_student: (N,) bool, one entry per sequence (row of the batch fed to the model).
    After the context: g_student, g_teacher: dict[name, (R,)] fp32; per_sequence: dict[name, (N, R)]
    (only if requested). Several backwards inside one context accumulate (like .grad). For gradient
    accumulation over microbatches with different masks, open one capture per microbatch and add them:
    `total = cap1 + cap2` (sums g_*, concatenates per_sequence along N).
    """

    def __init__(self, is_student: torch.Tensor, per_sequence: bool = False):
        if is_student.dtype != torch.bool or is_student.dim() != 1:
            raise ValueError(f"is_student must be a 1-D bool tensor (N,), got {is_student.dtype} "
                             f"{tuple(is_student.shape)}")
        self.is_student = is_student
        self.want_per_sequence = per_sequence
        self.g_student: dict[str, torch.Tensor] = {}
        self.g_teacher: dict[str, torch.Tensor] = {}
        self.per_sequence: dict[str, torch.Tensor] = {}
        self._watches: list[dict] = []
        self._w: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (student, teacher) masks

    def _masks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._w:
            s = self.is_student.to(device=device, dtype=torch.bool)
            self._w[device] = (s, ~s)
        return self._w[device]

    def watch(self, name: str, lead_shape: tuple[int, ...]) -> Callable[[Tensor], None]:
        """Called from a knob forward whose input has leading dims `lead_shape` (N, ...). Returns the
        `record(per_seq)` its backward calls with that knob's gradient per sequence, (N, R) fp32."""
        N = self.is_student.shape[0]
        if len(lead_shape) < 1 or lead_shape[0] != N:
            raise ValueError(f"capture: module {name} saw input of shape {lead_shape} but "
                             f"is_student has N={N} rows; the batch dim must be the sequence dim")
        w = {"name": name, "fired": 0}
        self._watches.append(w)
        return lambda per_seq: self._record(w, per_seq)

    def _record(self, w: dict, per_seq: Tensor) -> None:
        if w["fired"]:
            raise RuntimeError(f"capture: knob {w['name']} got a second backward through the same "
                               "graph (retain_graph=True); capture supports one backward per forward")
        w["fired"] += 1
        s, t = self._masks(per_seq.device)
        name = w["name"]
        # masked sums, not a 0/1-weighted matmul: 0 * NaN = NaN would leak one source's NaN into the other
        for d, x in ((self.g_student, per_seq[s].sum(0)), (self.g_teacher, per_seq[t].sum(0))):
            d[name] = d[name] + x if name in d else x
        if self.want_per_sequence:
            p = self.per_sequence
            p[name] = p[name] + per_seq if name in p else per_seq

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        unfired = [w["name"] for w in self._watches if w["fired"] == 0]
        n_watched = len(self._watches)
        self._watches = []
        if exc_type is not None:
            return
        if n_watched == 0:
            raise RuntimeError("capture: no knob forward with grad ran inside the context; run the "
                               "forward and the backward inside `with knobs.capture(is_student):`")
        if unfired:
            raise RuntimeError(f"capture: backward never reached {len(unfired)} knob branch(es) "
                               f"(first: {unfired[0]}); call loss.backward() inside the context")

    def __add__(self, other: Capture) -> Capture:
        out = Capture(torch.cat([self.is_student, other.is_student]), self.want_per_sequence)
        for field in ("g_student", "g_teacher"):
            a, b = getattr(self, field), getattr(other, field)
            setattr(out, field, {n: a.get(n, 0) + b.get(n, 0) for n in a.keys() | b.keys()})
        if self.want_per_sequence and other.want_per_sequence:
            out.per_sequence = {n: torch.cat([self.per_sequence[n], other.per_sequence[n]])
                                for n in self.per_sequence}
        return out


def two_backward_split(knobs, loss_student: torch.Tensor, loss_teacher: torch.Tensor
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The seed's method (≈2× backward cost), kept as the oracle for `Capture`.

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
