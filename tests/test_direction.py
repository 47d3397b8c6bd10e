"""V_hack extraction: planted-direction recovery, orientation, tau_axis, noise floor, storage, cache, CLI.
The per-pair gradients themselves: tests/test_knob_grads.py.

Run: pytest tests/test_direction.py
"""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from projected_grpo.hack.direction import (
    Direction,
    DirectionFileError,
    ExtractSettings,
    cache_meta,
    directions_from_grads,
    extract_direction,
    heldout_score,
    load_direction,
    postprocess,
    random_like,
    resolve,
    save_direction,
    top_directions,
)
from projected_grpo.hack.pairs import Pair

# --- planted direction, pure functions -----------------------------------------------------------


def S(**kw) -> ExtractSettings:
    """ExtractSettings with the ProjCfg defaults (the record itself has none: one name per setting)."""
    return ExtractSettings(**({"k": 4, "tau_axis": 0.0, "n_heldout": 4, "nll_norm": "mean", "nll_const": 1.0,
                               "control": "none", "seed": 0} | kw))


def planted_grads(seed: int, P: int = 40, R: int = 32, noise: float = 0.2):
    """g_hack = base + noise + a * v_true, g_clean = base + noise: D = a * v_true + noise (a in [1, 2])."""
    gen = torch.Generator().manual_seed(seed)
    v_true = torch.randn(R, generator=gen)
    v_true /= v_true.norm()
    base = 5 * torch.randn(P, R, generator=gen)  # prompt-specific part, shared by both labels: cancels
    a = 1 + torch.rand(P, 1, generator=gen)
    g_hack = base + noise * torch.randn(P, R, generator=gen) + a * v_true
    g_clean = base + noise * torch.randn(P, R, generator=gen)
    return {"m": g_hack}, {"m": g_clean}, v_true


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_planted_direction_recovered_with_hackward_sign(seed):
    g_hack, g_clean, v_true = planted_grads(seed)
    V, S, stats = directions_from_grads(g_hack, g_clean, k=3, n_heldout=8)
    assert torch.dot(V["m"][0], v_true) > 0.9  # |cos| > 0.9 AND positive: +v points hack-ward
    assert stats["heldout"]["m"] == 1.0  # every held-out difference projects positively on v1
    # swapping the labels flips the sign of every kept axis
    V_sw, S_sw, _ = directions_from_grads(g_clean, g_hack, k=3, n_heldout=8)
    assert torch.dot(V_sw["m"][0], v_true) < -0.9
    torch.testing.assert_close(S_sw["m"], S["m"])


def test_shuffled_labels_keep_the_subspace_and_randomise_only_orientation():
    # DᵀD = Σ d_i d_iᵀ does not see a row's sign, so the `shuffled` control (labels swapped per pair)
    # has exactly the real S and span(V); only the vote-chosen orientations change. Under the one-sided
    # gate it is therefore a control for orientation, not for the subspace.
    g_hack, g_clean, _ = planted_grads(0)
    flip = torch.rand(40, generator=torch.Generator().manual_seed(1)) < 0.5
    sh = {"m": torch.where(flip[:, None], g_clean["m"], g_hack["m"])}
    sc = {"m": torch.where(flip[:, None], g_hack["m"], g_clean["m"])}
    V, S, _ = directions_from_grads(g_hack, g_clean, k=3)
    V_sh, S_sh, _ = directions_from_grads(sh, sc, k=3)
    torch.testing.assert_close(S_sh["m"], S["m"])
    torch.testing.assert_close((V_sh["m"] @ V["m"].T).abs(), torch.eye(3), atol=1e-4, rtol=0)


