"""sampling/prefix.py: the prefix-shared scoring forward equals the packed one (log-probs, entropies, knob
gradients, the per-source split against the two-backward oracle), with and without gradient checkpointing,
its completions in one forward or in like-length buckets (pack.length_buckets, by hand and against brute
force); generate's shared prefill keeps the sampled ids.

Run: .venv/bin/pytest -q tests/test_prefix.py
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import two_backward_split
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from projected_grpo.knobs.adapters import wrap
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.pack import length_buckets, pack
from projected_grpo.sampling.prefix import SCORINGS, pack_prefix, prefix_logprobs, scoring, supported
from projected_grpo.sampling.score import forward_logprobs

V, PAD = 48, 0
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
MODELS = {
    "llama-sdpa": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")),
    "llama-eager": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="eager")),
    # absolute positions: a completion scored at the wrong position changes its logits (no knobs: GPT-2's
    # projections are Conv1D, not nn.Linear)
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               pad_token_id=PAD, bos_token_id=2, eos_token_id=1,
                                               tie_word_embeddings=False)),
}

# three groups of four: prompts of lengths 5, 3 and 7; students first, then teacher rows (batches.py);
# completions ragged, one of a single token (scored from the prompt's last position alone)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
SOURCES = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
LENGTHS = [[3, 6, 1, 4], [2, 5, 5, 3], [6, 2, 4, 1]]


def rows(seed: int = 3):
    """(prompt_ids, completion_ids, is_student (N,) bool, adv (N,)) of the 12 rows above; ids (T,) long
    tensors, a group's rows sharing its prompt's tensor (as sampling's do)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [p for p, ls in zip(map(torch.tensor, PROMPTS), LENGTHS) for _ in ls]
    completions = [torch.randint(1, V, (n,), generator=g) for ls in LENGTHS for n in ls]
    is_student = torch.tensor([bool(s) for ss in SOURCES for s in ss])
    return prompts, completions, is_student, torch.randn(len(prompts), generator=g)


def model_and_knobs(name: str, kind: str, tmp_path, ckpt: bool = False):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    knobs = wrap(model, kind, rank=4 if kind == "lora" else None, cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    for p in knobs.parameters():  # away from zero: every term of the gradient is exercised
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    if ckpt:
        knobs.gradient_checkpointing(True)
    return model, knobs


def max_rel(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


# --- layout by hand --------------------------------------------------------------------------------


def test_pack_prefix_by_hand():
    # rows: ([1, 2, 3], student), ([1, 2, 3], student), ([4, 5], student), ([1, 2, 3], teacher)
    # -> prefix rows in order of first appearance: 0 = ([1,2,3], S), 1 = ([4,5], S), 2 = ([1,2,3], T)
    b = pack_prefix([[1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 3]], [[7], [8, 9], [6, 6, 6], [9, 8]], 0,
                    [True, True, True, False])
    assert b.owner.tolist() == [0, 0, 1, 2]
    assert b.prefix_ids.tolist() == [[1, 2, 3], [0, 4, 5], [1, 2, 3]]  # left-padded
    assert b.prefix_mask.tolist() == [[1, 1, 1], [0, 1, 1], [1, 1, 1]]
    assert b.prefix_student.tolist() == [True, True, False]
    assert b.completion_ids.tolist() == [[7, 0, 0], [8, 9, 0], [6, 6, 6], [9, 8, 0]]  # right-padded
    assert b.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]]
    assert b.T == 3 and b.completion_mask.dtype == torch.float32
    # tensors of equal values are one prompt, whatever the objects: the same layout, bit for bit
    t = pack_prefix([torch.tensor(p) for p in ([1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 3])],
                    [torch.tensor(c) for c in ([7], [8, 9], [6, 6, 6], [9, 8])], 0, [True, True, True, False])
    assert all(torch.equal(x, y) for x, y in zip(vars(t).values(), vars(b).values()))


def test_pack_prefix_rejects_bad_input():
    with pytest.raises(ValueError, match="3 rows but 2 is_student"):
        pack_prefix([[1], [1], [2]], [[3], [3], [3]], 0, [True, False])
    with pytest.raises(ValueError, match="empty completion"):
        pack_prefix([[1]], [[]], 0, [True])
    with pytest.raises(ValueError, match="empty prompt"):
        pack_prefix([[]], [[3]], 0, [True])


# --- the same log-probs, entropies and gradients as the packed forward -----------------------------


@pytest.mark.parametrize("buckets", [1, 3])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_packed_forward(name, temperature, buckets, tmp_path):
    if name == "gpt2":
        torch.manual_seed(0)
        model, contexts = MODELS[name]().eval(), [contextlib.nullcontext]
    else:  # the reference (knobs zeroed: the base model) and the policy
        model, knobs = model_and_knobs(name, "svd", tmp_path)
        contexts = [knobs.zeroed, knobs.ablate_quarantine]
    prompts, completions, is_student, _ = rows()
    packed, shared = pack(prompts, completions, PAD), pack_prefix(prompts, completions, PAD, is_student)
    assert shared.prefix_ids.shape[0] == 5  # 3 prompts; groups 0 and 1 also have teachers: 5 prefix rows
    with torch.no_grad():
        for ctx in contexts:
            with ctx():
                want, want_h = forward_logprobs(model, packed, temperature=temperature, with_entropy=True)
                got, got_h = prefix_logprobs(model, shared, temperature=temperature, with_entropy=True,
                                             buckets=buckets)
            assert (got - want).abs().max() < 1e-5
            assert (got_h - want_h).abs().max() < 1e-5
            assert torch.equal(got == 0, packed.completion_mask == 0)  # 0 exactly on padding
    with torch.no_grad():
        logp, entropy = prefix_logprobs(model, shared, temperature=temperature)
    assert entropy is None and logp.shape == packed.completion_mask.shape


def test_entropy_is_a_detached_metric_and_logp_keeps_its_graph(tmp_path):
    """With grad on, both scorings return logp with a graph and the entropy without one: an entropy branch the
    loss never uses would keep its saved logits alive after the backward, under the next forward
    (issue 18)."""
    model, _ = model_and_knobs("llama-sdpa", "svd", tmp_path)
    prompts, completions, is_student, _ = rows()
    for fn, batch in ((forward_logprobs, pack(prompts, completions, PAD)),
                      (prefix_logprobs, pack_prefix(prompts, completions, PAD, is_student))):
        logp, entropy = fn(model, batch, with_entropy=True)
        assert logp.requires_grad and not entropy.requires_grad and entropy.grad_fn is None
        assert entropy[batch.completion_mask > 0].min() > 0  # a real entropy, not zeros


@pytest.mark.parametrize("buckets", [1, 3])
@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("name,ckpt", [("llama-sdpa", False), ("llama-sdpa", True), ("llama-eager", True)])
def test_knob_gradients_and_the_split_equal_the_packed_two_backward_oracle(name, ckpt, kind, buckets,
                                                                           tmp_path):
    model, knobs = model_and_knobs(name, kind, tmp_path, ckpt=ckpt)
    prompts, completions, is_student, adv = rows()
    packed, shared = pack(prompts, completions, PAD), pack_prefix(prompts, completions, PAD, is_student)

    loss = -adv * forward_logprobs(model, packed)[0].sum(1)  # (N,) GRPO-shaped, on the packed batch
    g_s, g_t = two_backward_split(knobs, loss[is_student].sum(), loss[~is_student].sum())  # the oracle

    for p in knobs.parameters():
        p.grad = None
    with knobs.capture(is_student) as cap:
        logp, _ = prefix_logprobs(model, shared, capture=cap, buckets=buckets)
        (-adv * logp.sum(1)).sum().backward()
    full = {n: g.clone() for n, g in knobs.grads("main").items()}
    assert max_rel(cap.g_student, g_s) < 1e-5
    assert max_rel(cap.g_teacher, g_t) < 1e-5
    assert max_rel(full, {n: g_s[n] + g_t[n] for n in g_s}) < 1e-5
    assert max_rel({n: cap.g_student[n] + cap.g_teacher[n] for n in full}, full) < 1e-6
    assert all(g.abs().max() > 0 for g in [*g_s.values(), *g_t.values()])  # both sources exercised


def test_all_student_batch_and_one_token_completions(tmp_path):
    # no teacher rows: one prefix row per prompt; all completions one token: no completion forward at all
    model, knobs = model_and_knobs("llama-sdpa", "svd", tmp_path)
    prompts = [[5, 6, 7]] * 3 + [[9, 8]] * 3
    completions = [[c] for c in (11, 12, 13, 14, 15, 16)]
    student = torch.ones(6, dtype=torch.bool)
    shared = pack_prefix(prompts, completions, PAD, student)
    assert shared.prefix_ids.shape[0] == 2
    adv = torch.linspace(-1, 1, 6)
    grads = {}
    for way, batch in (("packed", pack(prompts, completions, PAD)), ("prefix", shared)):
        for p in knobs.parameters():
            p.grad = None
        with knobs.capture(student) as cap:
            logp, _ = SCORINGS[way].logprobs(model, batch, capture=cap)
            (adv * logp.sum(1)).sum().backward()
        grads[way] = cap.g_student
    assert max_rel(grads["prefix"], grads["packed"]) < 1e-5


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.lists(st.tuples(st.integers(1, 5), st.booleans()),
                                                      min_size=1, max_size=4)), min_size=1, max_size=3),
       st.integers(0, 2**16), st.integers(1, 4))
