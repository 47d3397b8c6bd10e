"""packed.py: sampling from bf16 copies of the weights gives the model's log-probs within what bf16 allows (as
close to the fp32 model as the Hugging Face model cast to bf16 is), for every allow-listed architecture,
padding, shared prefill and merged knobs; it is seeded; its fallback without oneDNN's packing agrees; and
anything off the allow-list is refused with the reason. Its fp32 layout (sample_dtype float32) gives them
within fp32 rounding. The unpacked fp32 path's bit-equality with the HF forward is
tests/test_decode_step.py's."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from adapter_helpers import GQA, GQA_ARCHS, GQA_VOCAB, randomize
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from projected_grpo.knobs.adapters import wrap
from projected_grpo.sampling import gemv, packed
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.pack import left_pad, pack, pad_right, position_ids_from_mask
from projected_grpo.sampling.packed import PackedLM, why_not_packed
from projected_grpo.sampling.sample import concrete_dtype, sample_and_grade
from projected_grpo.sampling.score import forward_logprobs

V = GQA_VOCAB
# GQA_ARCHS' head size is 16, so their decode attends with sdpa; llama_d32's 32 is one gemv.attend_one is
# built for (gemv.HEAD_DIMS), so its decode attends on that kernel (fp32 and bf16 on a CPU that builds it)
BUILDERS = {**GQA_ARCHS, "llama_d32": lambda: LlamaForCausalLM(LlamaConfig(
    **{**GQA, "hidden_size": 128, "intermediate_size": 256}, attn_implementation="sdpa"))}
PROMPTS = {"padded": [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]],
           "unpadded": [[5, 6, 7], [8, 9, 10]]}


def _model(name: str):
    torch.manual_seed(0)
    m = BUILDERS[name]().eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # sharp logits and non-trivial norms / biases, so every op counts
        m.lm_head.weight.mul_(8.0)
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return m


def _bf16_reference(model):
    """The HF model cast to bf16, its rotary frequencies kept in fp32 (a `from_pretrained(dtype=bf16)` model
    computes them in fp32; `.to(bf16)` alone would round them, which PackedLM does not)."""
    ref = copy.deepcopy(model).to(torch.bfloat16)
    ref.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()
    return ref


def _teacher_forced(model, prompts, new, sampled=None, dtype=torch.bfloat16):
    """(fp32 HF log-probs, bf16-cast HF log-probs, PackedLM log-probs in `dtype`) of every prompt's next token
    and of `new` fed tokens after it: each (N, new + 1, V). sampled: the model PackedLM copies (default
    `model`)."""
    ids, pm = left_pad(prompts, max(map(len, prompts)), 0)
    fed = torch.arange(20, 20 + new).repeat(len(prompts), 1)  # (N, new)
    full = torch.cat([ids, fed], 1)
    mask = torch.cat([pm, torch.ones_like(fed)], 1)
    pos = position_ids_from_mask(mask)
    P = ids.shape[1]
    with torch.inference_mode():
        refs = [m(input_ids=full, attention_mask=mask, position_ids=pos).logits[:, P - 1:].float()
                for m in (model, _bf16_reference(model))]
        lm = PackedLM(sampled or model, rows=len(prompts), dtype=dtype)
        out = [lm.prefill(ids, pm, pos[:, :P], full.shape[1])]
        step = lm.stepper(mask)
        for t in range(new):
            out.append(step(fed[:, t], pos[:, P + t:P + t + 1], P + t + 1))
    return [torch.log_softmax(x, -1) for x in (*refs, torch.stack(out, 1))]


@pytest.mark.parametrize("layout", sorted(PROMPTS))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_logprobs_within_bf16_of_the_model(name, layout):
    fp32, hf_bf16, ours = _teacher_forced(_model(name), PROMPTS[layout], new=5)
    real = torch.isfinite(fp32)
    err_hf = (hf_bf16 - fp32)[real].abs().max()
    err = (ours - fp32)[real].abs().max()
    # bf16 keeps 8 significant bits: HF's own bf16 cast is off by err_hf; ours rounds differently (fused
    # projections and epilogues) but no worse than twice that, and never more than 0.1 nats
    assert err <= 2 * err_hf + 1e-3 and err < 0.1, (float(err), float(err_hf))
    assert err > 0  # it is bf16: the check above could not pass on fp32 by accident


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fp32_packed_logprobs_within_fp32_rounding_of_the_model(name):
    """sample_dtype float32: the same fp32 weights, laid out for gemv.py's kernel (or oneDNN's where it cannot
    be built): the model's log-probs up to fp32 rounding (another summation order), not bit for bit."""
    fp32, _, ours = _teacher_forced(_model(name), PROMPTS["padded"], new=5, dtype=torch.float32)
    lm = PackedLM(_model(name), rows=1, dtype=torch.float32)
    assert lm.lm_head.kernel == ("blocked" if gemv.why_not() is None else "onednn")
    real = torch.isfinite(fp32)
    # logits of order 10 (lm_head x 8), fp32 epsilon 1.2e-7: measured 1.4e-6 - 1.9e-6 (AMD EPYC); bf16 is 1e-2
    assert (ours - fp32)[real].abs().max() < 1e-4


