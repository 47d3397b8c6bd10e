"""Fused knob Functions == the pre-fusion side branch (reference.py); W_eff cache; gradient checkpointing."""

from __future__ import annotations

import gc
import tempfile
import weakref
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import branch_path, two_backward_split
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs import checkpointing, fused
from projected_grpo.knobs.adapters import wrap
from projected_grpo.knobs.fused import lora_knob_grad, svd_knob_grad, svd_knob_grad_dw

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
N = 6
STUDENT = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the tensor's scale."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def setup(kind, tmp_path, dtype=torch.float32, rank=None, t=9):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(dtype).eval()
    knobs = wrap(model, kind, rank=rank, cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    for p in knobs.parameters() + knobs.hack_parameters():  # away from zero: every term is exercised
        p.data = (torch.randn(p.shape, generator=gen) * 0.05).to(dtype)
    x = torch.randint(0, 64, (N, t), generator=gen)
    adv = torch.randn(N, generator=gen, dtype=dtype)
    return model, knobs, x, adv


def per_seq_loss(model, x, adv):
    """A GRPO-shaped loss: -adv_n · Σ_t logp(x_{t+1}) per sequence -> (N,)."""
    logp = torch.log_softmax(model(x, use_cache=False).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    return -adv * logp.sum(-1)


def step(model, knobs, x, adv, per_sequence=True):
    """One captured forward + backward -> (.grad copies, capture)."""
    for p in knobs.parameters():
        p.grad = None
    with knobs.capture(STUDENT, per_sequence=per_sequence) as cap:
        per_seq_loss(model, x, adv).sum().backward()
    return {n: g.clone() for n, g in knobs.grads("main").items()}, cap


# --- the pure gradient functions, by hand --------------------------------------------------------

def test_svd_knob_grad_by_hand():
    # U = Vh = I (2x2): x·Vhᵀ = x, dy·U = dy. Sequence 0: x = [1, 2], [3, 0]; dy = [1, 1], [2, 5]
    # per token x ⊙ dy: [1, 2], [6, 0] -> sequence 0 sums to [7, 2]; sequence 1: x = [1, 1], dy = [0, 4]
    # -> [0, 4]. Total [7, 6].
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]])
    dy = torch.tensor([[[1.0, 1.0], [2.0, 5.0]], [[0.0, 4.0], [9.0, 9.0]]])
    eye = torch.eye(2)
    assert svd_knob_grad(x, dy, eye, eye, per_sequence=True).tolist() == [[7.0, 2.0], [0.0, 4.0]]
    assert svd_knob_grad(x, dy, eye, eye, per_sequence=False).tolist() == [7.0, 6.0]


def test_lora_knob_grad_by_hand():
    # A = [[1, 0]] (r = 1): h = x·Aᵀ = x[..., 0]. Sequence 0: h = 1, 3; dy = [1, 1], [2, 5]
    # dB = Σ dyᵀ·h = [1·1 + 2·3, 1·1 + 5·3] = [7, 16]; sequence 1: h = 1, 0 -> [0, 4]
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]])
    dy = torch.tensor([[[1.0, 1.0], [2.0, 5.0]], [[0.0, 4.0], [9.0, 9.0]]])
    A = torch.tensor([[1.0, 0.0]])
    assert lora_knob_grad(x, dy, A, per_sequence=True).tolist() == [[7.0, 16.0], [0.0, 4.0]]
    assert lora_knob_grad(x, dy, A, per_sequence=False).tolist() == [[7.0], [20.0]]


def test_svd_knob_grad_dw_by_hand():
    # the same example through G = Σ_t dy_tᵀ·x_t (the all-zero last token adds nothing):
    # G = [[1·1 + 2·3 + 0·1, 1·2 + 0 + 0], [1·1 + 5·3 + 4·1, 1·2 + 0 + 4·1]] = [[7, 2], [20, 6]];
    # U = Vh = I: ∂L/∂δS_i = G_ii -> [7, 6], as the thin projections give
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]])
    dy = torch.tensor([[[1.0, 1.0], [2.0, 5.0]], [[0.0, 4.0], [9.0, 9.0]]])
    assert svd_knob_grad_dw(x, dy, torch.eye(2), torch.eye(2)).tolist() == [7.0, 6.0]


