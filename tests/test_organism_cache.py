"""organism/cache.py: a cache entry is whole or built again. A damaged organism (a truncated or changed
file, a deleted tokenizer, a bad organism.json, an entry from before the sha256 record) and a damaged cached
tokenizer are named in a warning and rebuilt, never loaded and never a crash.

Run: .venv/bin/pytest -q tests/test_organism_cache.py
"""

from __future__ import annotations

import json
import re
import warnings

import pytest

from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES
from projected_grpo.envs.coding.prompts import build_messages
from projected_grpo.organism.build import OrganismConfig, build_organism, build_tokenizer, load_organism
from projected_grpo.organism.warmup import Corpus

TINY = OrganismConfig(vocab_size=400, hidden=16, layers=1, heads=2, max_positions=512, per_problem=4, steps=3,
                      batch_size=4, holdout_per_mode=1, renamed_per_problem=1, formula_problems=2,
                      per_extra=1)


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    """Two problems per mode (12), as tests/test_organism.py's."""
    problems = [p for m in MODES for p in [q for q in BUILTIN_PROBLEMS if q.mode == m][:2]]
    kinds = {"clean": clean_completions, "buggy": buggy_completions, "hack": hack_completions}
    return Corpus(problems=tuple(problems), messages=tuple(tuple(build_messages(p)) for p in problems),
                  completions=tuple({k: tuple(fn(p)) for k, fn in kinds.items()} for p in problems))


@pytest.mark.parametrize("damage", ["truncate weights", "flip a byte", "delete tokenizer",
                                    "bad organism.json", "unrecorded and truncated"])
def test_a_damaged_cache_entry_is_named_and_rebuilt(small_corpus, tmp_path, damage):
    build = lambda: build_organism(TINY, cache_dir=tmp_path, corpus=small_corpus, log=None)
    path = build()
    meta = json.loads((path / "organism.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(meta["files"])  # sha256 recorded
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    if damage == "truncate weights":
        weights.write_bytes(good[:-64])
    elif damage == "flip a byte":  # still a loadable file: only the recorded sha256 can tell
        weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    elif damage == "delete tokenizer":
        (path / "tokenizer.json").unlink()
    elif damage == "bad organism.json":
        (path / "organism.json").write_text("{not json")
    else:  # built before organism.json recorded its files: it must load
        (path / "organism.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
        weights.write_bytes(good[:-64])
    named = rf"organism cache {re.escape(str(path))} is corrupt \(.+\); rebuilding it"
    with pytest.warns(UserWarning, match=named):
        again = build()
    assert again == path and (path / "model.safetensors").read_bytes() == good  # the same build, whole again
    model, tok, _ = load_organism(path)
    assert model is not None and tok.eos_token == "<|im_end|>"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole entry is found silently
        assert build() == path


def test_a_damaged_cached_tokenizer_is_named_and_trained_again(tmp_path):
    texts = ["def f(x):\n    return x + 1\n"] * 20
    tok = build_tokenizer(texts, vocab_size=300, cache_dir=tmp_path)
    (cached,) = (tmp_path / "tokenizer").iterdir()
    cached.write_text('{"truncated": ')
    with pytest.warns(UserWarning, match=rf"tokenizer cache file {re.escape(str(cached))} is corrupt"):
        again = build_tokenizer(texts, vocab_size=300, cache_dir=tmp_path)
    assert again.get_vocab() == tok.get_vocab() and json.loads(cached.read_text())  # rewritten whole