def test_generate_fp32_packed_is_seeded_and_samples_the_models_tokens():
    model = _model("llama_sdpa")
    kw = dict(max_new_tokens=8, seed=[3, 4, 5], eos_id=[], pad_id=0)
    a, b = (generate(model, PROMPTS["padded"], 2, sample_dtype=torch.float32, **kw) for _ in range(2))
    own = generate(model, PROMPTS["padded"], 2, **kw)
    assert all(map(torch.equal, a.completion_ids, b.completion_ids)) and all(map(torch.equal, a.logp, b.logp))
    # the same draws from (nearly) the same distributions: the model's own tokens (not a bitwise promise: a
    # token could differ only where a uniform falls within ~1e-6 of a CDF step, odds ~1e-5 for these 48
    # draws on any CPU), log-probs within rounding
    assert all(map(torch.equal, a.completion_ids, own.completion_ids))
    with torch.no_grad():
        logp, _ = forward_logprobs(model, pack(a.prompt_ids, a.completion_ids, 0))
    assert (torch.stack(a.logp) - logp).abs().max() < 1e-4


def test_generate_fp32_packed_repeats_on_two_threads():
    # the blocked kernel shares its column blocks out over torch's threads (gemv.py): a seeded run repeats bit
    # for bit at that thread count too (the suite runs on one thread: conftest.py)
    model = _model("llama_sdpa")
    kw = dict(max_new_tokens=8, seed=[3, 4, 5], eos_id=[], pad_id=0, sample_dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a, b = (generate(model, PROMPTS["padded"], 2, **kw) for _ in range(2))
    finally:
        torch.set_num_threads(threads)
    assert all(map(torch.equal, a.completion_ids, b.completion_ids)) and all(map(torch.equal, a.logp, b.logp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_retiring_finished_rows_samples_the_same_rows(dtype):
    # rows end at an id that the free run samples mid-row, so the decode batch shrinks step by step
    model = _model("llama_sdpa")
    kw = dict(max_new_tokens=10, seed=[3, 4, 5], pad_id=0, sample_dtype=dtype)
    free = generate(model, PROMPTS["padded"], 4, eos_id=[], **kw)
    ends = [int(c[3]) for c in free.completion_ids[:3]]
    kept, retired = (generate(model, PROMPTS["padded"], 4, eos_id=ends, retire=r, **kw)
                     for r in (False, True))
    assert len({len(c) for c in retired.completion_ids}) > 2 and not retired.truncated[:3].any()
    # the same uniforms over the same distributions, so the same tokens wherever a row's logits agree to
    # within ~1e-6 at both batch sizes (fp32; not a bitwise promise: a token could differ only where a
    # uniform falls that close to a CDF step); bf16 at a few rows rounds differently, so there only the
    # log-probs are checked
    if dtype == torch.float32:
        assert all(map(torch.equal, kept.completion_ids, retired.completion_ids))
        assert torch.equal(kept.truncated, retired.truncated)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, pack(retired.prompt_ids, retired.completion_ids, 0))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (pad_right(retired.logp, logp.shape[1]) - logp).abs().max() < tol


def test_generate_bf16_is_seeded_and_scores_like_the_model():
    model = _model("llama_sdpa")
    kw = dict(max_new_tokens=8, seed=[3, 4, 5], eos_id=[], pad_id=0, sample_dtype=torch.bfloat16)
    a = generate(model, PROMPTS["padded"], 2, **kw)
    b = generate(model, PROMPTS["padded"], 2, **kw)
    assert all(map(torch.equal, a.completion_ids, b.completion_ids)) and all(map(torch.equal, a.logp, b.logp))
    # the behaviour log-probs are the bf16 model's: within bf16 of the fp32 model's on the same tokens
    with torch.no_grad():
        logp, _ = forward_logprobs(model, pack(a.prompt_ids, a.completion_ids, 0))
    mu = torch.stack(a.logp)
    assert (mu - logp).abs().max() < 0.1
    assert not torch.equal(mu, logp)


def test_greedy_bf16_picks_the_models_tokens():
    """Greedy bf16 decoding follows the fp32 model's greedy tokens wherever bf16 cannot flip its choice: up to
    the first step whose fp32 top-2 logit margin is under 0.2 (twice the 0.1 bf16 error bound above), where
    either token may win and the rows may part."""
    model = _model("qwen2")
    kw = dict(max_new_tokens=8, temperature=0.0, seed=0, eos_id=[], pad_id=0)
    bf16, own = (generate(model, PROMPTS["padded"], 1, sample_dtype=d, **kw) for d in (torch.bfloat16, None))
    for prompt, ours, ref in zip(PROMPTS["padded"], bf16.completion_ids, own.completion_ids):
        with torch.no_grad():  # the fp32 model's logits at each of its greedy steps
            logits = model(torch.tensor([prompt + ref.tolist()])).logits[0, len(prompt) - 1:-1]
        top2 = logits.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]  # (8,)
        part = int((ours != ref).int().argmax()) if not torch.equal(ours, ref) else len(ref)
        # parted only at a near-tie (each row's first step has a margin of 0.38-0.65: never vacuous)
        assert part == len(ref) or margin[part] < 0.2, (part, margin.tolist())


def test_shared_prefill_samples_the_same_distribution():
    model = _model("llama_sdpa")
    kw = dict(max_new_tokens=6, seed=[3, 4, 5], eos_id=[], pad_id=0, sample_dtype=torch.bfloat16)
    shared = generate(model, PROMPTS["padded"], 3, share_prefill=True, **kw)
    plain = generate(model, PROMPTS["padded"], 3, share_prefill=False, **kw)
    with torch.no_grad():
        for ro in (shared, plain):
            logp, _ = forward_logprobs(model, pack(ro.prompt_ids, ro.completion_ids, 0))
            assert (torch.stack(ro.logp) - logp).abs().max() < 0.1


def test_merged_knobs_are_sampled():
    model, plain = _model("llama_sdpa"), _model("llama_sdpa")
    knobs = wrap(model, "svd")
    randomize(knobs, scale=0.3, seed=1)
    with torch.no_grad():  # `plain`: the same model with W_eff written into its weights
        for name, m in knobs.modules.items():
            plain.get_submodule(name).weight.copy_(m.weight_eff())
        base, _, _ = _teacher_forced(_model("llama_sdpa"), PROMPTS["padded"], new=3)
        with knobs.merged():
            fp32, hf_bf16, ours = _teacher_forced(plain, PROMPTS["padded"], new=3, sampled=model)
    assert (ours - fp32).abs().max() <= 2 * (hf_bf16 - fp32).abs().max() + 1e-3
    assert (base - fp32).abs().max() > 0.1  # the knobs moved the model: what was sampled is the knobbed one


def test_unpacked_fallback_agrees(monkeypatch):
    """Without oneDNN's packing nor gemv.py's kernel (other devices, older torch, no compiler) the same ops
    run as plain bf16 F.linear."""
    model = _model("llama_sdpa")
    fp32, _, packed_lp = _teacher_forced(model, PROMPTS["padded"], new=3)
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: False)
    monkeypatch.setattr(packed, "_blocked_kernel", lambda: False)
    _, _, plain_lp = _teacher_forced(model, PROMPTS["padded"], new=3)
    assert PackedLM(model, rows=1).lm_head.kernel == "plain"
    assert (plain_lp - packed_lp).abs().max() < 0.1 and (plain_lp - fp32).abs().max() < 0.1


