"""A lean one-token decode step for Llama-family decoder models: the same next-token logits as the Hugging
Face forward, bit for bit, with a fraction of its Python per call.

`decode_step(model, past, mask, keep, lean)` is chosen once per `generate.generate` call, after the HF
prefill: the lean step for an allow-listed model (LlamaForCausalLM, Qwen2ForCausalLM; sdpa or eager
attention; every layer full attention in the preallocated KV cache, kv_cache._GrowingLayer), else the
plain HF call. The lean step runs the tensor ops of transformers 5.23's forward of one token
(modeling_llama.py, masking_utils.sdpa_mask / eager_mask, integrations/sdpa_attention.py) in the same
order on the same shapes, so it rounds identically; what it drops is the per-call machinery around them
(output capturing, kwargs plumbing, config look-ups, the mask rebuilt each token). Projections, the
embedding, the activation and the rotary embedding are called as the model's own modules, so knob wrappers
(knobs.adapters.KnobLinear) keep working. Not here: the prefill, the
decode loop (generate.py), training forwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.cache_utils import DynamicCache

from projected_grpo.knobs import checkpointing
from projected_grpo.sampling.kv_cache import _GrowingLayer, cache_of, with_cache

# tok (N,) long, pos (N, 1) its positions, n = the cache length after tok -> logits (N, V) of the next token
Step = Callable[[Tensor, Tensor, int], Tensor]


@dataclass(frozen=True)
class Decode:
    """A decode's per-token `step`, and `keep_rows(rows)`: keep only rows (N',) long of its KV cache and
    attention mask, so that the next step runs N' rows (generate retires finished rows); None where the
    step's shapes are fixed (a CUDA graph). Calling a Decode calls its step."""

    step: Step
    keep_rows: Callable[[Tensor], None] | None = None

    def __call__(self, tok: Tensor, pos: Tensor, n: int) -> Tensor:
        return self.step(tok, pos, n)