@settings(max_examples=30, deadline=None)
@given(d_out=st.integers(1, 10), d_in=st.integers(1, 10), rank_frac=st.floats(0.01, 1.0),
       n=st.integers(1, 4), t=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_svd_grad_routes_agree(d_out, d_in, rank_frac, n, t, seed):
    # u_iᵀ·(Σ dyᵀx)·v_i == Σ_tokens (x·v_i)(dy·u_i) for any orthonormal U, Vh; fp64: to rounding
    gen = torch.Generator().manual_seed(seed)
    R = max(1, round(rank_frac * min(d_out, d_in)))
    U, _, Vh = torch.linalg.svd(torch.randn(d_out, d_in, generator=gen, dtype=torch.float64),
                                full_matrices=False)
    U, Vh = U[:, :R], Vh[:R]
    x = torch.randn(n, t, d_in, generator=gen, dtype=torch.float64)
    dy = torch.randn(n, t, d_out, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(svd_knob_grad_dw(x, dy, U, Vh), svd_knob_grad(x, dy, U, Vh, False),
                               rtol=1e-10, atol=1e-10)


# --- one Linear: fused == branch for any shape and rank -----------------------------------------

@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["svd", "lora"]), d_out=st.integers(1, 12), d_in=st.integers(1, 12),
       rank_frac=st.floats(0.01, 1.0), n=st.integers(1, 4), t=st.integers(1, 5), bias=st.booleans(),
       use_hack=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_linear_equals_branch(kind, d_out, d_in, rank_frac, n, t, bias, use_hack, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=bias)
    rank = max(1, round(rank_frac * (min(d_out, d_in) if kind == "svd" else d_in)))
    with tempfile.TemporaryDirectory() as cache:
        knobs = wrap(nn.Sequential(OrderedDict(o_proj=lin)), kind, rank=rank, cache_dir=cache)
    for p in knobs.parameters() + knobs.hack_parameters():
        p.data.normal_(0, 0.3)
    x0, dy = torch.randn(n, t, d_in), torch.randn(n, t, d_out)
    is_student = torch.rand(n) < 0.5

    def run():
        x = x0.clone().requires_grad_(True)
        for p in knobs.parameters():
            p.grad = None
        with knobs.capture(is_student, per_sequence=True) as cap:
            if not use_hack:
                with knobs.ablate_quarantine():
                    y = knobs.model(x)
            else:
                y = knobs.model(x)
            y.backward(dy)
        return y.detach(), x.grad, knobs.grads("main")["o_proj"], cap.per_sequence["o_proj"], cap

    y, dx, g, per_seq, cap = run()
    with branch_path(knobs):
        y_r, dx_r, g_r, per_seq_r, cap_r = run()
    for a, b in ((y, y_r), (dx, dx_r), (g, g_r), (per_seq, per_seq_r),
                 (cap.g_student["o_proj"] + cap.g_teacher["o_proj"], g_r)):
        assert rel(a, b) <= 1e-6 or (a - b).abs().max() <= 1e-6
    assert knobs.modules["o_proj"].delta_hack.grad is None  # the quarantine knob never gets a gradient


# --- a whole model: fused == branch (fp32 to rounding, fp64 exactly); capture == two backwards ----

def spy_dw(monkeypatch) -> list:
    """Count the calls of the weight-gradient route of the svd knob gradient."""
    calls, real = [], fused._project_dw  # the step both the total and the per-source variant take
    monkeypatch.setattr(fused, "_project_dw", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# 9 tokens: the thin projections; 40 tokens: full-rank svd goes through the weight gradient, per source
@pytest.mark.parametrize("kind,rank,t", [("svd", None, 9), ("svd", None, 40), ("svd", 4, 40), ("lora", 4, 9)])
def test_model_grads_equal_branch(kind, rank, t, tmp_path, monkeypatch):
    model, knobs, x, adv = setup(kind, tmp_path, rank=rank, t=t)
    dw = spy_dw(monkeypatch)
    g, cap = step(model, knobs, x, adv, per_sequence=False)
    assert (len(dw) > 0) == (kind == "svd" and rank is None and t == 40)
    _, cap_seq = step(model, knobs, x, adv)  # per-sequence rows: always the thin projections
    with branch_path(knobs):
        g_r, cap_r = step(model, knobs, x, adv)
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(d)])
    # fp32: the two forwards round differently (x·W_effᵀ vs x·Wᵀ + branch), nothing else: measured
    # 3e-7 over all knobs, 1.6e-6 on the worst single module
    assert (flat(g) - flat(g_r)).norm() <= 1e-6 * flat(g_r).norm()
    assert max(rel(g[n], g_r[n]) for n in g) <= 5e-6
    for c, field in ((cap, "g_student"), (cap, "g_teacher"), (cap_seq, "g_student"),
                     (cap_seq, "per_sequence")):
        a, b = getattr(c, field), getattr(cap_r, field)
        assert (flat(a) - flat(b)).norm() <= 1e-6 * flat(b).norm()