def test_orientation_is_majority_vote_not_mean():
    # D rows project on e1 as 1, 1, -3: two of three pairs vote +, the mean (-1/3) would say -.
    D = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-3.0, 0.0]])
    V, S, stats = top_directions(D, k=1)
    torch.testing.assert_close(V, torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(S, torch.tensor([11.0]).sqrt())  # sqrt(1 + 1 + 9)
    assert stats["votes_pos"] == [2]


def test_orientation_tie_keeps_plus_one():
    # projections 2 and -2: a 1-1 tie, so the axis keeps the sign the SVD returned (vote +1)
    D = torch.tensor([[2.0, 0.0], [-2.0, 0.0]])
    _, _, Vh = torch.linalg.svd(D, full_matrices=False)
    V, _, _ = top_directions(D, k=1)
    torch.testing.assert_close(V, Vh[:1])


def test_tau_axis_drops_exactly_the_weak_axes():
    # D = diag(4, 2, 1) -> S = [4, 2, 1], S/S0 = [1, 0.5, 0.25]
    D = torch.diag(torch.tensor([4.0, 2.0, 1.0]))
    for tau, kept in [(0.0, 3), (0.25, 3), (0.3, 2), (0.5, 2), (0.51, 1), (1.0, 1)]:
        V, S, stats = top_directions(D, k=3, tau_axis=tau)
        assert V.shape == (kept, 3) and stats["k_kept"] == kept, tau
        torch.testing.assert_close(S, torch.tensor([4.0, 2.0, 1.0])[:kept])
        torch.testing.assert_close(V @ V.T, torch.eye(kept))  # dropped, not zeroed: still orthonormal


def test_rank_deficient_D_keeps_only_real_axes_and_zero_D_keeps_none():
    D = torch.tensor([[1.0, 2.0, 0.0]] * 3)  # rank 1: axes 2, 3 would be arbitrary null-space directions
    V, S, _ = top_directions(D, k=3)
    assert V.shape == (1, 3)
    V0, S0, st0 = top_directions(torch.zeros(4, 3), k=2)
    assert V0.shape == (0, 3) and S0.shape == (0,) and st0["k_kept"] == 0


def test_heldout_score_hand_computed():
    # projections on v1 = e1: 1, -1, 2, 0 -> positive: 2 of 4
    D_h = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    assert heldout_score(D_h, torch.tensor([1.0, 0.0])) == 0.5


def test_nonfinite_D_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        top_directions(torch.tensor([[float("nan"), 0.0]]), k=1)


def _orthonormal(K: int, R: int, seed: int) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(R, K, generator=torch.Generator().manual_seed(seed)))
    return Q.T.contiguous()


def test_noise_floor_and_k_use_hand_computed():
    S = {"a": torch.tensor([4.0, 3.0, 1.0]), "b": torch.tensor([2.0, 0.5])}
    V = {"a": _orthonormal(3, 5, 0), "b": _orthonormal(2, 5, 1)}
    # pooled sorted [0.5, 1, 2, 3, 4]; quantile q at position q * 4 (linear interpolation)
    out, rep = postprocess(V, S, drop_bottom_frac=0.25)  # position 1 -> 1.0; 0.5 < 1.0 dropped, 1.0 kept
    assert rep["threshold"] == 1.0 and rep["dropped_rows"] == {"a": 0, "b": 1} and rep["kept_rows"] == 4
    torch.testing.assert_close(out["b"], V["b"][:1])
    out, rep = postprocess(V, S, drop_bottom_frac=0.5)  # position 2 -> 2.0: a keeps [4, 3], b keeps [2]
    assert rep["dropped_rows"] == {"a": 1, "b": 1}
    assert {n: v.shape[0] for n, v in out.items()} == {"a": 2, "b": 1}
    out, rep = postprocess(V, S, drop_bottom_frac=0.8)  # position 3.2 -> 3 + 0.2 * (4 - 3) = 3.2: only a's 4
    assert abs(rep["threshold"] - 3.2) < 1e-6 and list(out) == ["a"] and out["a"].shape[0] == 1
    assert rep["dropped_modules"] == ["b"]
    # k_use slices first, the floor is still over all stored S (1.0 at 0.25): a [4], b [2]
    out, rep = postprocess(V, S, k_use=1, drop_bottom_frac=0.25)
    assert {n: v.shape[0] for n, v in out.items()} == {"a": 1, "b": 1}
    assert rep["dropped_rows"] == {"a": 2, "b": 1}
    out, rep = postprocess(V, S)  # no k_use, no floor: identity
    assert rep["threshold"] is None and all(torch.equal(out[n], V[n]) for n in V)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(0.01, 100), min_size=1, max_size=5), min_size=1, max_size=5),
       st.floats(0, 0.95), st.one_of(st.none(), st.integers(1, 5)))
