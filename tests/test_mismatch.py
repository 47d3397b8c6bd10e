"""objective/mismatch.py: the students' sampler-trainer mismatch, against hand-computed values."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.mismatch import sampler_mismatch


def test_hand_computed_means_over_student_tokens_only():
    # rows: student (2 real tokens), teacher (ignored), student (1 real token, one padding position with an
    # inf that must not leak)
    logp = torch.tensor([[-1.0, -2.0], [-0.1, -0.1], [-0.5, float("-inf")]])
    logp_b = torch.tensor([[-1.5, -2.0], [-3.0, -3.0], [-0.25, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    is_student = torch.tensor([True, False, True])
    s = sampler_mismatch(logp, logp_b, is_student, mask)
    # r on student tokens: 0.5, 0.0, -0.25
    # k3 = e^r - 1 - r: 0.148721, 0, 0.028801 -> mean over 3 tokens 0.059174
    k3 = [math.expm1(0.5) - 0.5, 0.0, math.expm1(-0.25) + 0.25]
    assert math.isclose(float(s["sample/kl"]), sum(k3) / 3, rel_tol=1e-6)
    # |r| mean = (0.5 + 0 + 0.25) / 3 = 0.25
    assert math.isclose(float(s["sample/logratio_abs_mean"]), 0.25, rel_tol=1e-6)


def test_no_student_tokens_reads_zero():
    s = sampler_mismatch(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([False, False]), torch.ones(2, 3))
    assert float(s["sample/kl"]) == 0.0 and float(s["sample/logratio_abs_mean"]) == 0.0


def test_stats_are_detached():
    logp = torch.randn(2, 3, requires_grad=True)
    s = sampler_mismatch(logp, torch.randn(2, 3), torch.tensor([True, True]), torch.ones(2, 3))
    assert not any(v.requires_grad for v in s.values())


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_kl_is_non_negative_and_zero_iff_equal(seed):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    is_student = torch.tensor([True, True, False])
    same = sampler_mismatch(logp, logp.clone(), is_student, mask)
    assert float(same["sample/kl"]) == 0.0 and float(same["sample/logratio_abs_mean"]) == 0.0
    other = sampler_mismatch(logp, logp + 0.3 * torch.randn(3, 5, generator=g), is_student, mask)
    assert float(other["sample/kl"]) >= 0.0
