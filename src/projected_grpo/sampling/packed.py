"""Sampling from weights laid out once for the matrix units: a Llama-family forward (prefill and one-token
decode) over bf16 (or fp32) copies of the policy's weights, knobs merged (rollout.sample_dtype="bfloat16" or
"float32").

A decode step of a small model reads every weight once per token for a handful of rows, so its speed is the
memory traffic of the weights (docs/benchmarks.md, roofline): bf16 halves it, and on a CPU with bf16 units
oneDNN's bf16 kernels are also faster per row than fp32 ones. `PackedLM(model, rows, dtype)` copies the
weights once per `generate` call: each projection in `dtype`, laid out for its kernel (packed_linear: on CPU
gemv.py's blocks for fp32, and for bf16 at a handful of rows or where oneDNN has no bf16 kernels, else
oneDNN's prepacked layout; a plain tensor elsewhere, e.g. CUDA), a layer's q/k/v projections concatenated
into one matmul, the gate's SiLU, the up projection's product and the residual adds fused into their
matmuls' epilogues where oneDNN runs them. The ops are those of the Hugging
Face forward of the same model cast to `dtype` (modeling_llama.py: fp32 RMSNorm cast back, rotary embedding
by the model's own module, sdpa; on a CPU RMSNorm, the rotary and the decode's attention by gemv.py's
kernels, computed in fp32 and rounded once to `dtype`), so the logits are that model's up to rounding
(tests/test_packed.py), and the same inputs give the same outputs on a fixed machine. What changes against
the policy's own forward: in bf16 the behaviour log-probs are the bf16 model's, so a student token's ratio
pi_theta / mu is no longer exactly 1 (the training loop logs its size: sample/* in docs/metrics.md); in fp32
only the summation order changes (~1e-6 in a log-prob), while the blocked kernel reads the weights about 2x
faster at a handful of rows than oneDNN's prepacked fp32 one, and that 2-5x faster than F.linear
(docs/benchmarks.md). The KV cache (per layer (N, C, Hkv, D), in `dtype`) lives here.
Not here: the decode loop and samplers (generate.py), the exact fp32 step (decode_step.py).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor
from torch.nn import functional as F

from projected_grpo.knobs.adapters import KnobLinear
from projected_grpo.sampling import gemv
from projected_grpo.sampling.decode_step import Decode, _rotate_half, why_not_replicated

DTYPE = torch.bfloat16


def why_not_packed(model) -> str | None:
    """Why PackedLM cannot stand in for `model`'s forward (None: it can): decode_step's allow-list of
    architectures, attention implementations and config fields (why_not_replicated)."""
    return why_not_replicated(model)


def packs_on_cpu(dtype: torch.dtype = DTYPE) -> bool:
    """Whether this torch has oneDNN's prepacked linear (torch.ops.mkldnn, used by torch.compile's CPU
    freezing) for `dtype`; without it the weights stay plain tensors (F.linear)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
            and (dtype != torch.bfloat16 or ops._is_mkldnn_bf16_supported()))


def auto_dtype(device: str) -> str:
    """rollout.sample_dtype "auto" made concrete for a model on `device`: on a CPU "bfloat16" where oneDNN has
    bf16 kernels to pack for (AVX-512 or AMX), else "float32"; elsewhere (a GPU) "model", the model's own
    forward (packing does not pay there: docs/benchmarks.md, "On a GPU")."""
    if torch.device(device).type != "cpu":
        return "model"
    return "bfloat16" if packs_on_cpu(torch.bfloat16) else "float32"


def warn_if_unpacked(dtype: torch.dtype, device: torch.device) -> None:
    """Warn (once per process and call site) that bf16 sampling on this CPU has no kernel to pack for: neither
    oneDNN's bf16 ones nor gemv.py's few-row kernel (which takes bf16 weights wherever it builds).

    Without them every bf16 matmul runs as a plain bf16 F.linear: on an AVX2 CPU the `smollm2-math-cpu` step
    measured 2.4x the time (sampling 3.1x) of packed fp32, its peak memory 11.5 GB against 3.2 after 4 steps
    (docs/benchmarks.md)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not packs_on_cpu(dtype) and gemv.why_not():
        warnings.warn("rollout.sample_dtype='bfloat16' on a CPU without oneDNN bf16 kernels (no AVX-512 or "
                      "AMX) nor gemv.py's kernel (it did not build): sampling runs unpacked, several times "
                      "slower and larger than 'float32' here; use rollout.sample_dtype='auto' (or 'float32')",
                      stacklevel=2)


class PackedLinear:
    """A projection for the packed forward (made by `packed_linear`): x (..., d_in) -> x·Wᵀ + b, `swish(x)` =
    silu(x·Wᵀ + b), `then(x, y, op)` = (x·Wᵀ + b) + y (op "add") or * y ("mul"). This base runs F.linear (any
    device, any dtype), the ops one after the other."""
    kernel = "plain"

    def __init__(self, W: Tensor, b: Tensor | None):
        self.W, self.b = W, b

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.W, self.b)

    def swish(self, x: Tensor) -> Tensor:
        return F.silu(self(x))

    def then(self, x: Tensor, y: Tensor, op: str) -> Tensor:
        out = self(x)
        return out + y if op == "add" else out * y


class _Blocked(PackedLinear):
    """The same on gemv.py's few-row kernel, W (fp32 or bf16) laid out in its blocks: fp32 sums, for bf16
    rounded once to bf16 (bias included), as oneDNN's bf16 matmul rounds."""
    kernel = "blocked"

    def __init__(self, W: Tensor, b: Tensor | None):
        super().__init__(gemv.block(W), b)
        self.N = W.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        return gemv.matmul(x, self.W, self.N, self.b)


