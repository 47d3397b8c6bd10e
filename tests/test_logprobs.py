"""Chunked per-token log-probs / entropy: equal to log_softmax().gather(), same gradients, no fp32 copy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.logprobs import entropy_from_logits, token_logprobs


def _reference(logits, targets, temperature=1.0):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def test_hand_example():
    # logits [0, ln 2, ln 3] -> softmax [1/6, 2/6, 3/6]; target 2 -> log(1/2) = -0.6931472
    # entropy = -(1/6 ln 1/6 + 1/3 ln 1/3 + 1/2 ln 1/2) = .2986266 + .3662041 + .3465736 = 1.0114043
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)]]])
    assert abs(token_logprobs(logits, torch.tensor([[2]])).item() - math.log(0.5)) < 1e-6
    assert abs(entropy_from_logits(logits).item() - 1.0114043) < 1e-6
    # temperature 2 halves the logits: softmax of [0, ln 2 / 2, ln 3 / 2] = [1, 1.4142, 1.7321] / 4.1463
    # -> p(y=2) = 1.7321 / 4.1463 = 0.4177377, log = -0.8729016
    assert abs(token_logprobs(logits, torch.tensor([[2]]), temperature=2.0).item() + 0.8729016) < 1e-6


@settings(max_examples=30, deadline=None)
@given(N=st.integers(1, 3), T=st.integers(1, 6), V=st.integers(2, 40),
       chunk=st.sampled_from([None, 1, 2, 3, 7, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), temperature=st.sampled_from([1.0, 0.7]),
       seed=st.integers(0, 2**31 - 1))
def test_equals_log_softmax_gather_values_and_gradients(N, T, V, chunk, dtype, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(N, T + 1, V, generator=g) * 4).to(dtype).requires_grad_(True)
    logits = full[:, :-1]  # non-contiguous, as in logits[:, :-1] of a causal LM
    targets = torch.randint(0, V, (N, T), generator=g)
    w = torch.randn(N, T, generator=g)
    logp = token_logprobs(logits, targets, temperature=temperature, chunk=chunk)
    ent = entropy_from_logits(logits, temperature=temperature, chunk=chunk)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_logp, ref_ent = _reference(logits, targets, temperature)
    torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=1e-6)
    # entropy = logsumexp(z) - sum p z subtracts two float32 numbers of size max|z|, so its rounding grows
    # with the logits (z = logits / T up to ~25 here): a found case differed by 2.1e-5 at max|z| ~17
    zmax = float(logits.detach().float().abs().max()) / temperature
    torch.testing.assert_close(ent, ref_ent, atol=2e-5 + 4e-6 * zmax, rtol=1e-5)
    (g1,) = torch.autograd.grad((logp * w).sum() + (ent * w).sum(), full)
    (g2,) = torch.autograd.grad((ref_logp * w).sum() + (ref_ent * w).sum(), full)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    assert g1.dtype == dtype
    torch.testing.assert_close(g1.float(), g2.float(), **tol)


def _saved_bytes(fn):
    """fp32 bytes that autograd keeps for backward while fn() builds its graph."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, [(t.dtype, t.numel()) for t in saved]


def test_no_full_fp32_copy_kept_for_backward():
    N, T, V = 2, 8, 1000
    logits = torch.randn(N, T, V, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (N, T))
    for fn in (lambda: token_logprobs(logits, targets, chunk=4),
               lambda: entropy_from_logits(logits, chunk=4)):
        _, saved = _saved_bytes(fn)
        big_fp32 = [s for s in saved if s[0] == torch.float32 and s[1] >= N * T * V // 4]
        assert big_fp32 == [], saved
    # the naive path this replaces does keep one (the check can fail)
    _, saved = _saved_bytes(lambda: _reference(logits, targets)[0])
    assert any(s == (torch.float32, N * T * V) for s in saved)


def test_entropy_with_a_masked_logit():
    # logits [0, 0, -inf]: p = [1/2, 1/2, 0], H = ln 2 (the p = 0 term counts 0, not 0 * -inf = nan);
    # the gradient is that of [0, 0] with 0 for the masked token: -p (x - E x) = 0 at x = [0, 0]
    x = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(x)
    torch.testing.assert_close(h, torch.tensor([[math.log(2)]]))
    (g,) = torch.autograd.grad(h.sum(), x)
    assert g.tolist() == [[[0.0, 0.0, 0.0]]]
    # [1, 0, -inf]: p = [e/(e+1), 1/(e+1), 0], E x = e/(e+1); dH/dx_0 = -p0 (1 - E x) = -e/(e+1)^2
    x = torch.tensor([[[1.0, 0.0, -math.inf]]], requires_grad=True)
    (g,) = torch.autograd.grad(entropy_from_logits(x).sum(), x)
    e = math.e
    torch.testing.assert_close(g, torch.tensor([[[-e / (e + 1) ** 2, e / (e + 1) ** 2, 0.0]]]))


def test_bad_input_rejected():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) != logits \(N, T\) = \(2, 3\)"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 5\), got range \[0, 5\]"):
        token_logprobs(logits, torch.tensor([[0, 1, 5], [0, 0, 0]]))
    with pytest.raises(TypeError, match="int64"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"logits must be \(N, T, V\)"):
        entropy_from_logits(torch.zeros(6, 5))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), chunk=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        entropy_from_logits(logits, temperature=0.0)