def test_noise_floor_keeps_exactly_the_rows_at_or_above_the_threshold(svals, frac, k_use):
    S = {f"m{i}": torch.tensor(sorted(sv, reverse=True)) for i, sv in enumerate(svals)}
    V = {n: _orthonormal(len(s), 8, i) for i, (n, s) in enumerate(S.items())}
    out, rep = postprocess(V, S, k_use, frac)
    thresh = rep["threshold"] if rep["threshold"] is not None else float("-inf")
    for n in S:
        want = int((S[n][:k_use] >= thresh).sum())
        assert (out[n].shape[0] if n in out else 0) == want and (n in rep["dropped_modules"]) == (want == 0)
        if want:
            assert torch.equal(out[n], V[n][:want])  # S descending: the kept rows are the leading ones


def test_random_control_same_shapes_orthonormal_seeded():
    V = {"a": _orthonormal(3, 8, 0), "b": _orthonormal(1, 4, 1), "c": torch.zeros(0, 6)}
    R1, R2, R3 = random_like(V, 0), random_like(V, 0), random_like(V, 1)
    for n in V:
        assert R1[n].shape == V[n].shape
        torch.testing.assert_close(R1[n] @ R1[n].T, torch.eye(V[n].shape[0]))
        assert torch.equal(R1[n], R2[n])
    assert not torch.equal(R1["a"], R3["a"])


def test_settings_validate():
    with pytest.raises(ValueError, match="tau_axis"):
        S(tau_axis=1.5)
    with pytest.raises(ValueError, match="control"):
        S(control="bogus")
    with pytest.raises(ValueError, match="norm"):
        S(nll_norm="sum")


# --- a toy model: logits depend only on the current token, one SVD-knobbed Linear -------------------


class ToyLM(nn.Module):
    """logits (N, L, V) = head(o_proj(emb[input_ids])); no mixing across positions."""

    def __init__(self, vocab: int = 12, d: int = 6, seed: int = 0, jitter: float = 0.05):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            x_bar = torch.randn(d, generator=gen)
            # prompt tokens 2.. share one embedding up to a small jitter: the knob gradient difference of
            # a single-token hack vs clean completion is then nearly the same for every pair (planted)
            self.emb.weight.copy_(x_bar + jitter * torch.randn(vocab, d, generator=gen))
            self.o_proj.weight.copy_(torch.randn(d, d, generator=gen))
            self.head.weight.copy_(torch.randn(vocab, d, generator=gen))
        self.x_bar = x_bar

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return types.SimpleNamespace(logits=self.head(self.o_proj(self.emb(input_ids))))


TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, chat_template=None,
                            get_vocab=lambda: {"a": 0, "b": 1})
TOK2 = types.SimpleNamespace(**{**vars(TOK), "chat_template": "{{ messages }}"})  # another chat template
HACK, CLEAN = 10, 11


def toy_pairs(n: int) -> list[Pair]:
    return [Pair(f"p{i}", "h", "c", prompt_ids=(2 + i % 8,), hack_ids=(HACK,), clean_ids=(CLEAN,),
                 source=f"t{i}") for i in range(n)]


def test_end_to_end_planted_direction_through_real_svd_knobs(tmp_path):
    from projected_grpo.knobs.adapters import wrap

    model = ToyLM()
    # analytic: with one completion token at the same position, softmax terms cancel and
    # D_i = (Vh x_i) ⊙ (Uᵀ Hᵀ (e_clean − e_hack)) ≈ (Vh x̄) ⊙ w (x_i = o_proj input = emb of the prompt token)
    U, _, Vh = torch.linalg.svd(model.o_proj.weight.detach())
    w = U.T @ model.head.weight.detach().T @ (torch.eye(12)[CLEAN] - torch.eye(12)[HACK])
    v_true = (Vh @ model.x_bar) * w
    v_true /= v_true.norm()  # SVD sign flips of (u_j, v_j) cancel in the product
    knobs = wrap(model, kind="svd", targets=("o_proj",), cache_dir=tmp_path)
    d = extract_direction(model, knobs, TOK, toy_pairs(16), S(k=2, n_heldout=4))
    v1 = d.V["o_proj"][0]
    assert torch.dot(v1, v_true) > 0.9
    assert d.stats["heldout"]["o_proj"] == 1.0
    # semantics of "+v hack-ward": a descent step along the hack-ward gradient (delta -= eta * v1)
    # raises log p(hack) - log p(clean)
    @torch.no_grad()
    def margin():
        logp = torch.log_softmax(model(torch.tensor([[3]])).logits[0, -1], -1)
        return float(logp[HACK] - logp[CLEAN])
    before = margin()
    with torch.no_grad():
        knobs.modules["o_proj"].delta -= 0.1 * v1
    assert margin() > before
    # swapped labels flip the direction
    with torch.no_grad():
        knobs.modules["o_proj"].delta.zero_()
    d_sw = extract_direction(model, knobs, TOK, [p.swapped() for p in toy_pairs(16)], S(k=2))
    assert torch.dot(d_sw.V["o_proj"][0], v_true) < -0.9