@functools.cache
def _allow_list() -> tuple[dict[type, tuple[type, ...]], dict[str, tuple]]:
    """(archs, stock), imported on first use: transformers' modelling modules take ~1.3 s to import, which
    `import rollout` should not pay (a model built by transformers has imported them already).

    archs: model class -> the exact classes its backbone, layers and their parts must be. The lean step
    replicates these classes' forwards; a subclass may override one, so an exact type match is required.
    stock: attention implementation -> (the stock attention function, mask builder) the lean step replicates.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    archs = {
        llama.LlamaForCausalLM: (llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention,
                                 llama.LlamaMLP, llama.LlamaRMSNorm),
        qwen2.Qwen2ForCausalLM: (qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention,
                                 qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm),
    }
    return archs, {"sdpa": (sdpa_attention_forward, sdpa_mask), "eager": (None, eager_mask)}


def _records_only(hook) -> bool:
    """transformers' output-capturing hook (transformers/utils/output_capturing.py): the first call with
    output_hidden_states (e.g. the probe monitor's features) installs it for good on the decoder layers and
    attention modules; it appends outputs while such a call runs and otherwise returns at once, changing
    nothing, so a replica of the forward that never asks for hidden states is unaffected."""
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", None) == "output_capturing_hook")


def _has_hooks(module: nn.Module) -> bool:
    """A hook (other than transformers' output recorder), an accelerate wrapper, a per-instance forward (e.g.
    kernels' kernelize) or Module.compile() could change what calling it does. Our gradient checkpointing's
    switch does not: without grad it runs the class's forward (knobs/checkpointing.py)."""
    own = "forward" in module.__dict__ and not checkpointing.switched(module)
    hooks = [h for h in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
             if not _records_only(h)]
    return bool(hooks or own or hasattr(module, "_hf_hook")
                or getattr(module, "_compiled_call_impl", None) is not None)


def why_not_lean(model, past) -> str | None:
    """Why the lean step cannot stand in for `model`'s forward with KV cache `past` (None: it can).

    Every check is against the model's classes and config fields the lean step would otherwise silently
    assume; anything not on the allow-list falls back to the HF call."""
    reason = why_not_replicated(model)
    if reason is None and not (isinstance(past, DynamicCache) and not past.offloading
                               and len(past.layers) == model.config.num_hidden_layers
                               and all(type(c) is _GrowingLayer and c.is_initialized for c in past.layers)):
        return (f"KV cache {past!r} is not the filled preallocated cache (kv_cache='preallocated') of "
                "full-attention layers")
    return reason


def why_not_replicated(model) -> str | None:
    """Why a replica of `model`'s forward from its own modules (the lean step; packed.py's bf16 forward) would
    not be its forward (None: it would): the allow-listed classes, attention and config, no hooks."""
    cls = type(model)
    if not cls.__module__.startswith("transformers.models."):  # checked first: spares the imports below
        return f"{cls.__name__} (from {cls.__module__}) is not a transformers model class"
    archs, stock = _allow_list()
    arch = archs.get(cls)
    if arch is None:
        return f"{cls.__name__} is not one of {sorted(c.__name__ for c in archs)}"
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in stock:
        return f"attention implementation {impl!r} is not one of {sorted(stock)}"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend, mask_fn = stock[impl]
    if (ALL_ATTENTION_FUNCTIONS.get_interface(impl, None) is not attend
            or ALL_MASK_ATTENTION_FUNCTIONS[impl] is not mask_fn):
        return f"the {impl!r} attention or mask function is overridden (AttentionInterface.register)"
    if not getattr(config, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return f"layer_types {sorted(set(config.layer_types))}: only full_attention is supported"
    backbone, layer_cls, attn_cls, mlp_cls, norm_cls = arch
    body = model.model
    layers = body.layers[:config.num_hidden_layers]
    parts = [(body, backbone), (body.norm, norm_cls)] + [
        pair for layer in layers for pair in ((layer, layer_cls), (layer.self_attn, attn_cls),
                                               (layer.mlp, mlp_cls), (layer.input_layernorm, norm_cls),
                                               (layer.post_attention_layernorm, norm_cls))]
    wrong = [f"{type(m).__name__} (expected {c.__name__})" for m, c in parts if type(m) is not c]
    if wrong:
        return f"unexpected module classes: {wrong[:3]}"
    hooked = [name or type(model).__name__ for name, m in model.named_modules() if _has_hooks(m)]
    if hooked:
        more = f" (and {len(hooked) - 1} more)" if len(hooked) > 1 else ""
        return (f"module {hooked[0]!r}{more} has forward hooks, an accelerate hook, a per-instance forward "
                "or is compiled")
    if getattr(model, "use_kernels", False):
        return "kernels-hub layers are in use (use_kernels)"
    if (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks):
        return "global module forward hooks are registered"
    if any(layer.self_attn.training and layer.self_attn.attention_dropout != 0 for layer in layers):
        return "attention dropout is active (model in training mode)"
    return None


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """LlamaRMSNorm / Qwen2RMSNorm.forward: x (N, 1, E) normalised in fp32, cast back, then scaled."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_rope(h: Tensor, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, D: int, cos: Tensor,
             sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One token's attention inputs as the HF attention forward makes them: h (N, 1, E) normed, cos / sin
    (N, 1, 1, D) -> q (N, H, 1, D) and k, v (N, Hkv, 1, D), the rotary embedding applied to q and k."""
    N = h.shape[0]
    q = q_proj(h).view(N, 1, -1, D).transpose(1, 2)
    k = k_proj(h).view(N, 1, -1, D).transpose(1, 2)
    v = v_proj(h).view(N, 1, -1, D).transpose(1, 2)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin), v


def _sdpa_attend(attn: nn.Module, mask: Tensor | None, k_buf: Tensor, v_buf: Tensor):
    """integrations/sdpa_attention.sdpa_attention_forward for q_len 1, its branches taken once here.

    q (N, H, 1, D), k / v (N, Hkv, L, D), mask (N, 1, 1, L) bool or None -> (N, 1, H * D)."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    groups, scale = attn.num_key_value_groups, attn.scaling
    # HF: GQA heads via sdpa's enable_gqa when no mask (and env / device allow), else q packed as
    # (N, Hkv, groups, D) against the shared keys: pack_gqa at q_len 1 (a (N, 1, 1, L) mask is unchanged)
    gqa = groups > 1 and use_gqa_in_sdpa(mask, k_buf, v_buf)
    Hkv, D = attn.config.num_key_value_heads, attn.head_dim
    packed = groups > 1 and not gqa
    shape_q = (lambda q: q.reshape(q.shape[0], Hkv, groups, D)) if packed else (lambda q: q)
    extra = {"enable_gqa": True} if gqa else {}

    def attend(q: Tensor, k: Tensor, v: Tensor, m: Tensor | None) -> Tensor:
        N = q.shape[0]
        out = F.scaled_dot_product_attention(shape_q(q), k, v, attn_mask=m, dropout_p=0.0,
                                             scale=scale, is_causal=False, **extra)
        out = out.reshape(out.shape[0], -1, 1, v.shape[-1]).transpose(1, 2).contiguous()
        return out.reshape(N, 1, -1).contiguous()

    return attend


def _eager_attend(attn: nn.Module, mask: Tensor | None, k_buf: Tensor, v_buf: Tensor):
    """modeling_llama.eager_attention_forward: q (N, H, 1, D), k / v (N, Hkv, L, D), mask (N, 1, 1, L)
    additive (0 / dtype min; eager_mask always materialises it) -> (N, 1, H * D)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    groups, scale = attn.num_key_value_groups, attn.scaling

    def attend(q: Tensor, k: Tensor, v: Tensor, m: Tensor) -> Tensor:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        w = torch.matmul(q, k.transpose(2, 3)) * scale + m
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return out.reshape(q.shape[0], 1, -1).contiguous()

    return attend


def _step_mask(impl: str, mask: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The 4-D mask HF builds each step, for all C columns at once: (N, 1, 1, C), sliced to (N, 1, 1, n).

    At q_len 1 every cached column is causally visible, so it is the padding mask alone. sdpa: None when no
    column is padding (sdpa_mask's _ignore_causal_mask_sdpa; the decode's columns are all 1, so the prompt's
    padding decides it for the whole decode), else bool. eager: always, as 0 / finfo(dtype).min."""
    keep = mask.bool()[:, None, None, :]
    if impl == "sdpa":
        return None if bool(keep.all()) else keep
    return torch.where(keep, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


ATTENDS = {"sdpa": _sdpa_attend, "eager": _eager_attend}


def lean_step(model, past: DynamicCache, mask: Tensor) -> Decode | None:
    """The lean one-token step over `model` writing into `past`, or None when why_not_lean gives a reason.

    past: the preallocated cache after the prefill. mask: (N, C) the decode's whole attention mask (prompt
    padding 0, C = prompt + new-token columns); step n attends to its first n columns."""
    if why_not_lean(model, past) is not None:
        return None
    config, body = model.config, model.model
    impl = config._attn_implementation
    dtype = body.embed_tokens.weight.dtype
    full_mask = _step_mask(impl, mask, dtype)
    embed, rotary, final_norm, lm_head = body.embed_tokens, body.rotary_emb, body.norm, model.lm_head
    # per layer, everything the step touches, looked up once (nn.Module.__getattr__ is slow per token)
    plan = []
    for layer, cache in zip(body.layers[:config.num_hidden_layers], past.layers):
        a, m = layer.self_attn, layer.mlp
        attend = ATTENDS[impl](a, None if full_mask is None else full_mask[..., :1], cache.keys, cache.values)
        plan.append((layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.head_dim, cache.update,
                     attend, layer.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj, m.act_fn))

    def step(tok: Tensor, pos: Tensor, n: int) -> Tensor:
        # (N, 1, 1, n), contiguous as HF's: on CUDA a strided mask can steer sdpa to another kernel
        m = None if full_mask is None else full_mask[..., :n].contiguous()
        x = embed(tok[:, None])  # (N, 1, E)
        cos, sin = rotary(x, pos)  # (N, 1, D): the model's own module, any rope type
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, 1, D), as apply_rotary_pos_emb unsqueezes
        for ln1, q_proj, k_proj, v_proj, o_proj, D, update, attend, ln2, gate, up, down, act in plan:
            q, k, v = qkv_rope(_rms_norm(x, ln1), q_proj, k_proj, v_proj, D, cos, sin)
            k, v = update(k, v)  # (N, Hkv, n, D): views of the preallocated buffers
            x = x + o_proj(attend(q, k, v, m))
            h = _rms_norm(x, ln2)
            x = x + down(act(gate(h)) * up(h))
        x = _rms_norm(x, final_norm)
        return lm_head(x[:, -1:, :])[:, -1]  # (N, V)

    def keep_rows(rows: Tensor) -> None:
        nonlocal full_mask
        past.reorder_cache(rows)  # each _GrowingLayer's buffers; `plan` holds the layers, not the buffers
        full_mask = None if full_mask is None else full_mask.index_select(0, rows)

    return Decode(step, keep_rows)


def hf_step(model, past, mask: Tensor, keep: dict) -> Decode:
    """The plain Hugging Face forward of one token (any model): the fallback and the reference."""
    def step(tok: Tensor, pos: Tensor, n: int) -> Tensor:
        nonlocal past
        out = model(input_ids=tok[:, None], attention_mask=mask[:, :n], position_ids=pos, use_cache=True,
                    **with_cache(model, past), **keep)
        past = cache_of(out)
        return out.logits[:, -1]

    def keep_rows(rows: Tensor) -> None:
        nonlocal mask
        past.reorder_cache(rows)
        mask = mask.index_select(0, rows)

    return Decode(step, keep_rows)


def decode_step(model, past, mask: Tensor, keep: dict, lean: bool = True) -> Decode:
    """The step `generate` calls per token: lean_step when `lean` and the model is supported, else hf_step."""
    return (lean_step(model, past, mask) if lean else None) or hf_step(model, past, mask, keep)