def test_off_the_allow_list_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "GPT2LMHeadModel" in why_not_packed(gpt2)
    with pytest.raises(ValueError, match="sample_dtype=bfloat16: GPT2LMHeadModel"):
        generate(gpt2, [[1, 2]], 1, max_new_tokens=2, seed=0, eos_id=[], pad_id=0,
                 sample_dtype=torch.bfloat16)
    model = _model("llama_sdpa")
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in why_not_packed(model)


def test_gradient_checkpointing_switch_is_no_hook():
    """knobs.gradient_checkpointing() gives each decoder layer an instance forward that, without grad, runs
    the class's: the lean step and the packed forward still apply (other instance forwards are refused)."""
    model = _model("llama_sdpa")
    knobs = wrap(model, "svd")
    randomize(knobs, scale=0.3, seed=1)
    kw = dict(max_new_tokens=6, seed=[3, 4, 5], eos_id=[], pad_id=0)
    with torch.no_grad(), knobs.merged():
        plain = [generate(model, PROMPTS["padded"], 2, sample_dtype=d, **kw) for d in (None, torch.bfloat16)]
    knobs.gradient_checkpointing(True)
    assert why_not_packed(model) is None
    with torch.no_grad(), knobs.merged():
        ckpt = [generate(model, PROMPTS["padded"], 2, sample_dtype=d, **kw) for d in (None, torch.bfloat16)]
    for a, b in zip(plain, ckpt):
        assert all(map(torch.equal, a.completion_ids, b.completion_ids))
        assert all(map(torch.equal, a.logp, b.logp))