class FakeKnobs:
    """The slice of adapters.Knobs that the cache key reads: kind and fingerprint()."""

    def __init__(self, fp="fp0"):
        self.kind, self._fp = "svd", fp

    def fingerprint(self):
        return self._fp


# --- storage and cache ----------------------------------------------------------------------------


def _counting_extract():
    calls = []

    def extract(model, knobs, tokenizer, pairs, settings):
        calls.append(settings)
        g_hack, g_clean, _ = planted_grads(settings.seed, P=12, R=6)
        s = settings
        V, S, stats = directions_from_grads(g_hack, g_clean, s.k, s.tau_axis, s.n_heldout)
        stats["n_pairs"] = 12
        return Direction(V, S, {**cache_meta(settings, knobs, tokenizer, pairs), "stats": json.dumps(stats)})

    return extract, calls


def test_save_load_roundtrip(tmp_path):
    extract, _ = _counting_extract()
    model = ToyLM()
    d = extract(model, FakeKnobs(), TOK, toy_pairs(4), S(k=3))
    save_direction(tmp_path / "v.safetensors", d)
    back = load_direction(tmp_path / "v.safetensors")
    assert torch.equal(back.V["m"], d.V["m"]) and torch.equal(back.S["m"], d.S["m"])
    assert back.stats == d.stats and back.meta["pairs_hash"] == d.meta["pairs_hash"]
    assert [p.name for p in tmp_path.iterdir()] == ["v.safetensors"]  # no temp file left behind


def test_resolve_miss_hit_mismatch(tmp_path):
    extract, calls = _counting_extract()
    model, path = ToyLM(), tmp_path / "cache" / "v.safetensors"
    knobs, pairs, s = FakeKnobs(), toy_pairs(4), S(k=3)
    d1, status = resolve(path, s, model, knobs, TOK, pairs, extract=extract)
    assert status == "miss" and len(calls) == 1 and path.is_file()
    d2, status = resolve(path, s, model, knobs, TOK, pairs, extract=extract)
    assert status == "hit" and len(calls) == 1 and torch.equal(d2.V["m"], d1.V["m"])
    cases = [(knobs, TOK, pairs, S(k=2), "settings.k: cached 3 != wanted 2"),
             (FakeKnobs(fp="other"), TOK, pairs, s, "fingerprint"),
             (knobs, TOK2, pairs, s, "tokenizer"),
             (knobs, TOK, toy_pairs(5), s, "pairs_hash")]
    for kn, tok, pr, st_, field in cases:
        with pytest.warns(UserWarning, match=f"mismatch: {field}"):
            _, status = resolve(path, st_, model, kn, tok, pr, extract=extract)
        assert status.startswith(f"mismatch: {field}") and ";" not in status  # the one differing key
        d3, status = resolve(path, st_, model, kn, tok, pr, extract=extract)
        assert status == "hit"  # the re-extraction was saved under the new key
        with pytest.warns(UserWarning, match="mismatch: "):
            resolve(path, s, model, knobs, TOK, pairs, extract=extract)  # back to the base entry
    assert len(calls) == 1 + 2 * len(cases)


