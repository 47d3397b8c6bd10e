"""A decode step captured once in a CUDA graph and replayed for every token (rollout.cuda_graph).

On a GPU a one-token decode step of a small model is launch-bound: SmolLM2's 30 layers issue ~750 small
kernels per token, each a few microseconds of work behind its launch and the Python that issues it
(docs/benchmarks.md, "On a GPU"). A CUDA graph replays them all from one launch. A graph fixes every shape
and address, so `static_step` attends over the whole preallocated KV buffer (prompt + max_new_tokens columns)
under a mask of the columns filled so far, where the lean step (decode_step.py) attends over the filled
columns alone: the same distribution, but the softmax runs over more (masked, exactly zero) terms on other
shapes, so the logits round differently in the last bits: not the HF forward's bit for bit. generate returns
the log-probs of the distribution each token was drawn from (this step's), so the behaviour log-probs are
exact for what was sampled; their ratio to the training forward's differs from 1 by that rounding (sample/kl
logs it, as for the packed samplers). Same allow-list as the lean step (decode_step.why_not_lean); the
attention is sdpa with a boolean mask whatever the model's attention implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from projected_grpo.sampling.decode_step import Step, _rms_norm, qkv_rope, why_not_lean


def static_step(model, past, mask: Tensor):
    """The fixed-shape one-token step over `model` writing into `past` (the preallocated cache after the
    prefill), or raise ValueError when decode_step.why_not_lean gives a reason. Runs on any device (tests
    compare it with the lean step on the CPU); `graphed_step` captures it on CUDA.

    mask: (N, C) the decode's whole attention mask (prompt padding 0, C = prompt + new-token columns).
    Returns step(tok (N,), pos (N, 1), n () long tensor) -> logits (N, V), which writes token n - 1's keys and
    values into the buffers and attends to the columns c < n that the mask keeps."""
    reason = why_not_lean(model, past)
    if reason is not None:
        raise ValueError(f"rollout.cuda_graph: the fixed-shape decode step cannot run this model: {reason}; "
                         "set rollout.cuda_graph false")
    config, body = model.config, model.model
    N, C = mask.shape
    keep = mask.bool()  # (N, C)
    cols = torch.arange(C, device=mask.device)  # (C,)
    embed, rotary, final_norm, lm_head = body.embed_tokens, body.rotary_emb, body.norm, model.lm_head
    Hkv, plan = config.num_key_value_heads, []
    for layer, cache in zip(body.layers[:config.num_hidden_layers], past.layers):
        # the columns not yet written hold whatever new_empty left: zero them, since a masked column's weight
        # is exactly 0 but 0 * NaN is not
        cache._k[:, :, cache._n:].zero_()
        cache._v[:, :, cache._n:].zero_()
        a, m = layer.self_attn, layer.mlp
        plan.append((layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.head_dim, Hkv,
                     a.num_key_value_groups, a.scaling, cache._k, cache._v, layer.post_attention_layernorm,
                     m.gate_proj, m.up_proj, m.down_proj, m.act_fn))

    def step(tok: Tensor, pos: Tensor, n: Tensor) -> Tensor:
        attend_to = (keep & (cols < n))[:, None, None, :]  # (N, 1, 1, C)
        at = (n - 1).reshape(1)  # (1,): the column this token's keys and values go to
        x = embed(tok[:, None])  # (N, 1, E)
        cos, sin = rotary(x, pos)  # (N, 1, D): the model's own module, any rope type
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, 1, D)
        for (ln1, q_proj, k_proj, v_proj, o_proj, D, Hkv, groups, scale, k_buf, v_buf, ln2, gate, up, down,
             act) in plan:
            q, k, v = qkv_rope(_rms_norm(x, ln1), q_proj, k_proj, v_proj, D, cos, sin)  # (N, H|Hkv, 1, D)
            k_buf.index_copy_(2, at, k)
            v_buf.index_copy_(2, at, v)
            # q's heads as (Hkv, groups) rows against their shared keys (repeat_kv's order: head
            # j * groups + i reads KV head j), so the buffers are read once, not `groups` times
            out = F.scaled_dot_product_attention(q.reshape(N, Hkv, groups, D), k_buf, v_buf,
                                                 attn_mask=attend_to, dropout_p=0.0, scale=scale)
            x = x + o_proj(out.reshape(N, 1, -1))  # (N, Hkv, groups, D) -> (N, 1, H * D)
            h = _rms_norm(x, ln2)
            x = x + down(act(gate(h)) * up(h))
        x = _rms_norm(x, final_norm)
        return lm_head(x)[:, -1]  # (N, V)

    return step


def graphed_step(model, past, mask: Tensor) -> Step:
    """static_step captured in a CUDA graph on its first call and replayed on every call after; the Step
    generate calls (tok (N,), pos (N, 1), n int -> logits (N, V)). The logits returned are the graph's output
    buffer, overwritten by the next call (generate draws from them before it calls again). The graph lives as
    long as the returned function (one generate call): the KV buffers and knob weights it reads must not move
    in between, which holds inside Knobs.merged()."""
    if mask.device.type != "cuda":
        raise ValueError(f"rollout.cuda_graph: the model is on {mask.device}, CUDA graphs need a GPU; set "
                         "rollout.cuda_graph false")
    step = static_step(model, past, mask)
    N, device = mask.shape[0], mask.device
    tok_s = torch.zeros(N, dtype=torch.long, device=device)
    pos_s = torch.zeros((N, 1), dtype=torch.long, device=device)
    n_s = torch.zeros((), dtype=torch.long, device=device)
    graph: torch.cuda.CUDAGraph | None = None
    out: Tensor | None = None

    def run(tok: Tensor, pos: Tensor, n: int) -> Tensor:
        nonlocal graph, out
        tok_s.copy_(tok)
        pos_s.copy_(pos)
        n_s.fill_(n)
        if graph is None:
            # one eager call first, on a side stream (torch.cuda.graphs' recipe): lazy initialisation and
            # kernel choices happen outside the capture. It writes this token's keys and values, as the
            # replay below writes them again, identically.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step(tok_s, pos_s, n_s)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(tok_s, pos_s, n_s)
        graph.replay()
        return out

    return run
