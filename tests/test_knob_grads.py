"""Per-pair knob gradients: batched capture == isolated backward (both norms, both knob kinds, any chunking),
.grad untouched, non-finite NLL named, knobs off the graph refused.

Run: pytest tests/test_knob_grads.py
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import pair_grads_isolated
from torch import nn

from projected_grpo.hack.knob_grads import CHUNK_BYTES_CPU, MAX_CHUNK_TOKENS, chunk_tokens_for, pair_grads
from projected_grpo.hack.pairs import Pair
from projected_grpo.knobs.adapters import wrap

TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)


class ToyLM(nn.Module):
    """logits (N, L, V) = head(o_proj(emb[input_ids])); no mixing across positions, so hand-checkable."""

    def __init__(self, vocab: int = 12, d: int = 6):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb, self.o_proj, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return types.SimpleNamespace(logits=self.head(self.o_proj(self.emb(input_ids))))


def toy(tmp_path, kind="svd"):
    model = ToyLM()
    return model, wrap(model, kind=kind, targets=("o_proj",), rank=4 if kind == "lora" else None,
                       cache_dir=tmp_path)


def toy_pairs(n: int) -> list[Pair]:
    # lengths vary (prompt 1-2 tokens, hack 1-3, clean 1-2) so chunks pad
    return [Pair(f"p{i}", "h", "c", prompt_ids=(2 + i % 8,) * (1 + i % 2), hack_ids=(10,) * (1 + i % 3),
                 clean_ids=(11, 3)[: 1 + i % 2], source=f"t{i}") for i in range(n)]


def assert_grads_close(a, b):
    assert a[0].keys() == b[0].keys()
    for ga, gb in zip(a, b):
        for n in ga:
            torch.testing.assert_close(ga[n], gb[n], atol=1e-6, rtol=1e-4)


def test_hand_computed_norms_and_oracle_backward(tmp_path):
    model, knobs = toy(tmp_path)
    pairs = [Pair("p", "h", "c", prompt_ids=(2, 3), hack_ids=(4, 5, 6), clean_ids=(7,))]
    g_mean, _ = pair_grads(model, knobs, TOK, pairs, "mean")
    g_const, _ = pair_grads(model, knobs, TOK, pairs, "constant", nll_const=4.0)
    # hack has T = 3 tokens: mean = sum / 3, constant = sum / 4  =>  4 * g_const = 3 * g_mean
    torch.testing.assert_close(4 * g_const["o_proj"], 3 * g_mean["o_proj"])
    # oracle: an ordinary backward of the summed token NLL at positions 1..3 (they predict 4, 5, 6), / 3
    logits = model(torch.tensor([[2, 3, 4, 5, 6]])).logits[0]
    (-torch.log_softmax(logits, -1)[[1, 2, 3], [4, 5, 6]].sum() / 3).backward()
    torch.testing.assert_close(g_mean["o_proj"][0], knobs.grads("main")["o_proj"])


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 9), st.integers(1, 200), st.sampled_from(["mean", "constant"]),
       st.sampled_from(["svd", "lora"]))
def test_batched_equals_isolated_for_any_chunking(tmp_path_factory, chunk_size, chunk_tokens, norm, kind):
    model, knobs = toy(tmp_path_factory.mktemp("svd"), kind)
    with torch.no_grad():  # mid-training knob values, quarantine included: the gradient is taken there
        for p in knobs.parameters() + knobs.hack_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pairs = toy_pairs(7)
    assert_grads_close(pair_grads(model, knobs, TOK, pairs, norm, 2.5, chunk_size=chunk_size,
                                  chunk_tokens=chunk_tokens),
                       pair_grads_isolated(model, knobs, TOK, pairs, norm, 2.5))


def test_chunks_respect_both_budgets():
    from projected_grpo.hack.knob_grads import _chunks

    # lengths sorted ascending: 3, 3, 5, 9, 20; budget 2 sequences, 10 padded tokens (longest x count)
    # [0, 1]: 3 x 2 = 6 fits; 2 starts a chunk (a third would break max_seqs); 3: 9 x 2 = 18 > 10 alone;
    # 4: 20 > 10, alone anyway (one sequence at least)
    assert _chunks([0, 1, 2, 3, 4], [3, 3, 5, 9, 20], 2, 10) == [[0, 1], [2], [3], [4]]
    assert _chunks([0, 1, 2], [4, 4, 4], 8, 100) == [[0, 1, 2]]


def test_grads_are_left_untouched(tmp_path):
    # the online V refresh (train.py) runs after the step's backward: whatever .grad holds must survive
    model, knobs = toy(tmp_path)
    params = knobs.parameters() + knobs.hack_parameters()
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 7.0 + i)
    pair_grads(model, knobs, TOK, toy_pairs(4), chunk_size=3)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0 + i)) for i, p in enumerate(params))


@pytest.mark.parametrize("fn", [pair_grads, pair_grads_isolated])
def test_nonfinite_nll_names_the_pair_and_label(tmp_path, fn):
    model, knobs = toy(tmp_path)
    with torch.no_grad():
        model.emb.weight[9] = float("nan")
    # token 9 only in pair 3's clean completion (as a predicting position: completion (9, 3))
    pairs = toy_pairs(3) + [Pair("p", "h", "c", prompt_ids=(2,), hack_ids=(10,), clean_ids=(9, 3),
                                 source="bad")]
    with pytest.raises(FloatingPointError, match=r"pair 3 \(bad\), clean completion"):
        fn(model, knobs, TOK, pairs)


def test_knobs_off_the_graph_and_bad_arguments_are_refused(tmp_path):
    model, knobs = toy(tmp_path)
    with knobs.zeroed(), pytest.raises(RuntimeError, match="not on the graph"):
        pair_grads(model, knobs, TOK, toy_pairs(2))
    with pytest.raises(ValueError, match="chunk_size"):
        pair_grads(model, knobs, TOK, toy_pairs(2), chunk_size=0)
    with pytest.raises(ValueError, match="no pairs"):
        pair_grads(model, knobs, TOK, [])


# --- the real smoke model (Llama, left-padded batches), real knobs, built-in pairs -----------------


@pytest.fixture(scope="module")
def smoke():
    from projected_grpo.envs.coding.env import CodeEnv
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.hack.pairs import builtin_pairs
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    torch.set_num_threads(1)
    _, tok = smoke_model_and_tokenizer()
    return tok, builtin_pairs(CodeEnv(BUILTIN_PROBLEMS), BUILTIN_PROBLEMS[:4], per_problem=2)


def smoke_model(tok):
    from projected_grpo.organism.build import tiny_model

    return tiny_model(tok, hidden=32, layers=2, heads=2, seed=0)


@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("norm", ["mean", "constant"])
def test_smoke_model_batched_equals_isolated(smoke, tmp_path, kind, norm):
    tok, pairs = smoke
    model = smoke_model(tok)
    knobs = wrap(model, kind=kind, cache_dir=tmp_path)
    # chunk_size 5: chunks mix pairs, labels and lengths, so prompts are left-padded by varying amounts
    batched = pair_grads(model, knobs, tok, pairs, norm, 64.0, chunk_size=5)
    assert_grads_close(batched, pair_grads_isolated(model, knobs, tok, pairs, norm, 64.0))
    assert batched[0].keys() == set(knobs.modules)
    assert all(g.shape == (len(pairs), knobs.modules[n].knob_dim) for n, g in batched[0].items())


def test_smoke_model_matches_an_ordinary_backward(smoke, tmp_path):
    # oracle independent of this module: one pair, one .backward() on the mean completion NLL
    from projected_grpo.hack.pairs import encode_pair
    from projected_grpo.sampling.pack import pack
    from projected_grpo.sampling.score import forward_logprobs

    tok, pairs = smoke
    model = smoke_model(tok)
    knobs = wrap(model, kind="svd", cache_dir=tmp_path)
    g_hack, _ = pair_grads(model, knobs, tok, pairs[:3])
    prompt_ids, hack_ids, _ = encode_pair(tok, pairs[0])
    batch = pack([prompt_ids], [hack_ids], tok.pad_token_id)
    logp, _ = forward_logprobs(model, batch)
    (-(logp.sum() / batch.completion_mask.sum())).backward()
    for n, g in knobs.grads("main").items():
        torch.testing.assert_close(g_hack[n][0], g.float(), atol=1e-6, rtol=1e-4)


def test_repeated_sequences_are_computed_once(tmp_path, monkeypatch):
    # the controls reuse the real pairs' completions: pairs 0-3 repeated three times give the same rows,
    # from one forward per distinct (prompt, completion): 4 pairs x 2 labels = 8 sequences, not 24
    from projected_grpo.hack import knob_grads

    model, knobs = toy(tmp_path)
    packed = []
    real_pack = knob_grads.pack
    monkeypatch.setattr(knob_grads, "pack", lambda p, c, pad: packed.append(len(p)) or real_pack(p, c, pad))
    once = pair_grads(model, knobs, TOK, toy_pairs(4))
    n_once = sum(packed)
    thrice = pair_grads(model, knobs, TOK, toy_pairs(4) * 3)
    assert n_once == 8 and sum(packed) - n_once == 8
    for a, b in zip(once, thrice):
        for n in a:
            assert torch.equal(b[n], a[n].repeat(3, 1))


def test_chunk_tokens_by_the_models_sizes():
    def model(**sizes):
        m = nn.Linear(1, 1)
        m.config = types.SimpleNamespace(**sizes)
        return m

    # SmolLM2-135M: 4 B x (4 x 49152 vocab + 30 layers x (10 x 576 hidden + 5 x 1536 MLP)) = 4 x 599808 =
    # 2,399,232 B a token; 2.5e9 // 2,399,232 = 1042 tokens a chunk
    assert CHUNK_BYTES_CPU == 2.5e9
    assert chunk_tokens_for(model(hidden_size=576, num_hidden_layers=30, vocab_size=49152,
                                  intermediate_size=1536)) == 1042
    # the organism (96 hidden, 3 layers, 1024 vocab): 4 x (4096 + 3 x (960 + 1920)) = 50,944 B a token: max
    assert chunk_tokens_for(model(hidden_size=96, num_hidden_layers=3, vocab_size=1024,
                                  intermediate_size=384)) == MAX_CHUNK_TOKENS == 4096
    assert chunk_tokens_for(ToyLM()) == MAX_CHUNK_TOKENS  # no config to size it by
