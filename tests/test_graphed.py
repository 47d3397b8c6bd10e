"""graphed.py: the fixed-shape decode step (attention over the whole KV buffer under a mask) gives the lean
step's logits up to rounding, writes the same keys and values, and is refused where it cannot run; on a GPU
(`pytest -m gpu`) the CUDA-graph replay samples as the eager fixed-shape step does."""

from __future__ import annotations

import pytest
import torch
from adapter_helpers import GQA_ARCHS

from projected_grpo.config import Config, ModelCfg, RolloutCfg
from projected_grpo.errors import UserError
from projected_grpo.sampling.decode_step import lean_step
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.graphed import graphed_step, static_step
from projected_grpo.sampling.kv_cache import KV_CACHES, cache_of, with_cache
from projected_grpo.sampling.pack import left_pad, position_ids_from_mask

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # left padding: masked prompt columns
NEW = 8


def _model(name: str, dtype: torch.dtype, device: str = "cpu"):
    torch.manual_seed(0)
    model = GQA_ARCHS[name]().to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen a random init's near-uniform logits
    return model


def _prefilled(model):
    """(past, mask (N, P + NEW), last-position logits, positions (N, 1)) after an HF prefill of PROMPTS."""
    device = next(model.parameters()).device
    ids, prompt_mask = left_pad(PROMPTS, max(map(len, PROMPTS)), 0)
    mask = torch.cat([prompt_mask, torch.ones((len(PROMPTS), NEW), dtype=torch.long)], 1).to(device)
    ids, prompt_mask = ids.to(device), prompt_mask.to(device)
    pos = position_ids_from_mask(prompt_mask)
    out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **with_cache(model, KV_CACHES["preallocated"](model, mask.shape[1])))
    return cache_of(out), mask, out.logits[:, -1], pos[:, -1:]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama_sdpa", "llama_eager", "qwen2"])
def test_static_step_equals_lean_step_up_to_rounding(name, dtype, tol):
    model = _model(name, dtype)
    with torch.inference_mode():
        (past_s, mask, logits, pos), (past_l, *_) = _prefilled(model), _prefilled(model)
        filled = past_s.layers[0]._n
        static, lean = static_step(model, past_s, mask), lean_step(model, past_l, mask)
        n = mask.shape[1] - NEW
        for _ in range(NEW - 1):  # greedy tokens from the lean step's logits: both steps see the same inputs
            tok, pos, n = logits.argmax(-1), pos + 1, n + 1
            got, logits = static(tok, pos, torch.tensor(n)), lean(tok, pos, n)
            assert got.shape == logits.shape and got.dtype == dtype
            # rounding only: the softmax sums over zero-weight masked columns too (graphed.py)
            torch.testing.assert_close(got.float(), logits.float(), atol=tol * logits.abs().max().item(),
                                       rtol=0)
        for layer_s, layer_l in zip(past_s.layers, past_l.layers, strict=True):  # the same keys and values
            torch.testing.assert_close(layer_s._k[:, :, :n], layer_l.keys, atol=tol, rtol=tol)
            torch.testing.assert_close(layer_s._v[:, :, :n], layer_l.values, atol=tol, rtol=tol)
            assert filled < n and not layer_s._v[:, :, n:].any()  # columns not yet written stay zero


def test_static_step_refuses_what_the_lean_step_refuses():
    model = _model("llama_sdpa", torch.float32)
    with torch.inference_mode():
        _, mask, _, _ = _prefilled(model)
        past = KV_CACHES["dynamic"](model, mask.shape[1])  # None: not the preallocated cache
        with pytest.raises(ValueError, match="rollout.cuda_graph.*preallocated"):
            static_step(model, past, mask)


def test_cuda_graph_is_refused_off_a_gpu():
    model = _model("llama_sdpa", torch.float32)
    with torch.inference_mode():
        past, mask, _, _ = _prefilled(model)
        with pytest.raises(ValueError, match="CUDA graphs need a GPU"):
            graphed_step(model, past, mask)
    with pytest.raises(ValueError, match="cuda_graph decodes the model's own weights"):
        generate(model, PROMPTS, 2, max_new_tokens=4, seed=0, eos_id=[], pad_id=0, cuda_graph=True,
                 sample_dtype=torch.bfloat16)
    with pytest.raises(UserError, match="rollout.cuda_graph .* but model.device is 'cpu'$"):
        Config(rollout=RolloutCfg(cuda_graph=True))
    with pytest.raises(UserError, match="but rollout.sample_dtype is 'bfloat16'$"):
        Config(model=ModelCfg(device="cuda"), rollout=RolloutCfg(cuda_graph=True, sample_dtype="bfloat16"))
    Config(model=ModelCfg(device="cuda"), rollout=RolloutCfg(cuda_graph=True))  # what it needs: accepted


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_generate_samples_as_the_lean_step_up_to_rounding(dtype):
    model = _model("llama_sdpa", dtype, "cuda")
    args = dict(max_new_tokens=12, seed=[3, 4, 5], eos_id=[], pad_id=0)
    graph, lean = (generate(model, PROMPTS, 2, cuda_graph=g, **args) for g in (True, False))
    assert len({tuple(c.tolist()) for c in graph.completion_ids}) > 1  # the draws depend on the logits
    same = [torch.equal(a, b) for a, b in zip(graph.completion_ids, lean.completion_ids, strict=True)]
    assert sum(same) >= len(same) - 1  # a rounding-level change of the logits may flip one draw, rarely
    for a, b, ok in zip(graph.logp, lean.logp, same, strict=True):
        if ok:
            torch.testing.assert_close(a, b, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=0)
    again = generate(model, PROMPTS, 2, cuda_graph=True, **args)  # a fresh graph, the same draws
    assert all(torch.equal(a, b) for a, b in zip(graph.completion_ids, again.completion_ids, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(graph.logp, again.logp, strict=True))
