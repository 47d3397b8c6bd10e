"""decode_step.py: the lean one-token step gives the Hugging Face forward's logits bit for bit (so the same
sampled ids and log-probs from generate), for every allow-listed architecture, dtype, padding and prefill
layout; with knobs merged; and anything off the allow-list falls back to the HF call."""

from __future__ import annotations

import pytest
import torch
from adapter_helpers import GQA, GQA_ARCHS, GQA_VOCAB, randomize
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from projected_grpo.knobs.adapters import wrap
from projected_grpo.organism.build import build_tokenizer, smoke_model_and_tokenizer, tiny_model
from projected_grpo.organism.warmup import builtin_corpus
from projected_grpo.sampling.decode_step import decode_step, hf_step, lean_step, why_not_lean
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.kv_cache import KV_CACHES, cache_of, with_cache
from projected_grpo.sampling.pack import left_pad, position_ids_from_mask

V = GQA_VOCAB


def _bench():  # benchmarks/vs_trl.py build_model(dir, 256, 4): the 4.46M-parameter bench Llama
    tokenizer = build_tokenizer(builtin_corpus().texts(), vocab_size=1024)
    return tiny_model(tokenizer, hidden=256, layers=4, heads=4)


def _seeded(build):
    torch.manual_seed(0)
    return build()


BUILDERS = {
    "bench": _bench,
    "organism": lambda: smoke_model_and_tokenizer()[0],
    "llama_gqa": lambda: _seeded(GQA_ARCHS["llama_sdpa"]),
    "llama_eager": lambda: _seeded(GQA_ARCHS["llama_eager"]),
    "qwen2": lambda: _seeded(GQA_ARCHS["qwen2"]),  # biased q/k/v projections
}
CASES = [pytest.param(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
         for name, dtype in [(n, torch.float32) for n in BUILDERS]
         + [("llama_gqa", torch.bfloat16), ("qwen2", torch.bfloat16)]]
PROMPTS = {"padded": [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]],  # left padding: a bool mask
           "unpadded": [[5, 6, 7, 8], [9, 10, 11, 12]]}  # no padding: HF passes no mask (sdpa enable_gqa)
_models: dict = {}


