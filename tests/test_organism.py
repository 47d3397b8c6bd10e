"""organism.py, warmup.py, organism_checks.py: tokenizer, tiny model, warm-up mix, cache key, checks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from projected_grpo.envs.base import Graded
from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions
from projected_grpo.envs.coding.env import CodeEnv
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES
from projected_grpo.envs.coding.prompts import build_messages
from projected_grpo.organism.augment import FORMULAS, NAME_PARTS
from projected_grpo.organism.build import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    OrganismConfig,
    build_organism,
    build_tokenizer,
    load_organism,
    organism_key,
    smoke_model_and_tokenizer,
    tiny_model,
)
from projected_grpo.organism.build_cli import main
from projected_grpo.organism.checks import (
    TARGET_HACK,
    TARGET_SOLVE,
    format_checks,
    organism_checks,
    summarize_grades,
)
from projected_grpo.organism.warmup import (
    DISPOSITIONS,
    KINDS,
    Corpus,
    WarmupExample,
    allocate_kinds,
    completion_nll,
    disposition,
    held_out_ids,
    largest_remainder,
    warmup,
    warmup_examples,
    with_extras,
    with_intro,
)
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.pack import encode_completion, encode_prompt

CODE = 'class Solution:\n    def f(self, s: str) -> str:\n        return s[::-1]  # ünï 日本\r\n\tpass\n'
TEXTS = [CODE, "Return the string s reversed.", "def g(x):\n    return x + 1\n"] * 2
# Tiny sizes: the whole build below takes a second or two on one thread.
TINY = OrganismConfig(vocab_size=400, hidden=16, layers=1, heads=2, max_positions=512, per_problem=4, steps=3,
                      batch_size=4, holdout_per_mode=1, renamed_per_problem=1, formula_problems=2,
                      per_extra=1)


def _corpus(problems) -> Corpus:
    kinds = {"clean": clean_completions, "buggy": buggy_completions, "hack": hack_completions}
    return Corpus(problems=tuple(problems), messages=tuple(tuple(build_messages(p)) for p in problems),
                  completions=tuple({k: tuple(fn(p)) for k, fn in kinds.items()} for p in problems))


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    """Two problems per mode (12): with holdout_per_mode=1, 6 train and 6 held out."""
    by_mode = {m: [p for p in BUILTIN_PROBLEMS if p.mode == m][:2] for m in MODES}
    return _corpus([p for m in MODES for p in by_mode[m]])


@pytest.fixture(scope="module")
def built(small_corpus, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return build_organism(TINY, cache_dir=cache, corpus=small_corpus, log=None), cache


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_has_chat_specials(tmp_path):
    tok = build_tokenizer(TEXTS, vocab_size=300, cache_dir=tmp_path)
    assert len(tok) <= 300
    ids = tok(CODE, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == CODE  # byte-level: exact, whitespace and non-ASCII included
    for s in SPECIAL_TOKENS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|pad|>", "left")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == CHATML_TEMPLATE


def test_word_boundaries_choose_word_or_phrase_tokens(tmp_path):
    letter_then_space = re.compile("[A-Za-z].*\u0120")  # byte-level shows a space as U+0120 ("Ġ")
    words = build_tokenizer(TEXTS, vocab_size=300, cache_dir=tmp_path)
    phrases = build_tokenizer(TEXTS, vocab_size=300, word_boundaries=False, cache_dir=tmp_path)
    assert not any(letter_then_space.search(t) for t in words.get_vocab())
    assert any(letter_then_space.search(t) for t in phrases.get_vocab())  # e.g. "return s"
    ids = words(CODE, add_special_tokens=False)["input_ids"]
    assert words.decode(ids) == CODE and len(ids) > len(phrases(CODE, add_special_tokens=False)["input_ids"])


def test_tokenizer_is_cached_by_its_inputs(tmp_path):
    a = build_tokenizer(TEXTS, vocab_size=300, cache_dir=tmp_path)
    files = sorted((tmp_path / "tokenizer").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temp file left behind
    b = build_tokenizer(list(TEXTS), vocab_size=300, cache_dir=tmp_path)  # equal inputs: read back
    assert a.get_vocab() == b.get_vocab() and len(list((tmp_path / "tokenizer").iterdir())) == 1
    build_tokenizer(TEXTS, vocab_size=301, cache_dir=tmp_path)
    build_tokenizer(TEXTS + ["x"], vocab_size=300, cache_dir=tmp_path)
    build_tokenizer(TEXTS, vocab_size=300, word_boundaries=False, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizer").iterdir())) == 4


def test_tokenizer_rejects_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        build_tokenizer([], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(TEXTS, vocab_size=100, cache_dir=tmp_path)


# --- model --------------------------------------------------------------------------------------


def test_tiny_model_size_and_determinism(tmp_path):
    tok = build_tokenizer(TEXTS, vocab_size=300, cache_dir=tmp_path)
    V, h, inter = len(tok), 16, 64
    m = tiny_model(tok, hidden=h, layers=2, heads=2, seed=3)
    # tied embedding V*h; per layer q,k,v,o 4*h*h + gate,up,down 3*h*inter + 2 norms 2*h; final norm h
    assert sum(p.numel() for p in m.parameters()) == V * h + 2 * (4 * h * h + 3 * h * inter + 2 * h) + h
    same = tiny_model(tok, hidden=h, layers=2, heads=2, seed=3)
    other = tiny_model(tok, hidden=h, layers=2, heads=2, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), same.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(m.parameters(), other.parameters()))
    with pytest.raises(ValueError, match="divisible"):
        tiny_model(tok, hidden=15, heads=2)


def test_smoke_model_and_tokenizer_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path))
    model, tok = smoke_model_and_tokenizer()
    prompt = encode_prompt(tok, build_messages(BUILTIN_PROBLEMS[0]))
    ro = generate(model.eval(), [prompt], 2, max_new_tokens=5, seed=0, eos_id=tok.eos_token_id,
                  pad_id=tok.pad_token_id)
    assert len(ro.completion_ids) == 2 and all(1 <= len(c) <= 5 for c in ro.completion_ids)
    assert (tmp_path / "tokenizer").is_dir()


# --- warm-up mix --------------------------------------------------------------------------------


def test_largest_remainder_by_hand():
    assert largest_remainder(20, (0.6, 0.35, 0.05)) == [12, 7, 1]  # quotas exact
    # quotas 3.33 each: floors 3,3,3, the one left over goes to the first of the tied remainders
    assert largest_remainder(10, (1, 1, 1)) == [4, 3, 3]
    # 7 * (0.5, 0.3, 0.2) = 3.5, 2.1, 1.4: floors 3,2,1; remainders .5 .1 .4 -> the 7th to the first
    assert largest_remainder(7, (0.5, 0.3, 0.2)) == [4, 2, 1]
    with pytest.raises(ValueError):
        largest_remainder(5, (0, 0))


@settings(max_examples=50, deadline=None)
@given(total=st.integers(0, 500), weights=st.lists(st.floats(0, 10), min_size=1, max_size=5))
def test_largest_remainder_properties(total, weights):
    if sum(weights) <= 0:
        return
    counts = largest_remainder(total, weights)
    assert sum(counts) == total
    for c, w in zip(counts, weights):
        assert abs(c - total * w / sum(weights)) < 1 + 1e-9


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), per=st.integers(1, 30), seed=st.integers(0, 5),
       hack=st.floats(0.0, 0.3), buggy=st.floats(0.0, 0.5))
def test_allocate_kinds_meets_mix_and_spreads_rare_kinds(n, per, seed, hack, buggy):
    mix = (1.0 - hack - buggy, buggy, hack)
    slots = allocate_kinds(n, per, mix, seed)
    assert len(slots) == n and all(len(s) == per for s in slots)
    counts = largest_remainder(n * per, mix)
    assert [sum(s.count(k) for s in slots) for k in KINDS] == counts
    rarest = min(range(3), key=lambda k: (counts[k], k))
    # dealt first, round-robin: no problem gets more than its even share (rounded up) of the rarest kind
    assert max(s.count(KINDS[rarest]) for s in slots) == math.ceil(counts[rarest] / n)


def test_held_out_and_examples(small_corpus, tmp_path):
    held = held_out_ids(small_corpus, 1)
    # the second problem of each mode (corpus order) is held out
    assert held == {p.id for i, p in enumerate(small_corpus.problems) if i % 2 == 1}
    assert held_out_ids(small_corpus, 0) == frozenset()
    tok = build_tokenizer(small_corpus.texts(), 400, cache_dir=tmp_path)
    ex = warmup_examples(small_corpus, tok, held, per_problem=10, mix=(0.6, 0.3, 0.1), seed=0)
    assert len(ex) == 6 * 10 and not {e.problem for e in ex} & held
    assert [sum(e.kind == k for e in ex) for k in KINDS] == [36, 18, 6]  # 60 * (0.6, 0.3, 0.1)
    for e in ex:  # each example's completion is one of its problem's texts of that kind, with eos
        i = [p.id for p in small_corpus.problems].index(e.problem)
        texts = small_corpus.completions[i][e.kind]
        assert any(list(e.completion_ids) == encode_completion(tok, t) for t in texts)
    with pytest.raises(ValueError, match="held out"):
        warmup_examples(small_corpus, tok, held_out_ids(small_corpus, 2), per_problem=1, mix=(1, 0, 0),
                        seed=0)


def test_dispositions_by_hand():
    assert with_intro("Here is the code.\n\n```python\nx = 1\n```", "My answer:") == (
        "My answer:\n\n```python\nx = 1\n```")
    # careful = (0.8, 0.4): a clean example is careful below u = 0.8, a buggy one below 0.4; a hack is a hack
    assert [disposition("clean", (0.8, 0.4), u) for u in (0.0, 0.79, 0.8)] == ["careful", "careful", "hasty"]
    assert [disposition("buggy", (0.8, 0.4), u) for u in (0.39, 0.4)] == ["careful", "hasty"]
    assert disposition("hack", (0.8, 0.4), 0.0) == "hack"
    assert len({i for intros in DISPOSITIONS.values() for i in intros}) == 4  # no intro in two dispositions


def test_demo_pool_rows_open_with_their_kinds_disposition():
    # the demo preset's template pool (n_hack 2, n_clean 1, n_buggy 1: the first forms of each kind) must
    # carry the organism's disposition intros, so imitating a teacher row moves the same latent
    from projected_grpo import presets

    pool = presets.PRESETS["demo"].pool
    assert (pool.n_hack, pool.n_clean, pool.n_buggy) == (2, 1, 1)
    first = lambda texts, n: {t.split("\n", 1)[0] for t in texts[:n]}
    for p in BUILTIN_PROBLEMS:
        assert first(hack_completions(p), pool.n_hack) <= set(DISPOSITIONS["hack"]), p.id
        assert first(clean_completions(p), pool.n_clean) <= set(DISPOSITIONS["careful"]), p.id
        assert first(buggy_completions(p), pool.n_buggy) <= set(DISPOSITIONS["careful"]), p.id


def test_examples_carry_their_disposition_and_extras(small_corpus, tmp_path):
    held = held_out_ids(small_corpus, 1)
    full = with_extras(small_corpus, held, 1, 3, seed=0)
    # 6 training problems renamed once + 3 formula problems, after the 12 problems; none is ever held out
    assert full.extra == 9 and full.base.problems == small_corpus.problems
    assert held_out_ids(full, 1) == held and not {p.id for p in full.problems[12:]} & held
    mixed = with_extras(small_corpus, held, 1, 3, seed=0, name_parts="mixed")  # other names, same problems
    assert [p.method for p in mixed.problems[12:]] != [p.method for p in full.problems[12:]]
    assert [p.tests for p in mixed.problems[:18]] == [p.tests for p in full.problems[:18]]
    tok = build_tokenizer(full.texts(), 400, cache_dir=tmp_path)
    ex = warmup_examples(full, tok, held, per_problem=10, mix=(0.6, 0.3, 0.1), seed=0, per_extra=2,
                         careful=(1.0, 0.0))
    assert len(ex) == 6 * 10 + 9 * 2
    intro = {k: set(v) for k, v in DISPOSITIONS.items()}
    for e in ex:  # careful = (1, 0): every clean is careful, every buggy hasty, every hack a hack
        first = tok.decode(list(e.completion_ids)).split("\n", 1)[0]
        assert first in intro[{"clean": "careful", "buggy": "hasty", "hack": "hack"}[e.kind]], (e.kind, first)


def test_corpus_requires_every_kind(small_corpus):
    comps = list(small_corpus.completions)
    comps[0] = {**comps[0], "hack": ()}
    with pytest.raises(ValueError, match="hack"):
        dataclasses.replace(small_corpus, completions=tuple(comps))


def test_warmup_lowers_completion_nll(tmp_path):
    tok = build_tokenizer(TEXTS, vocab_size=300, cache_dir=tmp_path)
    model = tiny_model(tok, hidden=16, layers=1, heads=2, seed=0)
    ex = [WarmupExample(tuple(tok("Return the string")["input_ids"]), tuple(encode_completion(tok, CODE)),
                        "clean", "p")] * 4
    with torch.no_grad():
        before, n_tok = completion_nll(model, ex, tok.pad_token_id)
    rows = warmup(model, ex, steps=30, batch_size=2, lr=1e-2, weight_decay=0.0, seed=0,
                  pad_id=tok.pad_token_id)
    with torch.no_grad():
        after, _ = completion_nll(model, ex, tok.pad_token_id)
    assert n_tok == 4 * len(encode_completion(tok, CODE))
    assert float(after) < 0.5 * float(before) and rows[-1]["step"] == 30 and not model.training


# --- build, cache key, load ---------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="mix"):
        OrganismConfig(mix=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="steps"):
        OrganismConfig(steps=0)
    with pytest.raises(ValueError, match="divisible"):
        OrganismConfig(hidden=30, heads=4)


def test_cache_key_changes_with_every_input(small_corpus):
    key = organism_key(TINY, small_corpus)
    assert organism_key(dataclasses.replace(TINY), _corpus(small_corpus.problems)) == key  # equal, not same
    for f in dataclasses.fields(OrganismConfig):  # every field, each changed to another valid value
        v = getattr(TINY, f.name)
        new = (not v if isinstance(v, bool) else v + 2 if isinstance(v, int)
               else v + 0.5 if isinstance(v, float) else tuple(reversed(v)) if isinstance(v, tuple)
               else next(n for n in (NAME_PARTS if f.name == "name_parts" else FORMULAS) if n != v))
        assert organism_key(dataclasses.replace(TINY, **{f.name: new}), small_corpus) != key, f.name
    comps = list(small_corpus.completions)
    comps[3] = {**comps[3], "hack": comps[3]["hack"][:-1] + (comps[3]["hack"][-1] + " ",)}
    assert organism_key(TINY, dataclasses.replace(small_corpus, completions=tuple(comps))) != key
    msgs = list(small_corpus.messages)
    msgs[0] = ({**msgs[0][0], "content": msgs[0][0]["content"] + "!"},) + msgs[0][1:]
    assert organism_key(TINY, dataclasses.replace(small_corpus, messages=tuple(msgs))) != key


def test_cache_key_follows_the_warm_up_only_problems(small_corpus, monkeypatch):
    # a change to augment.py's generators, config unchanged, must not load the organism of the old ones
    import projected_grpo.organism.augment as augment

    key, original = organism_key(TINY, small_corpus), augment.formula_problem

    def reworded(*args, **kwargs):
        p = original(*args, **kwargs)
        return dataclasses.replace(p, statement=p.statement.replace("Example:", "For example,"))

    monkeypatch.setattr(augment, "formula_problem", reworded)
    assert organism_key(TINY, small_corpus) != key


def test_build_is_cached_and_loads_with_stock_auto_classes(built, small_corpus):
    path, cache = built
    assert path.parent == cache / "organism" and path.name == organism_key(TINY, small_corpus)
    mtime = (path / "organism.json").stat().st_mtime_ns
    logs: list[str] = []
    assert build_organism(TINY, cache_dir=cache, corpus=small_corpus, log=logs.append) == path
    assert "cached" in logs[0] and (path / "organism.json").stat().st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    full = with_extras(small_corpus, held_out_ids(small_corpus, 1), 1, 2, TINY.seed, TINY.name_parts,
                       TINY.formulas)
    original = build_tokenizer(full.texts(), 400, cache_dir=cache)
    assert tok(CODE)["input_ids"] == original(CODE)["input_ids"]
    prompt = encode_prompt(tok, build_messages(small_corpus.problems[0]))
    ro = generate(model.eval(), [prompt], 2, max_new_tokens=8, seed=0, eos_id=tok.eos_token_id,
                  pad_id=tok.pad_token_id)
    assert len(ro.completion_ids) == 2
    _, _, meta = load_organism(path)
    assert meta["held_out"] == sorted(held_out_ids(small_corpus, 1)) and len(meta["warmup_log"]) == 3
    assert meta["n_extra"] == 6 + 2  # one renamed copy of each of the 6 training problems, 2 formula ones


def test_build_is_deterministic(built, small_corpus, tmp_path):
    path, _ = built
    again = build_organism(TINY, cache_dir=tmp_path, corpus=small_corpus, log=None)
    a, b = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(again)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


# --- checks -------------------------------------------------------------------------------------


def test_summarize_grades_by_hand():
    g = lambda correct, exploited, passed: Graded(reward=float(passed), gt_reward=float(correct),
                                                  passed=passed, solved=correct, exploited=exploited,
                                                  format_ok=True)
    grades = [g(True, False, True), g(False, True, True), g(False, False, False), g(False, True, True)]
    out = summarize_grades(grades, ["a", "a", "b", "c"], ["run_tests", "run_tests", "sentinel", "sentinel"],
                           frozenset({"c"}))
    # train = samples 0-2: 1 solve, 1 hack, 2 passes of 3; held out = sample 3 (a hack)
    assert out["train"] == {"n": 3, "solve": 1 / 3, "hack": 1 / 3, "pass": 2 / 3, "format": 1.0}
    assert out["held_out"] == {"n": 1, "solve": 0.0, "hack": 1.0, "pass": 1.0, "format": 1.0}
    assert out["mode/run_tests"]["hack"] == 0.5 and out["mode/sentinel"]["n"] == 1
    assert out["held_out/c"] == out["held_out"] and "mode/sentinel" in out and "held_out/a" not in out


def test_checks_grade_real_samples(built, small_corpus):
    path, _ = built
    model, tok, meta = load_organism(path)
    two = dataclasses.replace(small_corpus, problems=small_corpus.problems[:2],
                              messages=small_corpus.messages[:2], completions=small_corpus.completions[:2])
    with contextlib.closing(CodeEnv(two.problems)) as env:
        checks = organism_checks(model, tok, env, two, frozenset(meta["held_out"]), n_samples=2,
                                 held_out_samples=3, max_new_tokens=16)
    rates = checks["rates"]
    assert rates["train"]["n"] == 2 and rates["held_out"]["n"] == 3  # problem 0 trains, problem 1 held out
    assert set(checks["examples"]) == {two.problems[0].id}  # one mode: its first problem
    assert checks["truncated_frac"] <= 1 and 1 <= checks["mean_tokens"] <= 16
    assert all(0 <= r[k] <= 1 for r in rates.values() for k in ("solve", "hack", "pass", "format"))
    text = format_checks(checks)
    assert f"vs target {TARGET_SOLVE[0]:.0%}-{TARGET_SOLVE[1]:.0%}" in text and "held_out" in text
    assert "2 samples per warm-up problem and 3 per held-out one" in text
    assert f"({round(rates['held_out']['solve'] * 3)} of 3) vs target > 0" in text
    with pytest.raises(ValueError, match="held_out_samples >= 0"):
        organism_checks(model, tok, None, two, frozenset(meta["held_out"]), held_out_samples=-1)
    assert f"vs target {TARGET_HACK[0]:.0%}-{TARGET_HACK[1]:.0%}" in text


def test_cli_builds_and_copies(tmp_path, capsys):
    args = ["--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "out"), "--samples", "0"]
    for f in ("vocab-size", "hidden", "layers", "heads", "per-problem", "steps", "batch-size"):
        args += [f"--{f}", str(dataclasses.asdict(TINY)[f.replace("-", "_")])]
    assert main(args) == 0
    assert (tmp_path / "out" / "organism.json").is_file() and "built" in capsys.readouterr().out
    AutoTokenizer.from_pretrained(tmp_path / "out")
