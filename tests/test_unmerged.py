"""Low-rank knobs trained unmerged (fused.SVDBranch / LoRABranch, chosen by KnobLinear.unmerged): the same
gradients and per-source split as the branch oracle and the two-backward split, bit for bit under
checkpointing, exactly the base model at zero knobs, and no W_eff held outside Knobs.merged()."""

from __future__ import annotations

import pytest
import torch
from oracles import branch_path, two_backward_split
from test_fused import SMALL, STUDENT, N, per_seq_loss, rel, setup, step
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs.adapters import wrap
from projected_grpo.sampling.packed import PackedLM


def test_which_modules_run_unmerged(tmp_path):
    # unmerged iff 8 R (d_in + d_out) <= d_in d_out. q_proj 32 -> 32 (1024): rank 2 gives 8 * 2 * 64 = 1024,
    # unmerged (the bound is inclusive), rank 3 gives 1536, merged; up_proj 32 -> 64 (2048): rank 2 gives
    # 8 * 2 * 96 = 1536, unmerged, rank 3 gives 2304, merged; full svd rank (32) is always merged
    for kind, rank, unmerged in (("svd", 1, True), ("lora", 2, True), ("svd", 3, False), ("lora", 3, False),
                                 ("svd", None, False)):
        knobs = wrap(LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), kind, rank=rank, cache_dir=tmp_path)
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
            assert knobs.modules[name].unmerged is unmerged, (kind, rank, name)


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_grads_equal_the_branch_oracle(kind, tmp_path):
    model, knobs, x, adv = setup(kind, tmp_path, rank=1)
    assert all(m.unmerged for m in knobs.modules.values())
    g, cap = step(model, knobs, x, adv, per_sequence=False)
    _, cap_seq = step(model, knobs, x, adv)
    with branch_path(knobs):
        g_r, cap_r = step(model, knobs, x, adv)
    # the same sums in another order (x·Wᵀ + branch in both; the oracle's branch is written differently)
    assert max(rel(g[n], g_r[n]) for n in g) <= 5e-6
    for c, field in ((cap, "g_student"), (cap, "g_teacher"), (cap_seq, "per_sequence")):
        a, b = getattr(c, field), getattr(cap_r, field)
        assert max(rel(a[n], b[n]) for n in a) <= 5e-6


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_per_source_split_equals_two_backwards_in_fp64(kind, tmp_path):
    model, knobs, x, adv = setup(kind, tmp_path, dtype=torch.float64, rank=1)
    g, cap = step(model, knobs, x, adv, per_sequence=False)
    loss = per_seq_loss(model, x, adv)
    g_s, g_t = two_backward_split(knobs, loss[STUDENT].sum(), loss[~STUDENT].sum())
    assert max(rel(cap.g_student[n], g_s[n]) for n in g) <= 1e-12
    assert max(rel(cap.g_teacher[n], g_t[n]) for n in g) <= 1e-12


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_checkpointing_is_bit_for_bit(kind, tmp_path):
    model, knobs, x, adv = setup(kind, tmp_path, rank=1)
    g, cap = step(model, knobs, x, adv)
    knobs.gradient_checkpointing(True)
    g_c, cap_c = step(model, knobs, x, adv)
    for n in g:
        assert torch.equal(g_c[n], g[n]) and torch.equal(cap_c.per_sequence[n], cap.per_sequence[n])


def test_zero_knobs_are_the_base_model_and_no_w_eff_is_held(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    x = torch.randint(0, 64, (N, 7))
    with torch.no_grad():
        base = model(x).logits
    knobs = wrap(model, "svd", rank=1, cache_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x).logits, base)
    logits = model(x).logits  # with grad: the branch Function at zero knobs
    assert torch.equal(logits.detach(), base)
    step(model, knobs, x, torch.ones(N))
    for p in knobs.parameters():
        p.data.add_(0.01)
    step(model, knobs, x, torch.ones(N))
    assert all(m._eff is None for m in knobs.modules.values())  # training merged nothing
    with torch.no_grad():
        outside = model(x).logits
        with knobs.merged():
            assert all(m._pinned[1] is None for m in knobs.modules.values())  # merged on first use only
            PackedLM(model, rows=N)  # copies each W_eff to bf16 without pinning it
            assert all(m._pinned[1] is None for m in knobs.modules.values())
            inside = model(x).logits  # the decode's forwards: merged once and pinned
            assert all(m._pinned[1] is not None for m in knobs.modules.values())
    assert all(m._pinned is None and m._eff is None for m in knobs.modules.values())
    assert rel(inside, outside) < 1e-5  # W_eff rounds differently from the branch, in the last bits
