"""Knob adapters: identity at zero knobs, freezing, export round trip, knob save/load, SVD cache."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from adapter_helpers import ids, randomize, tiny
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from projected_grpo.knobs import plain
from projected_grpo.knobs.adapters import wrap
from projected_grpo.knobs.svd_cache import SVD_FORMAT, _tensors_checksum, svd_cached
from projected_grpo.store import weight_hash


@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_knobs_are_bit_identical_to_base(kind, arch, dtype, tmp_path):
    model, x = tiny(arch, dtype), ids()
    with torch.no_grad():
        base = model(x).logits
    knobs = wrap(model, kind, cache_dir=tmp_path)
    with torch.no_grad():
        fresh = model(x).logits  # knobs at init are exactly zero: the branch adds exact zeros
    randomize(knobs)
    with torch.no_grad():
        moved = model(x).logits
        with knobs.zeroed():
            ref = model(x).logits
    assert torch.equal(fresh, base)
    assert torch.equal(ref, base)  # zeroed(): the free KL reference is the base model, bit for bit
    assert not torch.equal(moved, base)  # and the knobs really do move the logits
    with torch.no_grad():
        assert torch.equal(model(x).logits, moved)  # zeroed() restored the knobs on exit


def test_zeroed_restores_after_exception(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    randomize(knobs)
    with torch.no_grad():
        moved = model(x).logits
    with pytest.raises(KeyError), knobs.zeroed():
        raise KeyError("boom")
    with torch.no_grad():
        assert torch.equal(model(x).logits, moved)


def test_ablate_quarantine_equals_zero_hack_knob(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    randomize(knobs)
    with torch.no_grad(), knobs.ablate_quarantine():
        ablated = model(x).logits
    for p in knobs.hack_parameters():
        p.data.zero_()
    with torch.no_grad():
        no_hack = model(x).logits
    torch.testing.assert_close(ablated, no_hack, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_only_knobs_require_grad(kind, tmp_path):
    model = tiny("qwen2")  # Qwen2 q/k/v have biases: they must be frozen too
    knobs = wrap(model, kind, cache_dir=tmp_path)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"{n}.{k}" for n in knobs.modules for k in ("delta", "delta_hack")}
    assert trainable == expected
    # 2 layers × 7 projections (q k v o gate up down)
    assert len(knobs.modules) == 14
    assert all(not b.requires_grad for b in model.buffers())


def test_knob_shapes(tmp_path):
    model = tiny()
    svd = wrap(model, "svd", cache_dir=tmp_path).modules["model.layers.0.mlp.up_proj"]
    # up_proj W is (64, 32): R = min = 32; U (64, 32), Vh (32, 32)
    assert svd.delta.shape == (32,) and svd.U.shape == (64, 32) and svd.Vh.shape == (32, 32)
    assert svd.knob_dim == 32
    lora = wrap(tiny(), "lora", rank=4, seed=3).modules["model.layers.0.mlp.up_proj"]
    # B is (d_out, r) = (64, 4): R = 256; A (4, 32) has orthonormal rows
    assert lora.delta.shape == (64, 4) and lora.knob_dim == 256
    torch.testing.assert_close(lora.A @ lora.A.T, torch.eye(4), atol=1e-6, rtol=0)
    again = wrap(tiny(), "lora", rank=4, seed=3).modules["model.layers.0.mlp.up_proj"]
    assert torch.equal(again.A, lora.A)  # seeded: reproducible


def test_svd_rank_truncates(tmp_path):
    knobs = wrap(tiny(), "svd", rank=5, cache_dir=tmp_path)
    m = knobs.modules["model.layers.1.self_attn.k_proj"]
    assert m.delta.shape == (5,) and m.U.shape[1] == 5 and m.Vh.shape[0] == 5


def test_no_target_match_lists_linears():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"Linear modules found: \['0', '2'\]"):
        wrap(model, "svd")


def test_unknown_kind_and_double_wrap(tmp_path):
    model = tiny()
    with pytest.raises(ValueError, match="unknown knob kind"):
        wrap(model, "dora")
    wrap(model, "svd", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="already wrapped"):
        wrap(model, "svd", cache_dir=tmp_path)


@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("include_quarantine", [False, True])
def test_export_round_trip_with_stock_transformers(kind, include_quarantine, tmp_path):
    model, x = tiny("qwen2"), ids()
    knobs = wrap(model, kind, cache_dir=tmp_path / "cache")
    randomize(knobs)
    with torch.no_grad():
        if include_quarantine:
            want = model(x).logits
        else:
            with knobs.ablate_quarantine():
                want = model(x).logits
    plain.export(knobs, tmp_path / "out", include_quarantine=include_quarantine)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not any("delta" in n for n, _ in hf.named_parameters())
    with torch.no_grad():
        got = hf(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(FileExistsError, match="not empty"):
        plain.export(knobs, tmp_path / "out")


@pytest.mark.bitwise  # a promise across a save and a load: docs/reproducibility.md
def test_knob_save_load_and_mismatch(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "svd", cache_dir=tmp_path / "c")
    randomize(knobs)
    with torch.no_grad():
        want = model(x).logits
    knobs.save(tmp_path / "k.safetensors")
    other = wrap(tiny(), "svd", cache_dir=tmp_path / "c")  # same base weights (same seed)
    assert other.fingerprint() == knobs.fingerprint()
    other.load(tmp_path / "k.safetensors")
    with torch.no_grad():
        assert torch.equal(other.model(x).logits, want)
    different = wrap(tiny(seed=5), "svd", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="fingerprint"):
        different.load(tmp_path / "k.safetensors")
    lora = wrap(tiny(), "lora")
    with pytest.raises(ValueError, match="kind='svd'"):
        lora.load(tmp_path / "k.safetensors")


def test_fingerprint_sees_every_weight_and_config_value_but_not_the_path(tmp_path):
    base = wrap(tiny(), "svd", cache_dir=tmp_path / "c").fingerprint()
    emb = tiny()
    with torch.no_grad():
        emb.get_input_embeddings().weight[0, 0] += 1.0  # not a wrapped Linear
    assert wrap(emb, "svd", cache_dir=tmp_path / "c").fingerprint() != base
    rope = tiny()
    rope.config.rope_theta = 1234.0  # same weights, another model
    assert wrap(rope, "svd", cache_dir=tmp_path / "c").fingerprint() != base
    moved = tiny()
    moved.config._name_or_path = "/elsewhere"  # the same model from another directory
    assert wrap(moved, "svd", cache_dir=tmp_path / "c").fingerprint() == base


def test_svd_cache_hit_miss(tmp_path):
    W = torch.randn(6, 4)
    U, S, Vh, status = svd_cached(W, tmp_path)
    assert status == "miss" and U.shape == (6, 4) and S.shape == (4,) and Vh.shape == (4, 4)
    U2, S2, Vh2, status2 = svd_cached(W, tmp_path)
    assert status2 == "hit" and torch.equal(S2, S.cpu())
    torch.testing.assert_close((U2 * S2) @ Vh2, W, atol=1e-5, rtol=0)
    assert svd_cached(W + 1, tmp_path)[3] == "miss"  # different bytes, different key


def test_weight_hash_is_dtype_safe():
    W = torch.randn(4, 4)
    # bf16 has no numpy dtype; the hash goes through the raw bytes and sees the dtype
    assert weight_hash(W.bfloat16()) != weight_hash(W)
    assert weight_hash(W.bfloat16()) == weight_hash(W.bfloat16().clone())
    assert weight_hash(W) != weight_hash(W.reshape(2, 8))


def _cache_file(tmp_path):
    (path,) = tmp_path.glob("*.safetensors")
    return path


@pytest.mark.parametrize("damage", ["garbage", "truncate", "flip_byte", "other_matrix", "bad_shape"])
def test_svd_cache_corrupt_file_is_recomputed(damage, tmp_path):
    W = torch.randn(6, 4)
    svd_cached(W, tmp_path)
    path = _cache_file(tmp_path)
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a safetensors file")
    elif damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip_byte":  # last byte is tensor data: the checksum catches it
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    else:
        t = load_file(path)
        t = ({"U": torch.linalg.svd(torch.randn(6, 4), full_matrices=False)[0], "S": t["S"], "Vh": t["Vh"]}
             if damage == "other_matrix" else {"U": t["U"][:, :3], "S": t["S"][:3], "Vh": t["Vh"][:3]})
        t = {k: v.contiguous() for k, v in t.items()}
        save_file(t, path, metadata={"format": SVD_FORMAT, "checksum": _tensors_checksum(t)})
    with pytest.warns(UserWarning, match="corrupt"):
        U, S, Vh, status = svd_cached(W, tmp_path)
    assert status == "corrupt"
    torch.testing.assert_close((U * S) @ Vh, W, atol=1e-5, rtol=0)  # never a wrong W
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert svd_cached(W, tmp_path)[3] == "hit"  # the file was rewritten


def test_cache_dir_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(tmp_path))
    wrap(tiny(), "svd")
    assert len(list((tmp_path / "svd").glob("*.safetensors"))) == 14
    assert all(s == "hit" for s in wrap(tiny(), "svd").cache_status.values())


def test_grads_and_set_grads_round_trip(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "lora", rank=2)
    model(x).logits.square().mean().backward()
    g = knobs.grads("main")
    name = "model.layers.0.self_attn.q_proj"
    assert g[name].shape == (32 * 2,)  # d_out·r flattened
    assert torch.count_nonzero(knobs.grads("hack")[name]) == 0  # the quarantine gets no own gradient
    knobs.set_grads({name: torch.ones(64)}, "hack")
    assert torch.equal(knobs.modules[name].delta_hack.grad, torch.ones(32, 2))
    with pytest.raises(KeyError, match="not a wrapped module"):
        knobs.set_grads({"nope": torch.ones(1)})


def test_svd_knob_hand_example(tmp_path):
    # W = diag(3, 2): U = Vh = I up to paired signs (which cancel in U·diag(δS)·Vh), S = [3, 2]
    lin = nn.Linear(2, 2, bias=False)
    lin.weight.data = torch.tensor([[3.0, 0.0], [0.0, 2.0]])
    model = nn.Sequential(OrderedDict(q_proj=lin))
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    knobs.modules["q_proj"].delta.data = torch.tensor([1.0, 0.0])
    x = torch.tensor([[[1.0, 1.0], [2.0, 0.0]]])  # (N=1, T=2, d_in=2)
    y = model(x)
    # y = x·(W + diag(1, 0))ᵀ: [1, 1] -> [4, 2]; [2, 0] -> [8, 0]
    assert torch.allclose(y, torch.tensor([[[4.0, 2.0], [8.0, 0.0]]]), atol=1e-6)
    with knobs.capture(torch.tensor([True]), per_sequence=True) as cap:
        model(x).sum().backward()
    # ∂Σy/∂δS_i = Σ_t (x_t·v_i)(1·u_i): δS_0: 1 + 2 = 3; δS_1: 1 + 0 = 1
    torch.testing.assert_close(knobs.grads()["q_proj"], torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(cap.per_sequence["q_proj"], torch.tensor([[3.0, 1.0]]))
    assert cap.g_teacher["q_proj"].abs().sum() == 0  # no teacher rows
