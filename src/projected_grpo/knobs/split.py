"""Per-source (student vs teacher) knob gradients from ONE backward pass.

A knob's gradient is a sum over tokens of per-token terms (δS: (x·Vhᵀ) ⊙ (∂L/∂y·U); B: (∂L/∂y)ᵀ(x·Aᵀ)).
While `Knobs.capture(is_student)` is open, each knob forward with grad registers a watch, and the
backward of its fused Function (fused.py) reduces those terms per sequence, (N, R), and hands them to
the watch, which adds the student rows to `g_student` and the teacher rows to `g_teacher`. So
g_student + g_teacher = the knob's .grad from that backward, without a second backward
(tests/oracles.two_backward_split is the test oracle). Nothing is kept alive between forward and backward
but the watch itself. Works under gradient checkpointing: the reduction runs in the original graph
node's backward, and a replayed forward registers no watch. One backward per forward: a second
backward through a retained graph raises. A forward whose rows are not the N sequences (sampling/prefix.py's
shared prompt rows, one per (prompt, source)) runs under `Capture.rows(its_is_student)`: each watch
keeps the row -> source map (`Rows`) of the forward that registered it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


class Rows:
    """The row -> source map of one forward: is_student (N,) bool, one entry per row of its batch.

    runs: (start, stop, is_student) of each run of consecutive rows from one source, in order;
    n_student, n_teacher: row counts; masks(device): the (student, teacher) row masks (N,) bool.
    """

    def __init__(self, is_student: torch.Tensor):
        if is_student.dtype != torch.bool or is_student.dim() != 1:
            raise ValueError(f"is_student must be a 1-D bool tensor (N,), got {is_student.dtype} "
                             f"{tuple(is_student.shape)}")
        self.is_student = is_student
        self.N = is_student.shape[0]
        flags = is_student.tolist()
        starts = [i for i in range(len(flags)) if i == 0 or flags[i] != flags[i - 1]]
        self.runs = [(a, b, bool(flags[a])) for a, b in zip(starts, [*starts[1:], len(flags)])]
        self.n_student = sum(b - a for a, b, s in self.runs if s)
        self.n_teacher = self.N - self.n_student
        self._w: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def masks(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._w:
            s = self.is_student.to(device=device, dtype=torch.bool)
            self._w[device] = (s, ~s)
        return self._w[device]


class Capture:
    """Per-source knob grads of the backwards run inside one `Knobs.capture(is_student)` context.

    is_student: (N,) bool, one entry per sequence (row of the batch fed to the model).
    After the context: g_student, g_teacher: dict[name, (R,)] fp32; per_sequence: dict[name, (N, R)]
    (only if requested). Several backwards inside one context accumulate (like .grad). For gradient
    accumulation over microbatches with different masks, open one capture per microbatch and add them:
    `total = cap1 + cap2` (sums g_*, concatenates per_sequence along N).
    A forward over other rows than the N sequences (the shared prompt rows of sampling/prefix.py) runs
    inside `with cap.rows(its_is_student):`, so its knob gradients are split by its own rows' sources.
    """

    def __init__(self, is_student: torch.Tensor, per_sequence: bool = False):
        self._rows = Rows(is_student)
        self.is_student = is_student
        self.want_per_sequence = per_sequence
        self.g_student: dict[str, torch.Tensor] = {}
        self.g_teacher: dict[str, torch.Tensor] = {}
        self.per_sequence: dict[str, torch.Tensor] = {}
        self._watches: list[Watch] = []

    @contextlib.contextmanager
    def rows(self, is_student: torch.Tensor) -> Iterator[Capture]:
        """Context: knob forwards inside see a batch of len(is_student) rows with these sources (a
        forward whose rows are not the capture's sequences, e.g. prompts shared by several of them).
        Per-sequence capture refuses: a row shared by several sequences has no per-sequence gradient."""
        if self.want_per_sequence:
            raise RuntimeError("capture: per-sequence gradients need one row per sequence; score the "
                               "batch with the packed forward (sampling.score.forward_logprobs)")
        saved, self._rows = self._rows, Rows(is_student)
        try:
            yield self
        finally:
            self._rows = saved

    def watch(self, name: str, lead_shape: tuple[int, ...]) -> Watch:
        """Called from a knob forward whose input has leading dims `lead_shape` (N, ...); its backward
        hands the returned Watch that knob's gradient, per sequence or already summed per source."""
        N = self._rows.N
        if len(lead_shape) < 1 or lead_shape[0] != N:
            raise ValueError(f"capture: module {name} saw input of shape {lead_shape} but "
                             f"is_student has N={N} rows; the batch dim must be the sequence dim")
        w = Watch(self, name, self._rows)
        self._watches.append(w)
        return w

    def _add(self, name: str, g_s: Tensor, g_t: Tensor, per_seq: Tensor | None) -> None:
        for d, x in ((self.g_student, g_s), (self.g_teacher, g_t)):
            d[name] = d[name] + x if name in d else x
        if self.want_per_sequence:
            p = self.per_sequence
            p[name] = p[name] + per_seq if name in p else per_seq

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        unfired = [w.name for w in self._watches if not w.fired]
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
            # insertion order, not a set union: sums over modules must not depend on PYTHONHASHSEED
            names = [*a, *(n for n in b if n not in a)]
            setattr(out, field, {n: a.get(n, 0) + b.get(n, 0) for n in names})
        if self.want_per_sequence and other.want_per_sequence:
            out.per_sequence = {n: torch.cat([self.per_sequence[n], other.per_sequence[n]])
                                for n in self.per_sequence}
        return out


class Watch:
    """One knob forward's handle on its Capture, called from that forward's backward (fused.py).

    per_sequence: the capture wants (N, R) rows, so the backward must produce them. Otherwise it may
    hand per-source sums instead (`sources`), computed as it likes. n_student, n_teacher: row counts;
    runs: (start, stop, is_student) of each run of consecutive rows from one source, in order (of the
    rows that forward saw: see `Capture.rows`).
    """

    def __init__(self, cap: Capture, name: str, rows: Rows):
        self.cap, self.name, self.fired, self._rows = cap, name, False, rows
        self.per_sequence = cap.want_per_sequence
        self.runs, self.n_student, self.n_teacher = rows.runs, rows.n_student, rows.n_teacher

    def masks(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(student, teacher) row masks (N,) bool on `device`."""
        return self._rows.masks(device)

    def _fire(self) -> None:
        if self.fired:
            raise RuntimeError(f"capture: knob {self.name} got a second backward through the same "
                               "graph (retain_graph=True); capture supports one backward per forward")
        self.fired = True

    def __call__(self, per_seq: Tensor) -> None:
        """Record the knob gradient per sequence, per_seq (N, R)."""
        self._fire()
        s, t = self.masks(per_seq.device)
        # masked sums, not a 0/1-weighted matmul: 0 * NaN = NaN would leak one source's NaN into the other
        self.cap._add(self.name, per_seq[s].sum(0), per_seq[t].sum(0), per_seq)

    def sources(self, g_student: Tensor, g_teacher: Tensor) -> None:
        """Record the knob gradient summed over the student rows and over the teacher rows, (R,) each."""
        if self.per_sequence:
            raise RuntimeError(f"capture: knob {self.name} recorded per-source sums, but the capture "
                               "wants per-sequence rows")
        self._fire()
        self.cap._add(self.name, g_student.reshape(-1), g_teacher.reshape(-1), None)
