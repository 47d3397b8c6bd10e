"""V_hack extraction: the toy and smoke models end to end with every control and the held-out check, storage,
cache, CLI. The math: tests/test_subspace.py; the controls: test_controls.py; the check: test_check.py; the
per-pair gradients: test_knob_grads.py.

Run: pytest tests/test_direction.py
"""

from __future__ import annotations

import json
import pathlib
import types
import warnings

import pytest
import torch
from torch import nn

from projected_grpo.errors import UserError
from projected_grpo.hack.direction import (
    CONTROLS,
    Direction,
    DirectionFileError,
    ExtractSettings,
    cache_meta,
    extract_direction,
    load_direction,
    resolve,
    save_direction,
    unavailable_controls,
)
from projected_grpo.hack.pairs import Pair
from projected_grpo.hack.subspace import directions_from_grads


def S(**kw) -> ExtractSettings:
    """ExtractSettings with the ProjCfg defaults (the record itself has none: one name per setting)."""
    return ExtractSettings(**({"k": 4, "heldout_frac": 0.25, "nll_norm": "mean", "nll_const": None,
                               "control": "none", "seed": 0} | kw))


def planted_grads(seed: int, P: int = 40, R: int = 32, noise: float = 0.2):
    """g_hack = base + noise + a * v_true, g_clean = base + noise: D = a * v_true + noise (a in [1, 2])."""
    gen = torch.Generator().manual_seed(seed)
    v_true = torch.randn(R, generator=gen)
    v_true /= v_true.norm()
    base = 5 * torch.randn(P, R, generator=gen)
    a = 1 + torch.rand(P, 1, generator=gen)
    g_hack = base + noise * torch.randn(P, R, generator=gen) + a * v_true
    g_clean = base + noise * torch.randn(P, R, generator=gen)
    return {"m": g_hack}, {"m": g_clean}, v_true


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
    d = extract_direction(model, knobs, TOK, toy_pairs(16), S(k=2))
    v1 = d.V["o_proj"][0]
    assert torch.dot(v1, v_true) > 0.9
    # 4 of the 16 prompts (25%) held out; on them the real V separates hack from clean better than the
    # random and the orientation controls (within, nonhack and energy need two variants per prompt: with one
    # pair per prompt the only within-prompt variation is the labelled contrast: not built)
    st = d.stats
    assert (st["n_train"], st["n_heldout"], st["heldout_prompts"]) == (12, 4, 4)
    chk = st["check"]
    assert chk["vs"]["random"]["beats"] and chk["vs"]["shuffled"]["beats"]
    assert set(chk["unavailable"]) == {"within", "nonhack", "energy"}
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
        V, S, stats = directions_from_grads(g_hack, g_clean, s.k)
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
             (knobs, TOK, pairs, S(k=3, heldout_frac=0.5), "settings.heldout_frac"),
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
    s = S(k=3)
    d1, d2 = (extract_direction(model, knobs, tok, pairs, s) for _ in range(2))
    # 6 problems x 2 pairs: round(0.25 * 6) = 2 prompts (4 pairs) held out
    assert set(d1.V) == set(knobs.modules) and (d1.stats["n_train"], d1.stats["n_heldout"]) == (8, 4)
    for n, V in d1.V.items():
        assert V.shape == (3, knobs.modules[n].knob_dim)
        torch.testing.assert_close(V @ V.T, torch.eye(3), atol=1e-5, rtol=0)
        assert torch.all(d1.S[n][:-1] >= d1.S[n][1:]) and torch.equal(V, d2.V[n])
    assert d1.stats == d2.stats
    chk = d1.stats["check"]
    assert set(chk["vs"]) == {"random", "energy", "within", "shuffled", "nonhack"} and not chk["unavailable"]
    # the energy control captures the real V's share of the fit completions' centred gradients
    assert chk["energy"]["energy"] == pytest.approx(chk["energy"]["real"], abs=1e-5)
    # every control keeps the shapes; random and energy keep S; each is another V; all carry the same check
    for control in CONTROLS[1:]:
        dc = extract_direction(model, knobs, tok, pairs, S(k=3, control=control))
        assert dc.stats["check"] == chk, control
        for n in d1.V:
            assert dc.V[n].shape[1] == d1.V[n].shape[1] and dc.V[n].shape[0] <= 3
            torch.testing.assert_close(dc.V[n] @ dc.V[n].T, torch.eye(dc.V[n].shape[0]), atol=1e-5, rtol=0)
            if control in ("random", "energy"):
                assert torch.equal(dc.S[n], d1.S[n])
            overlap = float(torch.linalg.matrix_norm(dc.V[n] @ d1.V[n].T))  # sqrt(3) = the same span
            assert (overlap > 1.73) == (control == "shuffled"), (control, n, overlap)
    # a seeded control drawn with another seed is another V, with the same check of the real V
    r1 = extract_direction(model, knobs, tok, pairs, S(k=3, control="energy", seed=1))
    r0 = extract_direction(model, knobs, tok, pairs, S(k=3, control="energy"))
    assert r1.stats["check"] == chk and not torch.equal(r1.V["model.layers.0.mlp.up_proj"],
                                                         r0.V["model.layers.0.mlp.up_proj"])


