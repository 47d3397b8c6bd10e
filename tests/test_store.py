"""store.py: atomic writes, aligned tensor loads, JSONL errors, hashes.

Run: .venv/bin/pytest -q tests/test_store.py
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from projected_grpo import store
from projected_grpo.errors import UserError


def test_write_json_atomic_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "summary.json"
    store.write_json_atomic(path, {"hack/student": 0.5})
    assert json.loads(path.read_text()) == {"hack/student": 0.5}
    with pytest.raises(ValueError):
        store.write_json_atomic(path, {"hack/student": float("nan")})
    assert json.loads(path.read_text()) == {"hack/student": 0.5}  # the old file survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_dir_is_all_or_nothing(tmp_path):
    with store.atomic_dir(tmp_path / "out") as d:
        (d / "a.txt").write_text("x")
    assert (tmp_path / "out" / "a.txt").read_text() == "x"
    with pytest.raises(RuntimeError), store.atomic_dir(tmp_path / "bad") as d:
        (d / "a.txt").write_text("x")
        raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_loaded_tensors_are_aligned_copies_not_file_views(tmp_path):
    # safetensors' own loader returns views into the file at 8-byte offsets; MKL's SSE4.2/AVX paths
    # round a product differently for other alignments, which made resumed runs drift (issue 13)
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.randn(3), "b": torch.randn(5, 7)}, str(path), metadata={"k": "v"})
    t, meta = store.load_tensors(path)
    assert meta == {"k": "v"}
    assert all(v.data_ptr() % 64 == 0 for v in t.values())
    path.write_bytes(b"garbage")  # the loaded copies do not depend on the file any more
    assert t["b"].shape == (5, 7) and torch.isfinite(t["b"]).all()
    with pytest.raises(UserError, match="t.safetensors: unreadable"):
        store.load_tensors(path)


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n')
    rows = store.read_jsonl(path)
    assert next(rows) == (f"{path}:1", {"a": 1})
    with pytest.raises(UserError, match=r"rows.jsonl:3: invalid JSON"):
        next(rows)
    with pytest.raises(UserError, match="no such file"):
        next(store.read_jsonl(tmp_path / "missing.jsonl"))


def test_stable_hash_is_order_free_and_refuses_non_json():
    assert store.stable_hash({"a": 1, "b": [1, 2]}) == store.stable_hash({"b": [1, 2], "a": 1})
    assert store.stable_hash({"a": 1}) != store.stable_hash({"a": 2})
    with pytest.raises(TypeError):
        store.stable_hash({"a": object()})


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path / "env"))
    assert store.cache_root() == tmp_path / "env"
    assert store.cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("PROJECTED_GRPO_CACHE")
    assert store.cache_root().name == "projected_grpo"
