"""Group-relative advantages: hand-computed examples, invariants, and rejected input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.advantages import (
    ADVANTAGES,
    STD_EPS,
    ZERO_VAR_EPS,
    batch_std_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_variance_mask,
)


def test_grpo_hand_example():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean = 0.5, deviations = [+.5, -.5, -.5, +.5]
    # unbiased std = sqrt((4 * 0.25) / (4 - 1)) = sqrt(1/3) = 0.5773503
    # adv = 0.5 / (0.5773503 + 1e-4) = 0.8658753
    adv, stats = grpo_advantages(r)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([[a, -a, -a, a]]))
    assert abs(a - 0.8658753) < 1e-6
    assert STD_EPS == 1e-4
    assert stats["reward/frac_zero_std"].item() == 0.0
    assert all(not v.requires_grad for v in stats.values())


def test_dr_grpo_hand_example():
    # mean = 0.25 -> adv = R - 0.25, no std division
    adv, _ = dr_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_rloo_hand_example():
    # i=0: baseline = mean(0, 0, 0) = 0 -> 1; i>0: baseline = mean(1, 0, 0) = 1/3 -> -1/3
    adv, _ = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


def test_batch_std_hand_example():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # group means 0.5 and 1 -> centred [[.5, -.5], [0, 0]]
    # batch (unbiased) std of [1, 0, 1, 1]: mean .75, squared devs .0625+.5625+.0625+.0625 = .75,
    # / (4 - 1) = .25 -> std .5
    # adv = .5 / (.5 + 1e-4) = 0.4999000
    adv, stats = batch_std_advantages(r)
    a = 0.5 / 0.5001
    torch.testing.assert_close(adv, torch.tensor([[a, -a], [0.0, 0.0]]))
    assert stats["reward/frac_zero_std"].item() == 0.5


def test_zero_variance_mask_hand_example():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.1, 0.1, 0.1]])
    assert zero_variance_mask(r).tolist() == [True, False, True]


def test_zero_variance_is_the_seeds_max_minus_min_below_eps():
    assert ZERO_VAR_EPS == 1e-6
    # ranges: 5e-7 < 1e-6 -> zero; 2e-6 -> not; 1e-6 exactly -> not (strict <, as the seed's `<`)
    r = torch.tensor([[1.0, 1.0 + 5e-7, 1.0], [1.0, 1.0 + 2e-6, 1.0], [0.0, 1e-6, 0.0]], dtype=torch.float64)
    assert zero_variance_mask(r).tolist() == [True, False, False]
    # Row 0 without the eps test: mean = 1 + 5e-7/3, deviations (-1/3, 2/3, -1/3) * 5e-7, Bessel std
    # = sqrt((2 * (5e-7/3)**2 + (10e-7/3)**2) / 2) = 5e-7/sqrt(3) = 2.887e-7, so grpo would give the
    # middle sample (10e-7/3) / (2.887e-7 + 1e-4) = 3.32e-3 for float noise. With it: exactly 0.
    for name, fn in ADVANTAGES.items():
        adv, stats = fn(r)
        assert (adv[0] == 0).all(), name
        assert (adv[1:].abs().sum(dim=1) > 0).all(), name
        assert abs(stats["reward/frac_zero_std"].item() - 1 / 3) < 1e-7, name  # a float32 mean
    adv, _ = dr_grpo_advantages(r)
    # row 1: mean 1 + 2e-6/3 -> dr_grpo adv = (-2e-6/3, 4e-6/3, -2e-6/3)
    torch.testing.assert_close(adv[1], torch.tensor([-2e-6 / 3, 4e-6 / 3, -2e-6 / 3], dtype=torch.float64))


def test_mixed_student_teacher_group_is_one_matrix():
    # G_s = 2 student rewards [0, 0], G_t = 2 teacher rewards [1, 1]: one group of G = 4, mean 0.5,
    # so the teacher samples set the students' baseline: dr_grpo adv = [-.5, -.5, .5, .5]
    student, teacher = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    adv, _ = dr_grpo_advantages(torch.cat([student, teacher], dim=1))
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5, 0.5, 0.5]]))
    # the student-only group alone has zero variance, hence no signal without the teacher columns
    assert zero_variance_mask(student).item()


_values = st.sampled_from([0.0, 0.1, 0.3, 1.0, -2.5, 7.0])
rewards_st = st.integers(1, 4).flatmap(lambda B: st.integers(2, 6).flatmap(lambda G: st.lists(
    st.lists(_values, min_size=G, max_size=G), min_size=B, max_size=B)))


@settings(max_examples=60, deadline=None)
@given(rows=rewards_st, const_row=st.integers(0, 3), value=st.sampled_from([0.0, 0.1, 1 / 3, 0.7, -5.0]),
       jitter=st.lists(st.floats(0.0, 4e-7), min_size=6, max_size=6))
def test_zero_variance_group_gets_exactly_zero_under_every_estimator(rows, const_row, value, jitter):
    r = torch.tensor(rows, dtype=torch.float64)
    G = r.shape[1]
    # 0.1 / (1/3): group means that do not round-trip exactly; jitter: a spread under ZERO_VAR_EPS
    r[const_row % r.shape[0]] = value + torch.tensor(jitter[:G], dtype=torch.float64)
    assert zero_variance_mask(r)[const_row % r.shape[0]]
    for name, fn in ADVANTAGES.items():
        adv, _ = fn(r)
        assert (adv[const_row % r.shape[0]] == 0).all(), name
        assert torch.isfinite(adv).all(), name


@settings(max_examples=60, deadline=None)
@given(rows=rewards_st)
def test_zero_variance_mask_is_max_minus_min_below_eps(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    want = [max(row) - min(row) < ZERO_VAR_EPS for row in rows]
    assert zero_variance_mask(r).tolist() == want


@settings(max_examples=60, deadline=None)
@given(rows=rewards_st)
def test_estimator_relations(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    G = r.shape[1]
    live = ~zero_variance_mask(r)
    dr, _ = dr_grpo_advantages(r)
    rl, _ = rloo_advantages(r)
    gr, _ = grpo_advantages(r)
    # RLOO = G / (G - 1) * (R - mean): the leave-one-out baseline is a rescaled centring
    torch.testing.assert_close(rl, dr * G / (G - 1))
    # GRPO = Dr.GRPO / (std + eps) row by row; every group's advantages sum to zero
    std = r.std(dim=1, keepdim=True)
    torch.testing.assert_close(gr[live], (dr / (std + STD_EPS))[live])
    torch.testing.assert_close(gr.sum(dim=1), torch.zeros(r.shape[0], dtype=r.dtype))


def test_rloo_group_of_one_rejected_with_reason():
    with pytest.raises(ValueError, match=r"RLOO needs G >= 2.*G=1.*leave-one-out"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_bad_input_rejected(name):
    fn = ADVANTAGES[name]
    with pytest.raises(ValueError, match=r"shape \(B prompts, G group\), got \(4,\)"):
        fn(torch.zeros(4))
    with pytest.raises(ValueError, match="G >= 2"):
        fn(torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"non-finite value, first at \(b, g\)=\(1, 0\)"):
        fn(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]))
    with pytest.raises(TypeError, match="floating"):
        fn(torch.zeros(2, 2, dtype=torch.long))