class _OneDNN(PackedLinear):
    """The same on oneDNN's prepacked kernel, W reordered for a batch of `rows` (any batch works; results do
    not depend on it), the SiLU and the add / mul fused into the matmul's epilogue (one rounding to dtype)."""
    kernel = "onednn"

    def __init__(self, W: Tensor, b: Tensor | None, rows: int):
        super().__init__(torch.ops.mkldnn._reorder_linear_weight(W, rows), b)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.W, self.b, "none", [], "")

    def swish(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.W, self.b, "swish", [], "")

    def then(self, x: Tensor, y: Tensor, op: str) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, y, self.W, self.b, op)


# bf16 decode batches up to this many rows use gemv.py's kernel even where oneDNN has bf16 kernels: there a
# step reads the weights, and the blocked loop reads them faster (SmolLM2's projections on an AVX-512 CPU,
# one and two threads: 1.4-1.7x at 1-2 rows, 0.99-1.01x at 3, 0.8x at 4); above, the widening costs more
# than it saves and oneDNN's bf16 dot products win (docs/benchmarks.md, "The few-row kernel", [58], [59])
BF16_BLOCKED_ROWS = 3


def packed_linear(W: Tensor, b: Tensor | None, dtype: torch.dtype, rows: int) -> PackedLinear:
    """x (..., d_in) -> x·Wᵀ + b in `dtype`, W (d_out, d_in) copied to `dtype` once and laid out for the
    kernel chosen here (its `kernel`): on a CPU, gemv.py's few-row kernel where it builds, for fp32 always
    (faster than oneDNN's at every row count measured: docs/benchmarks.md), for bf16 where oneDNN has no bf16
    kernels or the decode batch is at most BF16_BLOCKED_ROWS rows; else oneDNN's prepacked one where this
    torch has it for `dtype`; F.linear otherwise (e.g. CUDA)."""
    W = W.detach().to(dtype).contiguous()
    b = None if b is None else b.detach().to(dtype)
    cpu = W.device.type == "cpu"
    if cpu and _blocked_pays(dtype, rows) and _blocked_kernel():
        return _Blocked(W, b)
    if cpu and packs_on_cpu(dtype):
        return _OneDNN(W, b, rows)
    return PackedLinear(W, b)


def _blocked_pays(dtype: torch.dtype, rows: int) -> bool:
    """Whether gemv.py's kernel is the faster one on a CPU for `dtype` at a decode batch of `rows`: fp32
    always; bf16 up to BF16_BLOCKED_ROWS rows, or at any where oneDNN has no bf16 kernels."""
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and (rows <= BF16_BLOCKED_ROWS or not packs_on_cpu(dtype)))


@functools.cache
def _blocked_kernel() -> bool:
    """Whether the packed sampler's projections on this CPU can use gemv.py's kernel; where it cannot be
    built, say why once (the sampler then uses oneDNN's, about half the speed at a handful of rows:
    docs/benchmarks.md)."""
    reason = gemv.why_not()
    if reason is not None:
        warnings.warn(f"{reason}: sampling uses oneDNN's kernels instead (about half the speed at a "
                      "handful of rows); install a C++ compiler and `pip install ninja` for the faster one",
                      stacklevel=3)
    return reason is None


def _weight(linear) -> tuple[Tensor, Tensor | None]:
    """A projection's effective (W, b): a knob module's merged W_eff (the one Knobs.merged() pinned, or its
    flags and values of now), else W."""
    if isinstance(linear, KnobLinear):
        return linear.merged_weight(keep=False), linear.base.bias
    return linear.weight, linear.bias


