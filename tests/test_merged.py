"""Knobs.merged(): sampling through W_eff = W + ΔW instead of the knob side path, equal to the knob path."""

from __future__ import annotations

import contextlib
import tempfile
from collections import OrderedDict

import pytest
import torch
from adapter_helpers import ids, randomize, tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import branch_path
from torch import nn

from projected_grpo.knobs.adapters import wrap

# --- merged(): sampling through W_eff = W + ΔW instead of the knob side path ---------------------------

FLAGS = {"none": [], "ablate": ["ablate_quarantine"], "zeroed": ["zeroed"],
         "ablate+zeroed": ["ablate_quarantine", "zeroed"]}


def _logits(model, x, knobs, flags, merged):
    with contextlib.ExitStack() as st:
        st.enter_context(torch.no_grad())
        for f in flags:
            st.enter_context(getattr(knobs, f)())
        if merged:
            st.enter_context(knobs.merged())
        return model(x).logits


@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_merged_matches_knob_path(kind, flags, tmp_path):
    model, x = tiny("qwen2"), ids()  # qwen2: q/k/v biases go through F.linear too
    knobs = wrap(model, kind, cache_dir=tmp_path)
    randomize(knobs)  # non-zero main and hack knobs
    with branch_path(knobs):
        want = _logits(model, x, knobs, FLAGS[flags], merged=False)  # the side path (pre-fusion forward)
    fused = _logits(model, x, knobs, FLAGS[flags], merged=False)
    got = _logits(model, x, knobs, FLAGS[flags], merged=True)
    assert torch.equal(got, fused)  # the same W_eff inside merged() and out
    if "zeroed" in flags:
        assert torch.equal(got, want)  # nothing to merge: the base path, bit for bit
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 rounding of W + ΔW only
        base = _logits(model, x, knobs, ["zeroed"], merged=False)
        assert (got - want).abs().max() < 1e-3 * (want - base).abs().max()  # error << the knobs' own effect


def test_merged_pins_w_eff_on_entry(tmp_path, monkeypatch):
    model, x = tiny(), ids()
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    randomize(knobs)
    cls, calls = type(next(iter(knobs.modules.values()))), []
    orig = cls.weight_eff
    monkeypatch.setattr(cls, "weight_eff", lambda self: calls.append(self.name) or orig(self))
    with torch.no_grad(), knobs.merged():
        model(x)
        model(x)  # decode steps: no cache lookup per forward
    assert sorted(calls) == sorted(knobs.modules)  # once per module, on entry
    with torch.no_grad():
        model(x)
    assert len(calls) == 2 * len(knobs.modules)  # outside merged() every forward checks its cache


def test_merged_svd_hand_example(tmp_path):
    # W = diag(3, 2), δS = [1, 0], δS_hack = [0, 0.5]: W_eff = diag(3 + 1, 2 + 0.5) = diag(4, 2.5);
    # ablate_quarantine() leaves the hack knob out: diag(4, 2); zeroed(): W itself (no copy)
    lin = nn.Linear(2, 2, bias=False)
    lin.weight.data = torch.tensor([[3.0, 0.0], [0.0, 2.0]])
    knobs = wrap(nn.Sequential(OrderedDict(q_proj=lin)), "svd", cache_dir=tmp_path)
    m = knobs.modules["q_proj"]
    m.delta.data, m.delta_hack.data = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.5])
    x = torch.tensor([[1.0, 1.0]])
    diag = torch.diag
    with torch.no_grad():
        with knobs.merged():
            torch.testing.assert_close(m.weight_eff(), diag(torch.tensor([4.0, 2.5])), atol=1e-6, rtol=0)
            torch.testing.assert_close(knobs.model(x), torch.tensor([[4.0, 2.5]]), atol=1e-6, rtol=0)
        with knobs.ablate_quarantine(), knobs.merged():
            torch.testing.assert_close(m.weight_eff(), diag(torch.tensor([4.0, 2.0])), atol=1e-6, rtol=0)
        with knobs.zeroed(), knobs.merged():
            assert m.weight_eff() is m.base.weight
    assert m._pinned is None


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_merged_zero_knobs_use_base_path(kind, tmp_path):
    model, x = tiny(), ids()
    with torch.no_grad():
        base = model(x).logits
    knobs = wrap(model, kind, cache_dir=tmp_path)  # knobs start exactly zero
    with torch.no_grad(), knobs.merged():
        assert all(m.weight_eff() is m.base.weight for m in knobs.modules.values())  # no extra weight copy
        assert torch.equal(model(x).logits, base)


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_merged_exit_restores_exactly(kind, tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, kind, cache_dir=tmp_path)
    randomize(knobs)
    weights = {n: m.base.weight for n, m in knobs.modules.items()}
    saved = {n: w.clone() for n, w in weights.items()}
    with torch.no_grad():
        before = model(x).logits
        with knobs.merged():
            model(x)
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)  # the knob path again, bit for bit
    for n, m in knobs.modules.items():
        assert m._pinned is None  # unpinned
        assert m.base.weight is weights[n] and torch.equal(m.base.weight, saved[n])  # W never written
    model(x).logits.sum().backward()  # training works again after exit
    assert all(p.grad is not None for p in knobs.parameters())


def test_merged_needs_no_grad(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    randomize(knobs)
    with pytest.raises(RuntimeError, match="no-grad inference only"), knobs.merged():
        pass
    assert all(m._pinned is None for m in knobs.modules.values())
    with torch.no_grad(), knobs.merged():
        with torch.enable_grad(), pytest.raises(RuntimeError, match="grad enabled inside Knobs.merged"):
            model(x)
        with pytest.raises(RuntimeError, match="already active"), knobs.merged():
            pass


def test_merged_restores_after_exception(tmp_path):
    model, x = tiny(), ids()
    knobs = wrap(model, "lora", cache_dir=tmp_path)
    randomize(knobs)
    with torch.no_grad():
        before = model(x).logits
    with pytest.raises(KeyError), torch.no_grad(), knobs.merged():
        raise KeyError("boom")
    assert all(m._pinned is None for m in knobs.modules.values())
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["svd", "lora"]), d_out=st.integers(1, 9), d_in=st.integers(1, 9),
       scale=st.floats(1e-3, 10.0), seed=st.integers(0, 2**16))
def test_merged_linear_property(kind, d_out, d_in, scale, seed):
    # any shape, any knob size: F.linear(x, W + ΔW) equals the knob path up to fp32 rounding
    torch.manual_seed(seed)
    lin = nn.Linear(d_in, d_out)
    with tempfile.TemporaryDirectory() as cache:
        knobs = wrap(nn.Sequential(OrderedDict(o_proj=lin)), kind, rank=1 if kind == "lora" else None,
                     cache_dir=cache)
    randomize(knobs, scale=scale, seed=seed)
    x = torch.randn(2, 3, d_in)
    with torch.no_grad():
        want = knobs.model(x)
        with knobs.merged():
            got = knobs.model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * (1 + scale))
