"""sampling/: packing by hand, encode helpers, seeded batched generation, scoring forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from projected_grpo.envs.base import Graded
from projected_grpo.sampling.generate import Rollout, generate, step_seed
from projected_grpo.sampling.kv_cache import cache_of, with_cache
from projected_grpo.sampling.pack import (
    SeqBatch,
    encode_completion,
    encode_prompt,
    left_pad,
    pack,
    pad_right,
    position_ids_from_mask,
)
from projected_grpo.sampling.sample import sample_and_grade
from projected_grpo.sampling.samplers import SAMPLERS
from projected_grpo.sampling.score import accepts_logits_to_keep, forward_logprobs

WORDS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "hello", "world", "a", "b", "c"]
PAD, EOS = 0, 1
V = 32


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return tok


# Llama (RoPE: relative, so blind to a constant position shift) and GPT-2 (absolute positions: a
# left-padded row scored at the wrong positions changes its logits, which the batched tests catch)
@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    torch.manual_seed(0)
    if request.param == "llama":
        m = LlamaForCausalLM(LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=2,
            eos_token_id=EOS))
    else:
        m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS,
                                       tie_word_embeddings=False))
    m = m.eval()
    with torch.no_grad():  # a random init is nearly uniform; sharpen it so greedy ties cannot happen
        m.lm_head.weight.mul_(20.0)
    return m


PROMPTS = [[3, 5, 6, 4], [7, 4], [8, 9, 10, 11, 12, 4]]


def lists(rows) -> list[list[int]]:
    """A Rollout's id tensors as int lists, to compare whole rollouts with ==."""
    return [r.tolist() for r in rows]


# --- ids ---------------------------------------------------------------------------------------


def test_encode_prompt_and_completion(tokenizer):
    # "<|user|> hello world <|assistant|> " -> [3, 5, 6, 4]
    assert encode_prompt(tokenizer, [{"role": "user", "content": "hello world"}]) == [3, 5, 6, 4]
    assert encode_completion(tokenizer, "a b c") == [7, 8, 9, EOS]
    assert encode_completion(tokenizer, "a b c", eos=False) == [7, 8, 9]


def test_encode_prompt_without_template_fails_clearly(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>")
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(bare, [{"role": "user", "content": "hello"}])


# --- packing -----------------------------------------------------------------------------------


def test_pack_by_hand():
    b = pack([[1, 2], [3]], [[4], [5, 6, 7]], pad_id=0)
    # P = 2 (longest prompt), T = 3 (longest completion), L = 5
    # row 0: prompt [1, 2] (no left pad) + completion [4] + 2 right pads
    # row 1: 1 left pad + prompt [3] + completion [5, 6, 7]
    assert b.input_ids.tolist() == [[1, 2, 4, 0, 0], [0, 3, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert b.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert b.T == 3


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack([[1], [2]], [[3]], 0)
    with pytest.raises(ValueError, match="row 1 has an empty completion"):
        pack([[1], [2]], [[3], []], 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 50), min_size=1, max_size=6),
                          st.lists(st.integers(1, 50), min_size=1, max_size=6)), min_size=1, max_size=5))
def test_pack_invariants(rows):
    b = pack([p for p, _ in rows], [c for _, c in rows], pad_id=0)
    for i, (p, c) in enumerate(rows):
        # the attended tokens, read left to right, are exactly prompt + completion
        assert b.input_ids[i][b.attention_mask[i] == 1].tolist() == p + c
        # the completion starts at the first of the last T columns
        assert b.input_ids[i, -b.T:][: len(c)].tolist() == c
        assert int(b.completion_mask[i].sum()) == len(c)
    assert isinstance(b, SeqBatch) and b.input_ids.shape[1] == b.attention_mask.shape[1]
    # 1-D long tensors (what the library passes) pack bit for bit as the int lists do
    t = pack([torch.tensor(p) for p, _ in rows], [torch.tensor(c) for _, c in rows], pad_id=0)
    assert all(torch.equal(getattr(t, f), getattr(b, f)) for f in ("input_ids", "attention_mask",
                                                                      "completion_mask"))
    assert all(torch.equal(x, y) for x, y in zip(left_pad([torch.tensor(p) for p, _ in rows], 6, 0),
                                                 left_pad([p for p, _ in rows], 6, 0)))


def test_pad_right():
    # rows of 2 and 1 values in a T = 3 batch: zeros after each row's own length
    assert pad_right([[-1.0, -2.0], torch.tensor([-3.0])], 3).tolist() == [[-1, -2, 0], [-3, 0, 0]]
    with pytest.raises(ValueError, match="row 0 has 2 values"):
        pad_right([[1.0, 2.0]], 1)