@pytest.mark.parametrize("kind,t", [("svd", 9), ("svd", 40), ("lora", 9)])
def test_model_grads_equal_branch_in_fp64(kind, t, tmp_path):
    # in fp64 both paths are the same sums to ~1e-16: any difference in the math itself would show here
    model, knobs, x, adv = setup(kind, tmp_path, dtype=torch.float64, rank=4 if kind == "lora" else None, t=t)
    g, cap = step(model, knobs, x, adv, per_sequence=False)
    with branch_path(knobs):
        g_r, _ = step(model, knobs, x, adv)
    assert max(rel(g[n], g_r[n]) for n in g) <= 1e-12
    loss = per_seq_loss(model, x, adv)
    g_s, g_t = two_backward_split(knobs, loss[STUDENT].sum(), loss[~STUDENT].sum())
    assert max(rel(cap.g_student[n], g_s[n]) for n in g) <= 1e-12
    assert max(rel(cap.g_teacher[n], g_t[n]) for n in g) <= 1e-12


@pytest.mark.parametrize("mask", [[1] * N, [0] * N, [0, 1, 0, 0, 0, 0]])
def test_weight_gradient_route_per_source_equals_two_backwards(mask, tmp_path, monkeypatch):
    model, knobs, x, adv = setup("svd", tmp_path, t=40)
    dw, is_student = spy_dw(monkeypatch), torch.tensor(mask, dtype=torch.bool)
    with knobs.capture(is_student) as cap:
        per_seq_loss(model, x, adv).sum().backward()
    assert dw  # the route under test ran
    loss = per_seq_loss(model, x, adv)
    g_s, g_t = two_backward_split(knobs, loss[is_student].sum(), loss[~is_student].sum())
    for n in g_s:
        torch.testing.assert_close(cap.g_student[n], g_s[n], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(cap.g_teacher[n], g_t[n], rtol=1e-4, atol=1e-6)


# --- the W_eff cache ----------------------------------------------------------------------------

def test_w_eff_is_reused_until_a_value_or_flag_changes(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    m = knobs.modules["model.layers.0.mlp.down_proj"]
    W_eff = m.weight_eff()
    step(model, knobs, x, adv)
    with torch.no_grad(), knobs.zeroed():
        model(x)  # a reference forward: W itself, the cache untouched
    assert m.weight_eff() is W_eff  # micro-batches and the reference forward merge nothing again
    with knobs.ablate_quarantine():
        ablated = m.weight_eff()
        torch.testing.assert_close(ablated, m.base.weight + m.delta_weight(m.delta), rtol=0, atol=1e-6)
    assert m.weight_eff() is not ablated and not torch.equal(m.weight_eff(), ablated)
    with knobs.zeroed():
        assert m.weight_eff() is m.base.weight


@pytest.mark.parametrize("write", ["optimizer", "values_view", "data", "load"])
def test_w_eff_cache_sees_every_write(write, tmp_path):
    model, knobs, x, adv = setup("lora", tmp_path, rank=4)
    m = knobs.modules["model.layers.1.self_attn.q_proj"]
    stale = m.weight_eff()
    if write == "optimizer":
        opt = torch.optim.AdamW(knobs.parameters(), lr=1e-2)
        step(model, knobs, x, adv)
        opt.step()
    elif write == "values_view":  # what projection.project_update does
        knobs.values("main")[m.name].add_(0.1)
    elif write == "data":  # bypasses _version: why the cache compares values
        m.delta_hack.data.mul_(2.0)
    else:  # Knobs.load writes through .data too
        with torch.no_grad():
            for p in knobs.parameters():
                p.add_(1.0)
        knobs.save(tmp_path / "k.safetensors")
        with torch.no_grad():
            for p in knobs.parameters():
                p.sub_(1.0)
        stale = m.weight_eff()
        knobs.load(tmp_path / "k.safetensors")
    fresh = m.weight_eff()
    assert not torch.equal(fresh, stale)
    want = m.base.weight + m.delta_weight(m.delta + m.delta_hack)
    torch.testing.assert_close(fresh, want, rtol=0, atol=1e-6)
    with torch.no_grad(), branch_path(knobs):
        ref = model(x).logits
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, rtol=1e-5, atol=1e-5)


def test_w_eff_merged_under_inference_mode_serves_a_later_grad_forward(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    with torch.inference_mode():
        model(x)  # merges W_eff inside inference mode
    m = knobs.modules["model.layers.0.self_attn.q_proj"]
    assert not m.weight_eff().is_inference() and not m.weight_eff().requires_grad
    for p in knobs.parameters():  # frozen knobs: the plain F.linear path, whose backward saves W_eff
        p.requires_grad_(False)
    h = model.get_input_embeddings()(x).detach().requires_grad_(True)
    model(inputs_embeds=h, use_cache=False).logits.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_backward_frees_w_eff_while_the_graph_output_lives(kind, tmp_path):
    """The fused Function saves W_eff with save_for_backward, so the backward frees it; as a ctx attribute it
    lived as long as the graph (until the training loop rebound its outputs at the next step's forward), one
    extra copy of the wrapped weights under that forward's peak (issue 18)."""
    model, knobs, x, adv = setup(kind, tmp_path)
    m = knobs.modules["model.layers.0.mlp.down_proj"]
    loss = per_seq_loss(model, x, adv).sum()  # the graph: its fused nodes hold every module's W_eff
    alive = weakref.ref(m.weight_eff())
    knobs.release()  # the module's own cache lets go: only the graph still holds it
    assert alive() is not None
    loss.backward()
    gc.collect()
    assert loss.grad_fn is not None and alive() is None  # the output (and its graph) live; W_eff is gone


@pytest.mark.parametrize("kind,rank", [("svd", None), ("svd", 4), ("lora", 4)])
def test_forward_keeps_the_narrower_of_x_and_its_thin_projection(kind, rank, tmp_path):
    """What the fused node saves: h = x·Pᵀ (N, T, R) where R < d_in, else x itself (no copy), and W_eff."""
    _, knobs, _, _ = setup(kind, tmp_path, rank=rank)
    R = 4 if rank else 32  # full svd rank: min(d_out, d_in) = hidden 32 for the down projection (64 -> 32)
    for name, d_in in (("model.layers.0.mlp.down_proj", 64), ("model.layers.0.self_attn.q_proj", 32)):
        m = knobs.modules[name]
        x = torch.randn(2, 5, d_in, requires_grad=True)
        kept, W_eff = m(x).grad_fn.saved_tensors
        assert W_eff is m.weight_eff() or torch.equal(W_eff, m.weight_eff())
        if R < d_in:  # 4 of 32 or 64 inputs; 32 of 64 (svd's full rank on the down projection)
            assert kept.shape == (2, 5, R)
        else:  # q_proj at full svd rank: R = d_in = 32, x kept as is (shared with k_proj and v_proj)
            assert kept.data_ptr() == x.data_ptr()


def test_zero_knobs_merge_to_w_itself(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    knobs = wrap(model, "svd", cache_dir=tmp_path)
    x = torch.randint(0, 64, (2, 5))
    assert all(m.weight_eff() is m.base.weight for m in knobs.modules.values())  # no copy at init
    g, _ = step(model, knobs, torch.randint(0, 64, (N, 5)), torch.ones(N))
    assert all(m.weight_eff() is m.base.weight for m in knobs.modules.values())
    assert any(v.abs().max() > 0 for v in g.values())  # gradients flow at zero knobs
    with torch.no_grad():
        model(x)


# --- gradient checkpointing ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,t", [("svd", 9), ("svd", 40), ("lora", 9)])
def test_checkpointing_keeps_captured_grads(kind, t, tmp_path):
    model, knobs, x, adv = setup(kind, tmp_path, rank=4 if kind == "lora" else None, t=t)
    calls = []
    # a pre-hook: a replay stops early (after its last saved tensor), before the MLP returns
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    g, cap = step(model, knobs, x, adv)
    assert len(calls) == 1
    knobs.gradient_checkpointing(True)
    assert any("forward" in vars(m) for m in checkpointing.layers(model))
    g_c, cap_c = step(model, knobs, x, adv)
    assert len(calls) == 3  # the layer ran again in the backward: checkpointing is on, in eval mode
    for n in g:  # the same ops on recomputed activations: bit for bit
        assert torch.equal(g_c[n], g[n])
        assert torch.equal(cap_c.g_student[n], cap.g_student[n])
        assert torch.equal(cap_c.g_teacher[n], cap.g_teacher[n])
        assert torch.equal(cap_c.per_sequence[n], cap.per_sequence[n])
    with torch.no_grad():
        model(x, use_cache=True)  # sampling-style forwards are not checkpointed (no grad)
    assert len(calls) == 4
    with pytest.raises(RuntimeError, match="backward never reached"):  # fail-fast still works
        with knobs.capture(STUDENT):
            per_seq_loss(model, x, adv)
    knobs.gradient_checkpointing(False)
    assert not any("forward" in vars(m) for m in checkpointing.layers(model))
    step(model, knobs, x, adv)
    assert len(calls) == 6  # 4 + the failed capture's forward + this one, no replay


def test_checkpointing_needs_decoder_layers():
    knobs = wrap(nn.Sequential(OrderedDict(o_proj=nn.Linear(3, 3))), "lora", rank=1)
    with pytest.raises(ValueError, match="no transformers GradientCheckpointingLayer"):
        knobs.gradient_checkpointing(True)