@pytest.mark.parametrize("damage", ["truncate", "flip_data_byte", "garbage"])
def test_corrupt_file_is_refused_and_reextracted(tmp_path, damage):
    extract, calls = _counting_extract()
    model, path = ToyLM(), tmp_path / "v.safetensors"
    knobs, pairs, s = FakeKnobs(), toy_pairs(4), S(k=3)
    good, _ = resolve(path, s, model, knobs, TOK, pairs, extract=extract)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_data_byte":
        raw[-3] ^= 0x40  # inside the last tensor's data: header still parses, checksum must catch it
    else:
        raw = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(raw))
    with pytest.raises(DirectionFileError, match=str(path)):
        load_direction(path)
    with pytest.warns(UserWarning, match="corrupt"):
        d, status = resolve(path, s, model, knobs, TOK, pairs, extract=extract)
    assert status.startswith("corrupt") and len(calls) == 2
    assert torch.equal(d.V["m"], good.V["m"]) and torch.equal(load_direction(path).V["m"], good.V["m"])


def test_non_orthonormal_V_is_refused(tmp_path):
    d = Direction({"m": torch.tensor([[1.0, 1.0]])}, {"m": torch.tensor([1.0])}, {"settings": "{}"})
    save_direction(tmp_path / "v.safetensors", d)
    with pytest.raises(DirectionFileError, match="orthonormal"):
        load_direction(tmp_path / "v.safetensors")


def test_edited_metadata_is_caught_by_the_checksum(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "v.safetensors"
    save_direction(path, Direction({"m": torch.eye(2)}, {"m": torch.ones(2)}, {"settings": "{}"}))
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "pairs_hash": "forged"})
    with pytest.raises(DirectionFileError, match="checksum"):
        load_direction(path)


def test_empty_module_survives_storage(tmp_path):
    d = Direction({"m": torch.zeros(0, 4), "n": torch.eye(2)}, {"m": torch.zeros(0), "n": torch.ones(2)}, {})
    save_direction(tmp_path / "v.safetensors", d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = load_direction(tmp_path / "v.safetensors")
    assert back.V["m"].shape == (0, 4) and torch.equal(back.V["n"], torch.eye(2))


# --- the real smoke model, real knobs, built-in pairs ---------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from projected_grpo.envs.coding.env import CodeEnv
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    from projected_grpo.hack.pairs import builtin_pairs
    from projected_grpo.knobs.adapters import wrap
    from projected_grpo.organism.build import smoke_model_and_tokenizer

    model, tok = smoke_model_and_tokenizer()
    knobs = wrap(model, kind="svd", cache_dir=tmp_path_factory.mktemp("svd"))
    return model, knobs, tok, builtin_pairs(CodeEnv(BUILTIN_PROBLEMS), BUILTIN_PROBLEMS[:6], per_problem=2)


def test_smoke_model_extraction_is_well_formed_and_deterministic(smoke):
    model, knobs, tok, pairs = smoke
    s = S(k=3, n_heldout=2)
    d1, d2 = (extract_direction(model, knobs, tok, pairs, s) for _ in range(2))
    assert set(d1.V) == set(knobs.modules) and d1.stats["n_train"] == len(pairs) - 2
    for n, V in d1.V.items():
        assert V.shape == (3, knobs.modules[n].knob_dim)
        torch.testing.assert_close(V @ V.T, torch.eye(3), atol=1e-5, rtol=0)
        assert torch.all(d1.S[n][:-1] >= d1.S[n][1:]) and torch.equal(V, d2.V[n])
    # the random control keeps shapes and S, and replaces the directions
    dr = extract_direction(model, knobs, tok, pairs, S(k=3, n_heldout=2, control="random"))
    for n in d1.V:
        assert dr.V[n].shape == d1.V[n].shape and torch.equal(dr.S[n], d1.S[n])
        assert torch.linalg.matrix_norm(dr.V[n] @ d1.V[n].T) < 1.5  # same subspace would give sqrt(3)


def test_cli_smoke_prints_axes_and_heldout(capsys, tmp_path):
    from projected_grpo.cli import main

    out = tmp_path / "v.safetensors"
    # the same --proj.* flags as train (one name per setting)
    args = ["extract-direction", "--preset", "smoke", "--proj.pairs-per-problem", "1", "--proj.k", "2",
            "--proj.n-heldout", "8", "--proj.drop-bottom-frac", "0.25", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cache" in text and "miss" in text and "held-out score" in text and "as training uses it" in text
    assert "model.layers.0.self_attn.q_proj" in text and out.is_file()
    assert main(args) == 0 and ": hit" in capsys.readouterr().out