def test_one_extraction_of_many_controls_and_seeds_equals_each_own_extraction_bitwise(smoke, tmp_path,
                                                                                      monkeypatch):
    """extract_many: every control at every seed from one pass of gradients, each V, S and its metadata (the
    check included) equal to that control's own extraction to the bit; resolve_many extracts only what the
    cache lacks, in one call."""
    from projected_grpo.hack import direction

    model, knobs, tok, pairs = smoke
    wanted = [S(k=3), S(k=3, control="random", seed=1), S(k=3, control="shuffled", seed=1),
              S(k=3, control="shuffled", seed=2), S(k=3, control="energy", seed=2), S(k=3, control="within"),
              S(k=3, control="nonhack"), S(k=3, control="energy")]
    many = direction.extract_many(model, knobs, tok, pairs, wanted)
    for s, ext in zip(wanted, many, strict=True):
        own = extract_direction(model, knobs, tok, pairs, s)
        assert ext.direction.meta == own.meta, s
        for n in own.V:
            assert torch.equal(ext.direction.V[n], own.V[n]) and torch.equal(ext.direction.S[n], own.S[n]), s
    # the seeds draw other Vs (shuffled: the same span, other orientations)
    m = "model.layers.0.mlp.up_proj"
    assert not torch.equal(many[2].direction.V[m], many[3].direction.V[m])
    with pytest.raises(ValueError, match="differ only in control and seed"):
        direction.extract_many(model, knobs, tok, pairs, [S(k=3), S(k=2, control="random")])
    # the cache: all missing -> one extraction; then all hit; one file lost -> only it, again in one call
    calls = []
    real_many = direction.extract_many
    monkeypatch.setattr(direction, "extract_many",
                        lambda *a, **kw: calls.append(len(a[4])) or real_many(*a, **kw))
    paths = [tmp_path / f"{i}.safetensors" for i in range(len(wanted))]
    found = direction.resolve_many(list(zip(paths, wanted)), model, knobs, tok, pairs)
    assert [st for _, st in found] == ["miss"] * len(wanted) and calls == [len(wanted)]
    assert all(torch.equal(d.V[m], e.direction.V[m]) for (d, _), e in zip(found, many))
    paths[4].unlink()
    found = direction.resolve_many(list(zip(paths, wanted)), model, knobs, tok, pairs)
    assert [st for _, st in found] == ["hit"] * 4 + ["miss"] + ["hit"] * 3 and calls == [len(wanted), 1]
    assert torch.equal(found[4][0].V[m], many[4].direction.V[m])
    # a random control beside a cached real V is drawn from it, no gradient: equal to its own extraction
    r5 = S(k=3, control="random", seed=5)
    (real, st_real), (d5, st5) = direction.resolve_many([(paths[0], wanted[0]), (tmp_path / "r5", r5)],
                                                        model, knobs, tok, pairs)
    assert (st_real, st5) == ("hit", "miss") and calls == [len(wanted), 1]
    own = extract_direction(model, knobs, tok, pairs, r5)
    assert d5.meta == own.meta and all(torch.equal(d5.V[n], own.V[n]) and torch.equal(d5.S[n], own.S[n])
                                       for n in own.V)
    saved = load_direction(tmp_path / "r5")
    assert {k: v for k, v in saved.meta.items() if k != "checksum"} == own.meta