def test_any_layout_scores_as_packed(groups, seed, buckets):
    # groups: (prompt length, [(completion length, is_student), ...]); prompts may repeat across groups
    model = _PROPERTY_MODEL
    g = torch.Generator().manual_seed(seed)
    prompts, completions, flags = [], [], []
    for p_len, members in groups:
        prompt = torch.randint(1, V, (p_len,), generator=g)
        for c_len, s in members:
            prompts.append(prompt)
            completions.append(torch.randint(1, V, (c_len,), generator=g))
            flags.append(s)
    with torch.no_grad():
        want, _ = forward_logprobs(model, pack(prompts, completions, PAD))
        got, _ = prefix_logprobs(model, pack_prefix(prompts, completions, PAD, flags), buckets=buckets)
    assert (got - want).abs().max() < 1e-5


torch.manual_seed(0)
_PROPERTY_MODEL = MODELS["llama-sdpa"]().eval()


# --- like-length buckets ----------------------------------------------------------------------------


def test_length_buckets_by_hand():
    # lengths [2, 9, 4, 10]; padding each bucket to its longest costs |bucket| * longest:
    # one bucket 4 * 10 = 40; two: {2, 4} + {9, 10} = 2 * 4 + 2 * 10 = 28 (the best split in two);
    # three: {2} + {4} + {9, 10} = 2 + 4 + 20 = 26 (against {2, 4} + {9} + {10} = 8 + 9 + 10 = 27)
    assert length_buckets([2, 9, 4, 10], 1) == [[0, 1, 2, 3]]
    assert length_buckets([2, 9, 4, 10], 2) == [[0, 2], [1, 3]]
    assert length_buckets([2, 9, 4, 10], 3) == [[0], [2], [1, 3]]
    assert length_buckets([5, 5, 5], 3) == [[0, 1, 2]]  # equal lengths: one bucket, nothing to save
    with pytest.raises(ValueError, match="k >= 1"):
        length_buckets([3], 0)