def _fused(linears, dtype: torch.dtype, rows: int) -> PackedLinear:
    """One PackedLinear computing the concatenation of `linears`' outputs."""
    Ws, bs = zip(*(_weight(m) for m in linears))
    b = None if all(x is None for x in bs) else torch.cat(
        [x if x is not None else W.new_zeros(W.shape[0]) for W, x in zip(Ws, bs)])
    return packed_linear(torch.cat(Ws), b, dtype, rows)


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm of x (..., E) with w (E,) in x's dtype by ATen's fused op: fp32 inside, rounded once (HF's
    module also rounds before scaling by w: in bf16 the two are one rounding apart)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rope(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotary embedding of qk (N, T, Hh, D) with cos, sin (N, T, 1, D)."""
    return (qk * cos) + (_rotate_half(qk) * sin)


def _scale(norm, dtype: torch.dtype, fp32: bool) -> Tensor:
    """An RMSNorm's scale in dtype (the model cast to dtype); fp32: then widened to fp32 (exactly), as
    gemv.rms_norm takes it."""
    w = norm.weight.detach().to(dtype)
    return w.float() if fp32 else w


class PackedLM:
    """`model`'s forward in `dtype` over weights copied now (knob flags and values of this moment); rows: the
    decode batch the layouts are chosen for. `prefill` fills a fresh KV cache, `stepper` decodes one token."""

    def __init__(self, model, rows: int, dtype: torch.dtype = DTYPE):
        reason = why_not_packed(model)
        if reason is not None:
            raise ValueError(f"sample_dtype={str(dtype).removeprefix('torch.')}: {reason}; sample with the "
                             "model's own weights (rollout.sample_dtype='model') instead")
        warn_if_unpacked(dtype, model.lm_head.weight.device)
        config, body = model.config, model.model
        self.dtype = dtype
        self.embed, self.rotary = body.embed_tokens.weight, body.rotary_emb
        a0 = body.layers[0].self_attn
        self.D, self.Hkv, self.H = a0.head_dim, config.num_key_value_heads, config.num_attention_heads
        self.scale, self.eps = a0.scaling, body.norm.variance_epsilon
        self.silu = getattr(config, "hidden_act", None) == "silu"  # fuses into the gate's matmul

        # On a CPU, fp32 or bf16: RMSNorm, the rotary embedding and the decode's attention on gemv.py's
        # kernels, one call each rather than ~10 ops, ~6 and sdpa's setup (at a handful of rows, per-call
        # cost is the cost; sdpa's bf16 one-token path cost 1.5 ms a call at 32 rows: docs/benchmarks.md)
        cpu = self.embed.device.type == "cpu"
        self.own_ops = cpu and dtype in (torch.float32, torch.bfloat16) and _blocked_kernel()
        self.norm_op, self.rope_op = (gemv.rms_norm, gemv.rope) if self.own_ops else (_rms_norm, _rope)

        def lin(module) -> PackedLinear:
            return packed_linear(*_weight(module), dtype, rows)

        def scale(norm) -> Tensor:
            return _scale(norm, dtype, fp32=self.own_ops)

        self.layers = []
        for layer in body.layers[:config.num_hidden_layers]:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                scale(layer.input_layernorm), _fused((a.q_proj, a.k_proj, a.v_proj), dtype, rows),
                lin(a.o_proj), scale(layer.post_attention_layernorm),
                lin(m.gate_proj), lin(m.up_proj), lin(m.down_proj), m.act_fn))
        self.norm = scale(body.norm)
        self.lm_head = lin(model.lm_head)
        self.k: list[Tensor] = []  # per layer (N, C, Hkv, D): keys after the rotary embedding
        self.v: list[Tensor] = []

    def _forward(self, ids: Tensor, pos: Tensor, mask: Tensor | None, start: int, attend=None) -> Tensor:
        """ids, pos (N, T) at cache columns start .. start + T - 1; mask (N, 1, T, start + T) bool or None
        (every column visible) -> the last position's logits (N, V) in fp32. attend: the one-token attention
        (q (N, H, 1, D), k, v (N, Hkv, n, D), mask) -> (N, 1, H * D) (T = 1 only), else sdpa over the mask."""
        N, T = ids.shape
        H, Hkv, D, eps, end = self.H, self.Hkv, self.D, self.eps, start + T
        x = F.embedding(ids, self.embed).to(self.dtype)  # (N, T, E): the embedding rows in dtype
        cos, sin = self.rotary(x, pos)  # (N, T, D): the model's own rotary module (any rope type)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (N, T, 1, D): the heads of q and k at once
        norm, rope = self.norm_op, self.rope_op
        for i, (w1, qkv, o, w2, gate, up, down, act) in enumerate(self.layers):
            h = norm(x, w1, eps)  # (N, T, E): RMSNorm, fp32 inside, in x's dtype
            out = qkv(h)  # (N, T, (H + 2 Hkv) D)
            qk = rope(out[..., :(H + Hkv) * D].view(N, T, H + Hkv, D), cos, sin)
            self.k[i][:, start:end] = qk[:, :, H:]
            self.v[i][:, start:end] = out[..., (H + Hkv) * D:].view(N, T, Hkv, D)
            # (N, H, T, D) and (N, Hkv, end, D): strided views, as sdpa takes them
            q, k, v = qk[:, :, :H].transpose(1, 2), self.k[i][:, :end].transpose(1, 2), \
                self.v[i][:, :end].transpose(1, 2)
            if attend is not None:
                att = attend(q, k, v, mask)
            else:
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                     enable_gqa=H != Hkv).transpose(1, 2).reshape(N, T, H * D)
            x = o.then(att, x, "add")  # x + o(att)
            h = norm(x, w2, eps)
            a = gate.swish(h) if self.silu else act(gate(h))
            x = down.then(up.then(h, a, "mul"), x, "add")  # x + down(act(gate(h)) * up(h))
        x = norm(x[:, -1:], self.norm, eps)
        return self.lm_head(x)[:, -1].float()  # (N, V)

    def prefill(self, ids: Tensor, mask: Tensor, pos: Tensor, capacity: int) -> Tensor:
        """ids, mask (0 on left padding), pos: (M, P); a KV cache of `capacity` columns -> logits (M, V).

        A padding position attends to itself as well as its causal, unpadded keys, so that no query row is
        fully masked (an all-masked sdpa row is NaN, and its keys, though masked later, would multiply as
        0 * NaN); real positions see exactly the causal, unpadded keys."""
        M, P = ids.shape
        self.k = [ids.new_empty((M, capacity, self.Hkv, self.D), dtype=self.dtype) for _ in self.layers]
        self.v = [torch.empty_like(k) for k in self.k]
        keep = mask.bool()
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        if bool(keep.all()):
            m = None if P == 1 else causal[None, None]
        else:
            m = ((causal & keep[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids.device))[:, None]
        return self._forward(ids, pos, m, 0)

    def select_rows(self, rows: Tensor) -> None:
        """Keep rows (N',) of the cache, in that order (share_prefill: each prompt's cache to its samples;
        the decode: its unfinished rows)."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]

    def stepper(self, mask: Tensor) -> Decode:
        """The one-token step over the decode's attention mask (N, C) (0 on prompt padding):
        step(tok (N,), pos (N, 1), n the cache length after tok) -> logits (N, V) in fp32; keep_rows narrows
        the cache and the mask to fewer rows."""
        keep = mask.bool()[:, None, None, :]  # (N, 1, 1, C): at q_len 1 every cached column but padding
        full = None if bool(keep.all()) else keep
        g, Hkv, D = self.H // self.Hkv, self.Hkv, self.D

        def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, m: Tensor | None) -> Tensor:
            # a key/value head's g query heads as g query rows (HF's q_len-1 GQA packing): one sdpa call,
            # without enable_gqa (~4x slower at this shape on CPU, measured) or repeated keys
            N = q.shape[0]
            out = F.scaled_dot_product_attention(q.reshape(N, Hkv, g, D), k, v, attn_mask=m, scale=self.scale)
            return out.reshape(N, 1, Hkv * g * D)

        def attend_kernel(q: Tensor, k: Tensor, v: Tensor, m: Tensor | None) -> Tensor:
            # the same on gemv.py's one-token kernel (fp32 inside): in fp32 2-3x faster than sdpa at a handful
            # of rows, where sdpa's per-call setup is most of its time (docs/benchmarks.md, "The one-token
            # attention"); in bf16 sdpa's own cost is larger still
            N = q.shape[0]
            out = gemv.attend_one(q.reshape(N, Hkv, g, D), k.transpose(1, 2), v.transpose(1, 2),
                                  None if m is None else m[:, 0, 0], self.scale)
            return out.reshape(N, 1, Hkv * g * D)

        attend = attend_kernel if self.own_ops and D in gemv.HEAD_DIMS else attend_sdpa

        def step(tok: Tensor, pos: Tensor, n: int) -> Tensor:
            return self._forward(tok[:, None], pos, None if full is None else full[..., :n], n - 1, attend)

        def keep_rows(rows: Tensor) -> None:
            nonlocal full
            self.select_rows(rows)
            full = None if full is None else full.index_select(0, rows)

        return Decode(step, keep_rows)
