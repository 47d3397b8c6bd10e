"""Knob adapters: freeze a Hugging Face causal LM and train only small knobs that are linear in ΔW.

`wrap(model, kind)` replaces each target `nn.Linear` (matched by module-name suffix) with a
`KnobLinear` holding a trainable knob `delta` and a quarantine knob `delta_hack` of the same shape:
  svd  : W = U·diag(S)·Vh (reduced, fp32, cached on disk); ΔW = U·diag(δS + δS_hack)·Vh.
  lora : frozen semi-orthonormal A (r×d_in) from a seeded QR; ΔW = (B + B_hack)·A.
The forward is the plain layer's one matmul with W_eff = W + ΔW (summed in ≥ fp32, stored in W's
dtype, cached until a knob value or flag changes); the knob gradient comes from the backward of a fused
autograd Function (fused.py). Knobs are fp32 master values. `Knobs.zeroed()` uses W itself, so the
forward *is* the base model's, bit for bit: the KL reference costs no second copy. δS_hack gets no
gradient: it moves only by what the `route` arm sends it (gradient routing).
bf16/fp16 W: an element of ΔW under half an ulp of W rounds away in W_eff. The pre-fusion side branch
lost the same updates (rounding y + out): on a 256×256 bf16 layer both realise the same share of a
relative update ε (benchmarks/bf16_merge.py); only an fp32 W_eff and matmul would keep it, at twice
the weight memory and fp32 matmul speed, so it is not done. Memory: one cached W_eff per module with
non-zero knobs (`Knobs.release()` drops them), except a low-rank module (`KnobLinear.unmerged`), which
trains as y = x·Wᵀ + its branch, holds no W_eff (sampling merges it within `merged()`) and is the same up
to fp32 rounding, the base model exactly at zero knobs. Not here: the per-source split (split.py), projection.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import pathlib
import zlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from projected_grpo.knobs import checkpointing, fused, split
from projected_grpo.knobs.svd_cache import svd_cached
from projected_grpo.store import load_tensors, save_tensors, weight_hash

# Llama/Qwen attention + MLP projections, and GatedDeltaNet linear attention (Qwen3-Next: in_proj_qkvz,
# in_proj_ba; Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; both: out_proj).
DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
)
DEFAULT_LORA_RANK = 16
KNOB_FORMAT = "knobs-v1"


def wide(W: torch.Tensor) -> torch.Tensor:
    """W in at least fp32 (fp64 stays fp64): the precision W + ΔW is summed in before the cast back."""
    return W.to(torch.promote_types(W.dtype, torch.float32))


class KnobLinear(nn.Module, abc.ABC):
    """A frozen `nn.Linear` plus knob; subclasses define ΔW and the fused Function. Shapes: x (..., d_in)."""

    kind = ""  # fn: its fused autograd Function (fused.py); branch (branch_value without grad): unmerged
    fn: type[torch.autograd.Function]
    branch: type[torch.autograd.Function]

    def __init__(self, base: nn.Linear, name: str, knob_shape: tuple[int, ...]):
        super().__init__()
        self.base, self.name = base, name
        self.weight_hash = weight_hash(base.weight)
        self.delta = nn.Parameter(torch.zeros(knob_shape, device=base.weight.device))
        self.delta_hack = nn.Parameter(torch.zeros(knob_shape, device=base.weight.device))
        self.knob_dim, self.use_main, self.use_hack = self.delta.numel(), True, True
        self.capture: split.Capture | None = None
        # W_eff cache: (use_hack, delta, delta_hack or None, W identity + version, W_eff) of the last merge
        self._eff: tuple | None = None
        # Knobs.merged(): ((use_main, use_hack), W_eff, None until first use if unmerged) pinned for sampling
        self._pinned: tuple[tuple[bool, bool], torch.Tensor | None] | None = None
        # a low-rank knob trains unmerged (fused.SVDBranch / LoRABranch) when its branch, R·(d_in + d_out)
        # multiply-adds per token, costs at most 1/8 of the layer's d_in·d_out: no W_eff is held for training
        d_out, d_in = base.weight.shape
        self.unmerged = 8 * knob_shape[-1] * (d_in + d_out) <= d_in * d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_main:  # zeroed(): exactly the base model
            return self.base(x)
        grad = torch.is_grad_enabled()
        if self._pinned is not None and self._pinned[0] == (True, self.use_hack):  # inside merged()
            if grad:
                raise RuntimeError(f"{self.name}: forward with grad enabled inside Knobs.merged(), which is "
                                   "for no-grad sampling only. Train outside merged()")
            return F.linear(x, self.merged_weight(), self.base.bias)
        train, record = grad and self.delta.requires_grad, None
        if train and self.capture is not None and not checkpointing.recomputing():  # a replay: no record
            record = self.capture.watch(self.name, tuple(x.shape[:-1]))
        if self.unmerged:
            coef = (self.delta + self.delta_hack if self.use_hack else self.delta).detach()
            if not train:  # the same value without a graph (knob gradients off, or no grad at all)
                return self.branch_value(x, coef, self.base.weight, self.base.bias, *self.frozen())[0]
            return self.branch.apply(x, self.delta, coef, self.base.weight, self.base.bias, record,
                                     *self.frozen())
        W_eff = self.weight_eff()
        if not train:
            return F.linear(x, W_eff, self.base.bias)  # what nn.Linear's forward does, with W_eff
        return self.fn.apply(x, self.delta, W_eff, self.base.bias, record, *self.frozen())

    def merged_weight(self, keep: bool = True) -> torch.Tensor:
        """W_eff for sampling: the one Knobs.merged() pinned for the current flags (an unmerged module's is
        merged on first use, pinned when `keep`), else weight_eff()."""
        if self._pinned is None or self._pinned[0] != (self.use_main, self.use_hack):
            return self.weight_eff()
        if self._pinned[1] is None and keep:
            self._pinned = (self._pinned[0], self.weight_eff())
        return self.weight_eff() if self._pinned[1] is None else self._pinned[1]

    def weight_eff(self) -> torch.Tensor:
        """W_eff (d_out, d_in) = W + ΔW for the current knob values and flags, in W's dtype: W itself when
        nothing is added (zeroed(), or knobs exactly zero), else a merge cached until a value or flag changes.

        The cache compares the knob *values* (R-sized) with those of the last merge, not `_version`:
        writes through `.data` (Knobs.values() views, Knobs.load, a resume) bypass the version counter.
        An unmerged module never caches."""
        W = self.base.weight
        if not self.use_main:
            return W
        key_w = (W.data_ptr(), W._version)
        e = self._eff
        if (e is not None and e[0] == self.use_hack and e[3] == key_w and torch.equal(e[1], self.delta)
                and (not self.use_hack or torch.equal(e[2], self.delta_hack))):
            return e[4]
        # a normal tensor even when first merged under inference_mode, so a later forward with grad can use it
        with torch.inference_mode(False), torch.no_grad():  # this order: inference_mode(False) enables grad
            coef = self.delta + self.delta_hack if self.use_hack else self.delta
            W_eff = W if not coef.any() else (wide(W) + self.delta_weight(coef).to(wide(W))).to(W.dtype)
            if not self.unmerged:
                self._eff = (self.use_hack, self.delta.detach().clone(),
                             self.delta_hack.detach().clone() if self.use_hack else None, key_w, W_eff)
        return W_eff

    @abc.abstractmethod
    def frozen(self) -> tuple[torch.Tensor, ...]:
        """The frozen tensors its Functions take after `record` (svd: U, Vh; lora: A)."""

    @abc.abstractmethod
    def delta_weight(self, coef: torch.Tensor) -> torch.Tensor:
        """coef (knob shape) -> ΔW (d_out, d_in) in fp32, or fp64 for an fp64 W (merge and export)."""


class SVDKnob(KnobLinear):
    """delta = δS (R,), R = rank or min(d_out, d_in); U (d_out, R), Vh (R, d_in) buffers in W's dtype."""

    kind = "svd"
    fn, branch, branch_value = fused.SVDLinear, fused.SVDBranch, staticmethod(fused.svd_branch)

    def __init__(self, base, name, rank, cache_dir, seed):
        R_full = min(base.weight.shape)
        R = R_full if rank is None else rank
        if not 0 < R <= R_full:
            raise ValueError(f"svd rank {rank} for {name}: must be in 1..{R_full} (min(d_out, d_in))")
        super().__init__(base, name, (R,))
        U, S, Vh, self.cache_status = svd_cached(base.weight, cache_dir, self.weight_hash)
        w = base.weight
        self.register_buffer("U", U[:, :R].to(device=w.device, dtype=w.dtype).contiguous())
        self.register_buffer("Vh", Vh[:R].to(device=w.device, dtype=w.dtype).contiguous())

    def frozen(self):
        return self.U, self.Vh

    def delta_weight(self, coef):
        U, Vh = wide(self.U), wide(self.Vh)
        return (U * coef.to(U)) @ Vh  # U·diag(δS)·Vh