# --- seeds -------------------------------------------------------------------------------------


def test_step_seed_is_stable_and_distinct():
    # pinned value: blake2b(b"[7, 3, 1]", digest 8 bytes) little-endian, top bit cleared; any change in the
    # derivation would silently change every sampled rollout of a resumed or re-run experiment
    assert step_seed(7, 3, 1) == step_seed(7, 3, 1) == 2827358601700184505
    seeds = {step_seed(0, s, g) for s in range(20) for g in range(5)}
    assert len(seeds) == 100 and all(0 <= x < 2**63 for x in seeds)
    assert step_seed(0, 1, "teacher") != step_seed(0, 1, "student")


# --- generation --------------------------------------------------------------------------------


def test_generate_is_seeded_and_leaves_global_rng_alone(model):
    before = torch.get_rng_state()
    kw = dict(max_new_tokens=6, temperature=1.0, eos_id=EOS, pad_id=PAD)
    a = generate(model, PROMPTS, 4, seed=11, **kw)
    b = generate(model, PROMPTS, 4, seed=11, **kw)
    c = generate(model, PROMPTS, 4, seed=12, **kw)
    assert lists(a.completion_ids) == lists(b.completion_ids)
    assert all(torch.equal(x, y) for x, y in zip(a.logp, b.logp))
    assert lists(a.completion_ids) != lists(c.completion_ids)
    assert torch.equal(torch.get_rng_state(), before)
    # prompt-major rows: row b * n_samples + g belongs to prompt b
    assert lists(a.prompt_ids) == [p for p in PROMPTS for _ in range(4)]


def test_rollout_ids_are_long_cpu_tensors_and_a_prompt_is_one_tensor(model):
    given = [torch.tensor(p) for p in PROMPTS]
    ro = generate(model, given, 2, max_new_tokens=4, seed=0, eos_id=EOS, pad_id=PAD)
    for t in (*ro.prompt_ids, *ro.completion_ids):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 1
        assert t.device.type == "cpu"
    # a prompt given as a tensor is carried as that very tensor by each of its rows (nothing copies it)
    assert all(ro.prompt_ids[2 * b] is ro.prompt_ids[2 * b + 1] is given[b] for b in range(len(PROMPTS)))
    # each completion owns its storage (not a view of the decode's buffer)
    assert all(c.untyped_storage().nbytes() == c.numel() * 8 for c in ro.completion_ids)
    with_lists = generate(model, PROMPTS, 2, max_new_tokens=4, seed=0, eos_id=EOS, pad_id=PAD)
    assert lists(with_lists.completion_ids) == lists(ro.completion_ids)
    with pytest.raises(ValueError, match="1-D"):
        generate(model, [torch.tensor([PROMPTS[0]])], 1, max_new_tokens=2, seed=0, eos_id=EOS, pad_id=PAD)


def test_sample_and_grade_samples_carry_the_prompt_tensor_and_long_completions(model):
    class Tok:  # decodes what it is given, as a tokenizer would (int lists)
        eos_token_id, pad_token_id = EOS, PAD

        def batch_decode(self, rows, skip_special_tokens):
            assert all(type(r) is list and all(type(t) is int for t in r) for r in rows)
            return [" ".join(map(str, r)) for r in rows]

    class Env:
        def grade(self, texts, owners):
            return [Graded(0.0, 0.0, False, False, False, True) for _ in texts]

    probs = [SimpleNamespace(id=f"p{b}", mode="m") for b in range(len(PROMPTS))]
    table = {p.id: torch.tensor(ids) for p, ids in zip(probs, PROMPTS)}
    got = sample_and_grade(model, Tok(), Env(), probs, table, 3, max_new_tokens=4, seed=5)
    ro = generate(model, PROMPTS, 3, max_new_tokens=4, seed=5, eos_id=EOS, pad_id=PAD)
    for i, s in enumerate(got):
        assert s.prompt_ids is table[s.problem_id]  # the table's tensor itself, shared by the group
        assert s.completion_ids.dtype == torch.long and s.completion_ids.dim() == 1
        assert torch.equal(s.completion_ids, ro.completion_ids[i]) and s.text == " ".join(
            map(str, ro.completion_ids[i].tolist()))