def test_a_control_that_cannot_be_built_is_refused(smoke):
    model, knobs, tok, pairs = smoke
    one_per_prompt = pairs[::2]  # one hack and one clean per prompt: no within-class pair, no energy control
    d = extract_direction(model, knobs, tok, one_per_prompt, S(k=2))
    assert set(d.stats["check"]["unavailable"]) == {"within", "nonhack", "energy"}
    with pytest.raises(UserError, match="proj.control='within' cannot be built from these pairs: within"):
        extract_direction(model, knobs, tok, one_per_prompt, S(k=2, control="within"))
    with pytest.raises(UserError, match="proj.control='energy' cannot be built from these pairs: energy"):
        extract_direction(model, knobs, tok, one_per_prompt, S(k=2, control="energy"))
    # decided without a gradient, as a study decides it when it plans the arms
    assert unavailable_controls(one_per_prompt, 0.25) == d.stats["check"]["unavailable"]
    assert unavailable_controls(pairs, 0.25) == {}


def test_cli_smoke_prints_axes_and_the_check(capsys, tmp_path):
    from projected_grpo.cli import main

    out = tmp_path / "v.safetensors"
    # the same --proj.* flags as train (one name per setting)
    args = ["extract-direction", "--preset", "smoke", "--proj.pairs-per-problem", "2", "--proj.k", "2",
            "--proj.heldout-frac", "0.5", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cache" in text and "miss" in text and "12 held out from 6 prompts" in text
    assert "V_hack held-out separation" in text and "energy V" in text and "within V" in text
    assert "share of the completion gradients (centred per prompt) inside span(V)" in text
    assert "model.layers.0.self_attn.q_proj" in text and out.is_file()
    assert main(args) == 0 and ": hit" in capsys.readouterr().out


def test_cli_controls_fill_the_cache_of_every_control_and_seed_train_reads(capsys, tmp_path):
    """extract-direction --controls --seeds: one extraction caches each control (the seeded ones at each seed)
    where `train` with that --proj.control and --run.seed reads it (its line says `hit`); the deterministic
    controls are cached once, seed-free."""
    from projected_grpo.cli import main

    flags = ["--preset", "smoke", "--proj.pairs-per-problem", "2", "--proj.k", "2",
             "--model.cache-dir", str(tmp_path / "cache")]
    # the smoke model is drawn with run.seed: the runs of seed 1 read what an extraction at seed 1 cached
    seed1 = [*flags, "--run.seed", "1"]
    assert main(["extract-direction", *seed1, "--controls", "random", "within", "--seeds", "1", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("cache ")]
    assert len(lines) == 4 and all(": miss" in x for x in lines), lines
    assert [x.split("(", 1)[1] for x in lines[1:]] == ["--proj.control random, seed 1)",
                                                       "--proj.control random, seed 2)",
                                                       "--proj.control within)"]
    path = lines[1].split()[1].rstrip(":")
    run = ["--arm", "erase", "--proj.control", "random", "--run.seed", "1", "--run.steps", "1",
           "--run.dir", str(tmp_path / "run")]
    assert main(["train", *flags, *run]) == 0
    assert f"V_hack {path} (hit" in capsys.readouterr().err
    assert main(["extract-direction", *flags, "--controls", "nope"]) == 2
    assert "--controls ['nope']: known controls are" in capsys.readouterr().err


def test_cli_without_out_fills_the_cache_train_reads(capsys, tmp_path):
    """extract-direction ahead of the runs: `train` with the same flags then loads V_hack instead of
    re-extracting it (its line says `hit`), from the path extract-direction printed."""
    from projected_grpo.cli import main

    flags = ["--preset", "smoke", "--proj.pairs-per-problem", "2", "--proj.k", "2",
             "--model.cache-dir", str(tmp_path / "cache")]
    assert main(["extract-direction", *flags]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cache "))
    path = line.split()[1].rstrip(":")
    assert path.startswith(str(tmp_path / "cache")) and ": miss" in line and pathlib.Path(path).is_file()
    run = ["--arm", "erase", "--run.steps", "1", "--run.dir", str(tmp_path / "run")]
    assert main(["train", *flags, *run]) == 0
    err = capsys.readouterr().err
    assert f"V_hack {path} (hit" in err, err[-1500:]
