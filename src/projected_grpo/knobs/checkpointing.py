"""Gradient (activation) checkpointing of a Hugging Face model's decoder layers, in eval mode too.

`enable(model)` makes every `GradientCheckpointingLayer` (each decoder layer of a transformers model)
run under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` whenever grad is enabled (then
without KV cache, as transformers does): its activations are dropped after the forward and
recomputed in the backward.
Why not `model.gradient_checkpointing_enable()`: transformers checkpoints only while `model.training`,
and training mode also switches dropout on; our training forward runs in eval mode. The non-reentrant
variant is required: the fused knob Functions (fused.py) reduce per-sequence gradients in the backward
of the original graph node, which non-reentrant checkpointing keeps (the reentrant one replays a
second graph). `recomputing()` tells a forward that it is such a replay, so it registers nothing.
A KV cache is dropped from a checkpointed forward (a replay would write it twice) unless it says
`replay_safe = True`: its `update` writes nothing while `recomputing()` (sampling/prefix.py's caches).
Not here: which loss or batch is checkpointed (the caller's forward), memory accounting.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


def recomputing() -> bool:
    """True inside a backward pass, which is where a non-reentrant checkpoint replays a forward.

    Uses `torch._C._current_graph_task_id()` (-1 outside any backward; torch has no public equivalent).
    A forward run by user code from inside a backward hook would also read True.
    """
    return torch._C._current_graph_task_id() != -1


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    forward = functools.partial(type(layer).forward, layer)  # the class's own forward
    if not torch.is_grad_enabled():  # sampling, reference forwards: nothing to keep for a backward
        return forward(*args, **kwargs)
    # the layer's cache keyword: `cache` from transformers 5.24 on, `past_key_values` before
    name = "cache" if "cache" in kwargs else "past_key_values"
    cache = kwargs.get(name)
    if (kwargs.get("use_cache") or cache is not None) and not getattr(cache, "replay_safe", False):
        # a replay would write the KV cache twice; transformers drops it the same way (and warns)
        warnings.warn("gradient checkpointing: a forward with grad runs without the KV cache (pass "
                      "use_cache=False to silence this)", stacklevel=3)
        kwargs = {**kwargs, **{k: v for k, v in (("use_cache", False), (name, None)) if k in kwargs}}
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def layers(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointable layers; raises if it has none (not a transformers decoder)."""
    found = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no transformers GradientCheckpointingLayer (decoder "
                         "layer) to checkpoint; gradient checkpointing needs a transformers causal LM")
    return found


def enable(model: nn.Module, on: bool = True) -> None:
    """Turn checkpointing of every decoder layer on (or off with on=False); idempotent.

    The switch is an instance attribute `forward` bound to the layer (a bound method, so a deep copy
    of the model, e.g. `plain.export`, rebinds it to the copy's layer)."""
    for layer in layers(model):
        if on:
            layer.forward = types.MethodType(_checkpointed_forward, layer)
        elif "forward" in vars(layer):
            del layer.forward


def switched(module: nn.Module) -> bool:
    """Whether module's instance `forward` is this switch (enable's), which without grad is its class's."""
    return getattr(vars(module).get("forward"), "__func__", None) is _checkpointed_forward
