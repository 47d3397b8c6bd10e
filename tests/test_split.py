"""Per-source knob gradients from one backward == the seed's two backwards; sum == full gradient."""

from __future__ import annotations

import pytest
import torch
from oracles import two_backward_split
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs.adapters import wrap
from projected_grpo.knobs.split import Capture

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
N, T = 6, 5


def setup(kind, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    knobs = wrap(model, kind, rank=4 if kind == "lora" else None, cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    for p in knobs.parameters():  # away from zero so every term of the gradient is exercised
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    x = torch.randint(0, 64, (N, T), generator=gen)
    adv = torch.randn(N, generator=gen)
    return model, knobs, x, adv


def per_seq_loss(model, x, adv):
    """A GRPO-shaped loss: -adv_n · Σ_t logp(x_{t+1}) per sequence -> (N,)."""
    logp = torch.log_softmax(model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]  # (N, T-1)
    return -adv * logp.sum(-1)


def close(a, b):
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["svd", "lora"])
@pytest.mark.parametrize("mask", [[1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 1], [1] * 6, [0] * 6])
def test_one_backward_equals_two_backwards(kind, mask, tmp_path):
    model, knobs, x, adv = setup(kind, tmp_path)
    is_student = torch.tensor(mask, dtype=torch.bool)
    with knobs.capture(is_student, per_sequence=True) as cap:
        per_seq_loss(model, x, adv).sum().backward()
    full = {n: g.clone() for n, g in knobs.grads("main").items()}
    loss = per_seq_loss(model, x, adv)
    g_s, g_t = two_backward_split(knobs, loss[is_student].sum(), loss[~is_student].sum())
    close(cap.g_student, g_s)
    close(cap.g_teacher, g_t)
    close({n: cap.g_student[n] + cap.g_teacher[n] for n in full}, full)
    close({n: cap.per_sequence[n].sum(0) for n in full}, full)
    assert all(cap.per_sequence[n].shape == (N, knobs.modules[n].knob_dim) for n in full)
    close(knobs.grads("main"), full)  # the oracle leaves .grad = g_s + g_t, like one backward
    assert any(g.abs().max() > 1e-4 for g in g_s.values()) or not any(mask)


def test_per_sequence_row_is_that_sequence_gradient(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    with knobs.capture(torch.ones(N, dtype=torch.bool), per_sequence=True) as cap:
        per_seq_loss(model, x, adv).sum().backward()
    for p in knobs.parameters():
        p.grad = None
    per_seq_loss(model, x, adv)[2].backward()  # sequence 2 alone (no cross-sequence terms in a LM)
    close({n: cap.per_sequence[n][2] for n in knobs.modules}, knobs.grads("main"))


def test_gradient_accumulation_by_adding_captures(tmp_path):
    model, knobs, x, adv = setup("lora", tmp_path)
    masks = [torch.tensor([1, 0, 1], dtype=torch.bool), torch.tensor([0, 0, 1], dtype=torch.bool)]
    total = None
    for i, m in enumerate(masks):  # two microbatches, grads accumulate in .grad
        with knobs.capture(m) as cap:
            per_seq_loss(model, x[3 * i:3 * i + 3], adv[3 * i:3 * i + 3]).sum().backward()
        total = cap if total is None else total + cap
    accumulated = {n: g.clone() for n, g in knobs.grads("main").items()}
    is_student = torch.cat(masks)
    loss = per_seq_loss(model, x, adv)
    g_s, g_t = two_backward_split(knobs, loss[is_student].sum(), loss[~is_student].sum())
    close(total.g_student, g_s)
    close(total.g_teacher, g_t)
    close(accumulated, knobs.grads("main"))
    assert torch.equal(total.is_student, is_student)


def test_several_backwards_in_one_capture_accumulate(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    is_student = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.bool)
    with knobs.capture(is_student) as cap:
        per_seq_loss(model, x, adv).sum().backward()
        per_seq_loss(model, x, adv).sum().backward()  # same batch twice: everything doubles
    with knobs.capture(is_student) as once:
        per_seq_loss(model, x, adv).sum().backward()
    close(cap.g_student, {n: 2 * g for n, g in once.g_student.items()})


def test_reference_forward_under_zeroed_is_not_captured(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    is_student = torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool)
    with knobs.capture(is_student) as alone:
        per_seq_loss(model, x, adv).sum().backward()
    g_alone = {n: g.clone() for n, g in knobs.grads("main").items()}
    for p in knobs.parameters():
        p.grad = None
    with knobs.capture(is_student) as cap:
        loss = per_seq_loss(model, x, adv).sum()
        with knobs.zeroed():
            ref = per_seq_loss(model, x, adv).sum()  # a KL reference: base model, no knob branch
        (loss + 0.5 * ref).backward()  # a real weight: a ref forward through the knobs would add grads
    close(knobs.grads("main"), g_alone)
    close(cap.g_student, alone.g_student)
    close(cap.g_teacher, alone.g_teacher)


def test_capture_fails_fast(tmp_path):
    model, knobs, x, adv = setup("svd", tmp_path)
    with pytest.raises(ValueError, match="N=4 rows"):
        with knobs.capture(torch.ones(4, dtype=torch.bool)):
            per_seq_loss(model, x, adv)
    with pytest.raises(RuntimeError, match="backward never reached"):
        with knobs.capture(torch.ones(N, dtype=torch.bool)):
            per_seq_loss(model, x, adv)
    with pytest.raises(RuntimeError, match="no knob forward"):
        with knobs.capture(torch.ones(N, dtype=torch.bool)):
            pass
    with pytest.raises(RuntimeError, match="second backward"):
        with knobs.capture(torch.ones(N, dtype=torch.bool)):
            loss = per_seq_loss(model, x, adv).sum()
            loss.backward(retain_graph=True)
            loss.backward()
    with pytest.raises(ValueError, match="1-D bool"):
        Capture(torch.ones(N))
    with pytest.raises(RuntimeError, match="already active"):
        with knobs.capture(torch.ones(N, dtype=torch.bool)), knobs.capture(torch.ones(N, dtype=torch.bool)):
            pass
    assert all(m.capture is None for m in knobs.modules.values())  # cleaned up after every failure


@pytest.mark.parametrize("kind", ["svd", "lora"])
def test_bf16_split_matches_grad_to_bf16_precision(kind, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16)
    knobs = wrap(model, kind, rank=4 if kind == "lora" else None, cache_dir=tmp_path)
    x = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    with knobs.capture(torch.tensor([True, False, True, False])) as cap:
        model(x).logits.float().logsumexp(-1).sum().backward()
    for n, g in knobs.grads("main").items():
        assert g.dtype == torch.float32  # fp32 master knobs even on a bf16 model
        # the split accumulates in fp32, autograd's .grad reduces in bf16 (2^-8 ≈ 0.4% per element)
        assert (cap.g_student[n] + cap.g_teacher[n] - g).norm() <= 2e-2 * g.norm()