class LoRAKnob(KnobLinear):
    """delta = B (d_out, r), R = d_out·r (row-major); A (r, d_in) frozen, rows orthonormal."""

    kind = "lora"
    fn, branch, branch_value = fused.LoRALinear, fused.LoRABranch, staticmethod(fused.lora_branch)

    def __init__(self, base, name, rank, cache_dir, seed):
        r = DEFAULT_LORA_RANK if rank is None else rank
        d_out, d_in = base.weight.shape
        if not 0 < r <= d_in:
            raise ValueError(f"lora rank {r} for {name}: must be in 1..{d_in} (d_in)")
        super().__init__(base, name, (d_out, r))
        # seeded per module so A is reproducible and independent of wrapping order
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        Q, _ = torch.linalg.qr(torch.randn(d_in, r, generator=gen))  # (d_in, r), orthonormal columns
        self.register_buffer("A", Q.T.to(device=base.weight.device, dtype=base.weight.dtype).contiguous())
        self.cache_status = "none"

    def frozen(self):
        return (self.A,)

    def delta_weight(self, coef):
        return coef.to(wide(self.A)) @ wide(self.A)  # B·A


KINDS: dict[str, type[KnobLinear]] = {"svd": SVDKnob, "lora": LoRAKnob}


def parent_module(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def wrap(model: nn.Module, kind: str = "svd", targets: tuple[str, ...] = DEFAULT_TARGETS,
         rank: int | None = None, cache_dir: str | pathlib.Path | None = None, seed: int = 0) -> Knobs:
    """Wrap every `nn.Linear` whose name's last component is in `targets`; freeze all else.

    rank: svd keeps the top-`rank` singular directions (None: all); lora uses r = rank (None: 16).
    cache_dir: SVD cache (None: `store.cache_root() / "svd"`). seed: lora A. Returns the `Knobs` handle.
    Wrap after moving the model to its device and dtype: knobs stay fp32 (master values), buffers
    (U, Vh / A) take W's dtype; a later `model.to(dtype)` would cast the knobs too.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown knob kind {kind!r}; choose one of {sorted(KINDS)}")
    if any(isinstance(m, KnobLinear) for m in model.modules()):
        raise ValueError("model is already wrapped with knobs; wrap a fresh model")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = [n for n in linears if n.rpartition(".")[2] in targets]
    if not names:
        raise ValueError(f"no nn.Linear named with a suffix in {list(targets)}; "
                         f"Linear modules found: {linears}")
    for p in model.parameters():
        p.requires_grad_(False)
    rest = _rest_hash(model, {f"{n}.weight" for n in names})  # before wrapping renames the parameters
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else None
    modules = {}
    for n in names:
        parent, attr = parent_module(model, n)
        modules[n] = KINDS[kind](getattr(parent, attr), n, rank, cache, seed)
        setattr(parent, attr, modules[n])
    return Knobs(model, kind, tuple(targets), rank, seed, modules, rest)


def _rest_hash(model: nn.Module, skip: set[str]) -> str:
    """sha256 of every parameter and buffer not in `skip` (the wrapped weights, hashed per module) and
    of the model config's values, so that a fingerprint changes with embeddings, norms, lm_head or,
    e.g., rope_theta too. The config's path and library version are left out: a moved model is the same."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in skip:
            h.update(f"{name}|".encode())
            h.update(weight_hash(t).encode())
    cfg = getattr(model, "config", None)
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    values = {k: v for k, v in values.items() if k not in ("_name_or_path", "transformers_version")}
    h.update(json.dumps(values, sort_keys=True, default=str).encode())
    return h.hexdigest()


class Knobs:
    """Handle on a wrapped model: knob parameters, contexts, gradients, capture, save/load."""

    def __init__(self, model, kind, targets, rank, seed, modules: dict[str, KnobLinear], rest_hash: str):
        self.model, self.kind, self.targets, self.rank, self.seed = model, kind, targets, rank, seed
        self.modules = modules
        self.cache_status = {n: m.cache_status for n, m in modules.items()}
        self._hashes = {n: m.weight_hash for n, m in modules.items()}
        self._rest_hash = rest_hash  # every other parameter, buffer and config value (see _rest_hash)

    def parameters(self) -> list[nn.Parameter]:
        return [m.delta for m in self.modules.values()]

    def hack_parameters(self) -> list[nn.Parameter]:
        return [m.delta_hack for m in self.modules.values()]

    def _params(self, which: str) -> dict[str, nn.Parameter]:
        if which not in ("main", "hack"):
            raise ValueError(f"which must be 'main' or 'hack', got {which!r}")
        return {n: m.delta if which == "main" else m.delta_hack for n, m in self.modules.items()}

    def grads(self, which: str = "main") -> dict[str, torch.Tensor]:
        """name -> flattened grad (R,); a knob with no .grad (no backward reached it) reads as zeros."""
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for n, p in self._params(which).items()}

    def set_grads(self, d: dict[str, torch.Tensor], which: str = "main") -> None:
        """Write flattened grads d[name] (R,) into .grad of the named knobs (others untouched)."""
        params = self._params(which)
        for n, g in d.items():
            if n not in params:
                raise KeyError(f"set_grads: {n!r} is not a wrapped module; known: {list(params)[:5]}...")
            params[n].grad = g.detach().reshape(params[n].shape).to(params[n]).clone()

    def values(self, which: str = "main") -> dict[str, torch.Tensor]:
        """name -> flattened knob value (R,) (a view: writes go through)."""
        return {n: p.data.reshape(-1) for n, p in self._params(which).items()}

    def norms(self) -> dict[str, torch.Tensor]:
        """knob/norm and knob/hack_norm: global L2 norms of the main and quarantine knobs (detached)."""
        return {f"knob/{k}": torch.sqrt(sum(p.detach().float().square().sum() for p in ps))
                for k, ps in (("norm", self.parameters()), ("hack_norm", self.hack_parameters()))}

    @contextlib.contextmanager
    def _flags(self, use_main: bool | None, use_hack: bool | None) -> Iterator[Knobs]:
        saved = {n: (m.use_main, m.use_hack) for n, m in self.modules.items()}
        try:
            for m in self.modules.values():
                m.use_main = m.use_main if use_main is None else use_main
                m.use_hack = m.use_hack if use_hack is None else use_hack
            yield self
        finally:
            for n, m in self.modules.items():
                m.use_main, m.use_hack = saved[n]

    def zeroed(self):
        """Context: every knob branch skipped -> the base model exactly (the free KL reference)."""
        return self._flags(False, False)

    def ablate_quarantine(self):
        """Context: the quarantine knob left out of the forward (deployment view of `route`)."""
        return self._flags(None, False)

    @contextlib.contextmanager
    def merged(self) -> Iterator[Knobs]:
        """Context for no-grad inference (sampling): every wrapped Linear's W_eff (see module docstring) is
        merged on entry from the knob values and zeroed()/ablate_quarantine() flags of that moment and pinned,
        so a decode step runs the plain model's F.linear with no per-forward cache check.

        The forward outside merged() uses the same W_eff, so outputs are the same inside and out; knob
        values changed inside are not seen; a nested zeroed() or ablate_quarantine() is honoured. W is
        never written; exit (also on an exception) unpins. A forward with grad enabled inside raises.
        An unmerged module merges on its first use inside (packed.py's bf16 copies never hold every fp32
        W_eff at once); its W_eff rounds differently from its unmerged forward, in the last bits."""
        if torch.is_grad_enabled():
            raise RuntimeError("Knobs.merged() is for no-grad inference only (the pinned weight takes no "
                               "knob update): enter it inside torch.no_grad() (or inference_mode)")
        if any(m._pinned is not None for m in self.modules.values()):
            raise RuntimeError("Knobs.merged() is already active; nest it at most once")
        try:
            for m in self.modules.values():
                m._pinned = ((m.use_main, m.use_hack), None if m.unmerged else m.weight_eff())
            yield self
        finally:
            for m in self.modules.values():
                m._pinned = None

    def release(self) -> None:
        """Drop every cached W_eff (one copy of the wrapped weights); the next forward merges again."""
        for m in self.modules.values():
            m._eff = None

    def gradient_checkpointing(self, enable: bool = True) -> None:
        """Recompute each decoder layer's activations in the backward instead of keeping them
        (checkpointing.py); per-source and per-sequence capture work the same. Off: enable=False."""
        checkpointing.enable(self.model, enable)

    @contextlib.contextmanager
    def capture(self, is_student: torch.Tensor, per_sequence: bool = False) -> Iterator[split.Capture]:
        """Context: forwards+backwards inside record per-source knob grads; see `split.Capture`."""
        if any(m.capture is not None for m in self.modules.values()):
            raise RuntimeError("capture() is already active; nested captures would double-count")
        cap = split.Capture(is_student, per_sequence)
        for m in self.modules.values():
            m.capture = cap
        try:
            with cap:
                yield cap
        finally:
            for m in self.modules.values():
                m.capture = None

    def fingerprint(self) -> str:
        """Hash of the base model (class, config values, every weight and buffer), knob kind, rank, seed,
        targets."""
        cfg = getattr(self.model, "config", None)
        desc = {"model": type(self.model).__name__, "config": type(cfg).__name__, "kind": self.kind,
                "rank": self.rank, "seed": self.seed if self.kind == "lora" else None,
                "targets": list(self.targets), "weights": self._hashes, "rest": self._rest_hash}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: str | pathlib.Path) -> None:
        """Knob values alone (delta, delta_hack per module) as safetensors with kind + fingerprint."""
        t = {}
        for n, m in self.modules.items():
            t[f"{n}.delta"], t[f"{n}.delta_hack"] = m.delta, m.delta_hack
        save_tensors(path, t, {"format": KNOB_FORMAT, "kind": self.kind, "fingerprint": self.fingerprint()})

    def load(self, path: str | pathlib.Path) -> None:
        """Load knobs saved by `save`; fails (before changing anything) if made for another model/knob."""
        self.load_state(*load_tensors(path), where=f"knob file {path}")

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, str], where: str = "knobs"):
        """`load` from already-read (tensors, metadata) of a file written by `save`."""
        if meta.get("kind") != self.kind or meta.get("fingerprint") != self.fingerprint():
            raise ValueError(f"{where} was saved for kind={meta.get('kind')!r} "
                             f"fingerprint={meta.get('fingerprint')!r}, but this model has "
                             f"kind={self.kind!r} fingerprint={self.fingerprint()!r} "
                             "(different base weights, targets, rank or seed)")
        for n, m in self.modules.items():
            m.delta.data.copy_(tensors[f"{n}.delta"])
            m.delta_hack.data.copy_(tensors[f"{n}.delta_hack"])