# --- rollout.sample_dtype "auto": bf16 only where the CPU packs it ------------------------------------------

@pytest.mark.parametrize("bf16_kernels, want", [(True, "bfloat16"), (False, "float32")])
def test_auto_picks_bf16_only_where_the_cpu_has_bf16_kernels(monkeypatch, bf16_kernels, want):
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: bf16_kernels)
    assert packed.auto_dtype("cpu") == want
    assert packed.auto_dtype("cuda:0") == "model"  # a GPU samples the model's own forward
    assert concrete_dtype("auto", torch.device("cpu")) == want
    for name in ("model", "float32", "bfloat16"):  # anything else is taken as given
        assert concrete_dtype(name, "cpu") == name


def test_bf16_without_bf16_kernels_warns_once_and_fp32_never(monkeypatch):
    model = _model("llama_sdpa")
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: dtype != torch.bfloat16)
    if gemv.why_not() is None:  # an AVX2 CPU with a compiler: gemv.py's kernel takes the bf16 weights
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert PackedLM(model, rows=64, dtype=torch.bfloat16).lm_head.kernel == "blocked"
    monkeypatch.setattr(gemv, "why_not", lambda: "no c++")  # and without one: unpacked, with a warning
    with pytest.warns(UserWarning, match="without oneDNN bf16 kernels.*'auto'"):
        PackedLM(model, rows=1, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PackedLM(model, rows=1, dtype=torch.float32)


def test_auto_samples_what_it_resolves_to(monkeypatch):
    """sample_and_grade's "auto" is generate's sample_dtype of the resolved name: the same stream."""
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: dtype != torch.bfloat16)
    model = _model("llama_sdpa")
    ids = {"a": torch.tensor(PROMPTS["padded"][0]), "b": torch.tensor(PROMPTS["padded"][1])}
    probs = [types.SimpleNamespace(id=k, mode="m") for k in ids]
    tok = types.SimpleNamespace(eos_token_id=[], pad_token_id=0, batch_decode=lambda r, **k: [""] * len(r))
    env = types.SimpleNamespace(grade=lambda texts, owners: [None] * len(texts))
    got = {d: sample_and_grade(model, tok, env, probs, ids, 2, max_new_tokens=4, seed=3, sample_dtype=d)
           for d in ("auto", "float32")}
    for a, b in zip(got["auto"], got["float32"]):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.logp_behaviour, b.logp_behaviour)