def test_generate_stops_at_eos_and_flags_truncation(model):
    free = generate(model, PROMPTS, 1, max_new_tokens=8, temperature=0, seed=0, eos_id=[], pad_id=PAD)
    assert free.truncated.all() and all(len(c) == 8 for c in free.completion_ids)
    eos = int(free.completion_ids[0][2])  # make row 0's third greedy token the EOS
    first = free.completion_ids[0].tolist().index(eos)
    out = generate(model, PROMPTS, 1, max_new_tokens=8, temperature=0, seed=0, eos_id=eos, pad_id=PAD)
    for row_free, row, trunc in zip(lists(free.completion_ids), lists(out.completion_ids),
                                    out.truncated.tolist()):
        if eos in row_free:  # stops at the first EOS, includes it, nothing after it
            assert row == row_free[: row_free.index(eos) + 1] and not trunc
        else:
            assert row == row_free and trunc
    assert len(out.completion_ids[0]) == first + 1 <= 3


def test_sampled_rows_end_at_eos_or_are_truncated(model):
    out = generate(model, PROMPTS, 8, max_new_tokens=5, temperature=1.5, seed=3, eos_id=[EOS, 7], pad_id=PAD)
    for row, trunc in zip(lists(out.completion_ids), out.truncated.tolist()):
        eos_at = [i for i, t in enumerate(row) if t in (EOS, 7)]
        assert eos_at == ([] if trunc else [len(row) - 1])
        assert trunc == (len(row) == 5 and not eos_at)
    assert any(not t for t in out.truncated.tolist()) and any(out.truncated.tolist())


def test_batched_greedy_equals_one_by_one_and_hf_generate(model):
    batched = generate(model, PROMPTS, 2, max_new_tokens=6, temperature=0, seed=0, eos_id=EOS, pad_id=PAD)
    for b, p in enumerate(PROMPTS):
        alone = generate(model, [p], 1, max_new_tokens=6, temperature=0, seed=0, eos_id=EOS, pad_id=PAD)
        row = alone.completion_ids[0].tolist()
        assert batched.completion_ids[2 * b].tolist() == batched.completion_ids[2 * b + 1].tolist() == row
        torch.testing.assert_close(batched.logp[2 * b], alone.logp[0], atol=1e-5, rtol=1e-5)
        hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            do_sample=False, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
        assert hf[0, len(p):].tolist()[: len(row)] == row


def test_tiny_top_p_is_greedy(model):
    # nucleus with top_p -> 0 keeps only the most likely token, whatever the seed
    greedy = generate(model, PROMPTS, 1, max_new_tokens=5, temperature=0, seed=0, eos_id=EOS, pad_id=PAD)
    nucleus = generate(model, PROMPTS, 1, max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=5,
                       eos_id=EOS, pad_id=PAD)
    assert lists(nucleus.completion_ids) == lists(greedy.completion_ids)


def test_behaviour_logp_matches_scoring_forward(model):
    # the log-probs recorded while sampling at temperature 0.7 are the ones a forward pass computes
    out = generate(model, PROMPTS, 3, max_new_tokens=6, temperature=0.7, seed=9, eos_id=EOS, pad_id=PAD)
    batch = out.batch(PAD)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, batch, temperature=0.7)
    torch.testing.assert_close(logp, pad_right(out.logp, batch.T), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def generate_before(model, prompt_ids, n_samples, *, max_new_tokens, temperature=1.0, top_p=1.0, seed,
                    eos_id, pad_id):
    """generate's decode loop before the preallocated KV cache and mask (commit e500c43), verbatim but for
    the argument checks, its ids returned as tensors and the sampler's uniforms drawn here (as the sampler
    drew them then): the oracle that pins the sampled stream (same ids, same log-probs, bit for bit), with
    every row decoded to the end (no row retired)."""
    pick = SAMPLERS["greedy" if temperature == 0 else "sample"]
    device = next(model.parameters()).device
    eos = torch.as_tensor(eos_id, dtype=torch.long, device=device).reshape(-1)
    rows = [list(p) for p in prompt_ids for _ in range(n_samples)]
    N = len(rows)
    ids, mask = left_pad(rows, max(len(r) for r in rows), pad_id)
    pos = position_ids_from_mask(mask)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    toks = torch.full((N, max_new_tokens), pad_id, dtype=torch.long)
    logps = torch.zeros((N, max_new_tokens), dtype=torch.float32)
    lens = torch.full((N,), max_new_tokens, dtype=torch.long)
    done = torch.zeros(N, dtype=torch.bool)
    cache, cur = None, ids
    for t in range(max_new_tokens):
        out = model(input_ids=cur, attention_mask=mask, position_ids=pos, use_cache=True,
                    **with_cache(model, cache), **keep)
        cache = cache_of(out)
        u = torch.rand((N, 1), dtype=torch.float64, generator=gen)  # the sampler's draw (its caller's now)
        tok, lp = pick(out.logits[:, -1].float(), temperature, top_p, u)
        tok = tok.masked_fill(done, pad_id)
        toks[:, t], logps[:, t] = tok, lp
        hit = ~done & torch.isin(tok, eos)
        lens[hit] = t + 1
        done |= hit
        if bool(done.all()):
            break
        cur = tok[:, None]
        mask = torch.cat([mask, torch.ones((N, 1), dtype=mask.dtype)], 1)
        pos = pos[:, -1:] + 1
    return Rollout(prompt_ids=[torch.tensor(r) for r in rows],
                   completion_ids=[toks[i, :lens[i]].clone() for i in range(N)],
                   logp=[logps[i, :lens[i]].clone() for i in range(N)], truncated=~done)


@pytest.mark.parametrize("retire", [True, False])
@pytest.mark.parametrize("kv_cache", ["preallocated", "dynamic"])
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                     dict(temperature=0), dict(temperature=1.5, eos_id=[EOS, 7, 8])])
def test_generate_keeps_the_sampled_stream_of_the_previous_loop(model, kv_cache, setting, retire):
    kw = {"max_new_tokens": 12, "seed": 21, "eos_id": EOS, "pad_id": PAD, **setting}
    want = generate_before(model, PROMPTS, 5, **kw)
    got = generate(model, PROMPTS, 5, kv_cache=kv_cache, retire=retire, **kw)
    assert lists(got.completion_ids) == lists(want.completion_ids)
    if retire:  # later steps on fewer rows: bit for bit only where a row rounds alike at any batch size
        for a, b in zip(got.logp, want.logp):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:
        assert all(torch.equal(a, b) for a, b in zip(got.logp, want.logp))  # bit for bit, not just close
    assert torch.equal(got.truncated, want.truncated) and lists(got.prompt_ids) == lists(want.prompt_ids)
    if "eos_id" in setting:  # rows stop at different steps: the cache and mask views are exercised
        assert len({len(c) for c in got.completion_ids}) > 1


