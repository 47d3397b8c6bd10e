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
    batch_std_advantages,
    dr_grpo_advantages,
    get_advantage,
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
@given(rows=rewards_st, const_row=st.integers(0, 3), value=st.sampled_from([0.0, 0.1, 1 / 3, 0.7, -5.0]))
def test_zero_variance_group_gets_exactly_zero_under_every_estimator(rows, const_row, value):
    r = torch.tensor(rows, dtype=torch.float32)
    r[const_row % r.shape[0]] = value  # 0.1 / (1/3): group means that do not round-trip exactly
    for name, fn in ADVANTAGES.items():
        adv, _ = fn(r)
        assert (adv[const_row % r.shape[0]] == 0).all(), name
        assert torch.isfinite(adv).all(), name


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


def test_unknown_estimator_lists_known_names():
    known = "known: batch_std, dr_grpo, grpo, rloo"
    with pytest.raises(KeyError, match=f"unknown advantage estimator 'ppo'; {known}"):
        get_advantage("ppo")
    assert get_advantage("rloo") is rloo_advantages