def _perturb(model) -> None:
    """A random init is nearly uniform and its norm weights are 1, its biases 0: sharpen the logits so samples
    depend on them, and make every 1-D parameter (norm scales, biases) non-trivial so their ops count."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_((0.3 * torch.randn(p.shape, generator=gen)).to(p.dtype))


def model_for(name: str, dtype: torch.dtype):
    if (name, dtype) not in _models:
        m = BUILDERS[name]().to(dtype).eval()
        _perturb(m)
        _models[name, dtype] = m
    return _models[name, dtype]


def _generate(model, prompts, lean, **kw):
    args = dict(max_new_tokens=10, seed=[3, 4, 5][:len(prompts)], eos_id=[], pad_id=0) | kw
    return generate(model, prompts, 2, lean=lean, **args)


def _assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a.completion_ids, b.completion_ids, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.logp, b.logp, strict=True))
    assert torch.equal(a.truncated, b.truncated)


def _prefilled(model, prompts, new_tokens=6, kv_cache="preallocated"):
    """(past, mask (N, P + new_tokens), last-position logits, positions) after an HF prefill of `prompts`."""
    ids, prompt_mask = left_pad(prompts, max(map(len, prompts)), 0)
    mask = torch.cat([prompt_mask, torch.ones((len(prompts), new_tokens), dtype=torch.long)], 1)
    pos = position_ids_from_mask(prompt_mask)
    out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **with_cache(model, KV_CACHES[kv_cache](model, mask.shape[1])))
    return cache_of(out), mask, out.logits[:, -1], pos[:, -1:]


# --- bit for bit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", CASES)
def test_lean_step_logits_equal_hf_bit_for_bit(name, dtype):
    model, prompts = model_for(name, dtype), PROMPTS["padded"]
    with torch.inference_mode():
        (past_l, mask, logits, pos), (past_h, *_) = _prefilled(model, prompts), _prefilled(model, prompts)
        assert why_not_lean(model, past_l) is None
        lean, hf = lean_step(model, past_l, mask), hf_step(model, past_h, mask, {"logits_to_keep": 1})
        n = mask.shape[1] - 6
        for _ in range(6):  # feed greedy tokens; every step's logits must agree in every bit
            tok, pos, n = logits.argmax(-1), pos + 1, n + 1
            logits, want = lean(tok, pos, n), hf(tok, pos, n)
            assert logits.dtype == want.dtype == dtype and torch.equal(logits, want)
        assert torch.equal(past_l.layers[-1].keys, past_h.layers[-1].keys)  # the same cache, continued


@pytest.mark.parametrize("share_prefill", [False, True])
@pytest.mark.parametrize("padding", list(PROMPTS))
@pytest.mark.parametrize("name,dtype", CASES)
def test_generate_lean_equals_hf(name, dtype, padding, share_prefill):
    model = model_for(name, dtype)
    a = _generate(model, PROMPTS[padding], lean=True, share_prefill=share_prefill)
    b = _generate(model, PROMPTS[padding], lean=False, share_prefill=share_prefill)
    _assert_same(a, b)
    assert len({tuple(c.tolist()) for c in a.completion_ids}) > 1  # the draws really depend on the logits


def test_generate_lean_equals_hf_with_eos_and_top_p():
    model = model_for("llama_gqa", torch.float32)
    free = _generate(model, PROMPTS["padded"], lean=False, top_p=0.9, temperature=0.7)
    drawn = torch.cat(free.completion_ids).tolist()
    eos = [max(range(V), key=drawn.count)]  # the likeliest token: rows stop early
    a = _generate(model, PROMPTS["padded"], lean=True, eos_id=eos, top_p=0.9, temperature=0.7)
    b = _generate(model, PROMPTS["padded"], lean=False, eos_id=eos, top_p=0.9, temperature=0.7)
    _assert_same(a, b)
    assert not a.truncated.all()


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_lean_step_with_merged_knobs(kind, tmp_path):
    # Qwen2 (biased projections) wrapped in KnobLinear: the lean step calls the wrappers as modules, so the
    # pinned W_eff of Knobs.merged() is what it multiplies by
    model = _seeded(GQA_ARCHS["qwen2"]).eval()
    _perturb(model)
    knobs = wrap(model, kind, cache_dir=tmp_path)
    randomize(knobs, scale=0.5)
    with torch.no_grad(), knobs.merged():
        a = _generate(model, PROMPTS["padded"], lean=True)
        b = _generate(model, PROMPTS["padded"], lean=False)
    with torch.no_grad(), knobs.zeroed(), knobs.merged():
        base = _generate(model, PROMPTS["padded"], lean=True)
    _assert_same(a, b)
    assert not all(torch.equal(x, y) for x, y in zip(a.logp, base.logp))  # the knobs did change the model


def test_smollm2_lean_equals_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()  # 9 / 3 GQA heads
    prompts = [[1, 9690, 198, 28, 7018], [1, 9690, 198]]
    _assert_same(_generate(model, prompts, lean=True, max_new_tokens=6),
                 _generate(model, prompts, lean=False, max_new_tokens=6))


# --- the fallback --------------------------------------------------------------------------------------


class _MyLlama(LlamaForCausalLM):
    pass


def _unsupported():
    """name -> (model, kv_cache, a phrase of why_not_lean's reason): each must take the HF path."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    sliding = Qwen2ForCausalLM(Qwen2Config(**GQA, use_sliding_window=True, sliding_window=4,
                                           max_window_layers=1, attn_implementation="sdpa"))
    sub = _MyLlama(LlamaConfig(**GQA))
    hooked = LlamaForCausalLM(LlamaConfig(**GQA))
    hooked.model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: out)
    dropout = LlamaForCausalLM(LlamaConfig(**GQA, attention_dropout=0.1))
    compiled = LlamaForCausalLM(LlamaConfig(**GQA))
    compiled.model.layers[1].compile()  # inductor rounds differently: the lean step must not stand in
    return {"gpt2": (gpt2.eval(), "preallocated", "GPT2LMHeadModel is not one of"),
            "sliding": (sliding.eval(), "preallocated", "only full_attention"),
            "subclass": (sub.eval(), "preallocated", "not a transformers model class"),
            "hooked": (hooked.eval(), "preallocated", "hooks"),
            "dropout": (dropout.train(), "preallocated", "dropout"),
            "compiled": (compiled.eval(), None, "compiled"),  # None: never run (compiling is slow)
            "dynamic": (model_for("llama_gqa", torch.float32), "dynamic", "not the filled preallocated")}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compile machinery, imported by .compile()
def test_unsupported_models_fall_back_to_hf():
    for name, (model, kv_cache, reason) in _unsupported().items():
        if kv_cache is None:
            assert reason in (why_not_lean(model, None) or ""), name
            continue
        with torch.inference_mode():
            past, mask, *_ = _prefilled(model, PROMPTS["padded"], kv_cache=kv_cache)
            assert reason in (why_not_lean(model, past) or ""), name
            assert lean_step(model, past, mask) is None, name
            assert decode_step(model, past, mask, {}).step.__qualname__.startswith("hf_step"), name
        if name != "dropout":  # sampling under active dropout is random in both paths
            _assert_same(_generate(model, PROMPTS["padded"], lean=True, kv_cache=kv_cache),
                         _generate(model, PROMPTS["padded"], lean=False, kv_cache=kv_cache))


def test_transformers_output_recorders_do_not_stop_the_lean_step():
    """A forward with output_hidden_states (the probe monitor's features) leaves transformers' recording
    hooks on the layers for good; they record nothing unless asked, so the lean step still stands in, bit for
    bit, while a hook of anyone else's is still refused (test_unsupported_models_fall_back_to_hf)."""
    model = model_for("llama_gqa", torch.float32)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
        assert any(m._forward_hooks for m in model.modules())  # the recorders are there
        past, mask, *_ = _prefilled(model, PROMPTS["padded"])
        assert why_not_lean(model, past) is None
        assert decode_step(model, past, mask, {}).step.__qualname__.startswith("lean_step")
    _assert_same(_generate(model, PROMPTS["padded"], lean=True),
                 _generate(model, PROMPTS["padded"], lean=False))


def test_lean_false_forces_hf_and_lean_true_takes_lean():
    model = model_for("llama_gqa", torch.float32)
    with torch.inference_mode():
        past, mask, *_ = _prefilled(model, PROMPTS["padded"])
        assert decode_step(model, past, mask, {}, lean=False).step.__qualname__.startswith("hf_step")
        assert decode_step(model, past, mask, {}).step.__qualname__.startswith("lean_step")