def test_generate_rejects_unknown_kv_cache(model):
    with pytest.raises(ValueError, match="unknown kv_cache 'static'"):
        generate(model, PROMPTS, 1, max_new_tokens=2, seed=0, eos_id=EOS, pad_id=PAD, kv_cache="static")


# --- scoring -----------------------------------------------------------------------------------


def test_forward_logprobs_equals_naive_unpadded(model):
    prompts, completions = [[3, 5, 6, 4], [7, 4]], [[8, 9], [10, 11, 12, EOS]]
    batch = pack(prompts, completions, PAD)
    logp, ent = forward_logprobs(model, batch, temperature=1.3, with_entropy=True)
    assert logp.shape == ent.shape == (2, 4)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        with torch.no_grad():  # naive: one unpadded row, full log_softmax, gather the completion tokens
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1: -1] / 1.3  # (len(c), V)
        full = torch.log_softmax(logits, -1)
        torch.testing.assert_close(logp[i, : len(c)], full.gather(-1, torch.tensor(c)[:, None])[:, 0],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[i, : len(c)], -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)
        assert (logp[i, len(c):] == 0).all() and (ent[i, len(c):] == 0).all()
    logp.sum().backward()  # differentiable through the model
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_missing_special_ids_fail_clearly(model, tokenizer):
    with pytest.raises(ValueError, match="eos_id=None"):
        generate(model, PROMPTS, 1, max_new_tokens=2, seed=0, eos_id=None, pad_id=PAD)
    with pytest.raises(ValueError, match="pad_id is None"):
        pack([[1]], [[2]], None)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, PROMPTS, 1, max_new_tokens=2, temperature=-1.0, seed=0, eos_id=EOS, pad_id=PAD)
    no_eos = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="has no eos_token_id"):
        encode_completion(no_eos, "a b")


def test_nucleus_by_hand():
    # p = [0.5, 0.3, 0.2], top_p = 0.7: mass before each sorted token is [0, 0.5, 0.8]; 0.8 >= 0.7 drops
    # token 2, so draws come from {0, 1} with odds 5:3; the logp reported is that of the distribution
    # drawn from: log(0.5 / 0.8) = log 0.625 and log(0.3 / 0.8) = log 0.375
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(4000, 3)
    u = torch.rand((4000, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tok, lp = SAMPLERS["sample"](logits, 1.0, 0.7, u)
    counts = torch.bincount(tok, minlength=3)
    assert counts[2] == 0 and abs(float(counts[0]) / 4000 - 0.625) < 0.03
    torch.testing.assert_close(lp, torch.tensor([0.625, 0.375, 1.0]).log()[tok])
    # greedy: the argmax with probability 1, log 1 = 0
    tok, lp = SAMPLERS["greedy"](logits[:2], 0.0, 1.0, u[:2])
    assert tok.tolist() == [0, 0] and lp.tolist() == [0.0, 0.0]