def _cost(lens, buckets) -> int:
    return sum(len(b) * max(lens[i] for i in b) for b in buckets)


def _brute(lens, k) -> int:
    """The least cost over every partition of the rows into at most k sets (any sets, not only runs)."""
    best = None

    def place(i, parts):
        nonlocal best
        if i == len(lens):
            c = _cost(lens, parts)
            best = c if best is None or c < best else best
            return
        for p in parts:
            p.append(i)
            place(i + 1, parts)
            p.pop()
        if len(parts) < k:
            place(i + 1, parts + [[i]])

    place(0, [])
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=7), st.integers(1, 4))
def test_length_buckets_partition_the_rows_at_the_least_padding(lens, k):
    got = length_buckets(lens, k)
    assert sorted(i for b in got for i in b) == list(range(len(lens)))  # every row once
    assert 1 <= len(got) <= k and all(b and b == sorted(b) for b in got)
    assert _cost(lens, got) == _brute(lens, k) <= len(lens) * max(lens)


# --- what the forward refuses, and when the packed one runs instead --------------------------------


def test_capture_must_match_the_batch_and_per_sequence_capture_refuses(tmp_path):
    model, knobs = model_and_knobs("llama-sdpa", "svd", tmp_path)
    prompts, completions, is_student, _ = rows()
    shared = pack_prefix(prompts, completions, PAD, is_student)
    with pytest.raises(ValueError, match="capture's is_student differs"):
        with knobs.capture(~is_student) as cap:
            prefix_logprobs(model, shared, capture=cap)
    with pytest.raises(RuntimeError, match="per-sequence gradients need one row per sequence"):
        with knobs.capture(is_student, per_sequence=True) as cap:
            prefix_logprobs(model, shared, capture=cap)
    with pytest.raises(ValueError, match="is_student has N=12 rows"):  # a capture not handed over
        with knobs.capture(is_student):
            prefix_logprobs(model, shared)


def test_sliding_window_models_fall_back_to_the_packed_forward(capsys):
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=4)).eval()
    assert supported(MODELS["llama-sdpa"]()) and supported(MODELS["gpt2"]()) and not supported(mistral)
    assert scoring(mistral, True).name == "packed"
    assert "scoring with the packed forward" in capsys.readouterr().err
    assert scoring(MODELS["llama-sdpa"](), False).name == "packed"
    assert scoring(MODELS["llama-sdpa"](), True).name == "prefix"
    assert scoring(MODELS["llama-sdpa"](), True, buckets=4).logprobs.keywords == {"buckets": 4}


# --- generate: each prompt's prefill once ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2"])
@pytest.mark.parametrize("kv_cache", ["preallocated", "dynamic"])
def test_shared_prefill_samples_the_same_ids(name, kv_cache):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # peaked distributions: ties and near-ties cannot flip a draw
    kw = dict(max_new_tokens=10, temperature=1.0, seed=5, eos_id=1, pad_id=PAD, kv_cache=kv_cache)
    want = generate(model, PROMPTS, 4, **kw)
    got = generate(model, PROMPTS, 4, share_prefill=True, **kw)
    assert all(map(torch.equal, got.completion_ids, want.completion_ids))
    assert all(map(torch.equal, got.prompt_ids, want.prompt_ids))
    assert max((a - b).abs().max().item() for a, b in zip(got.logp, want.logp)) < 1e-5
    assert torch.equal(got.truncated, want.truncated)
    # decoded under inference mode, returned as ordinary tensors: usable with autograd downstream
    assert not any(t.is_inference() for t in [*got.logp, got.truncated])
    one = generate(model, PROMPTS, 1, share_prefill=True, **kw)  # n_samples 1: the unshared path itself
    assert all(map(torch.equal, one.completion_ids, generate(model, PROMPTS, 1, **kw).completion_ids))
