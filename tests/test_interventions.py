"""Interventions on a monitor's verdict (objective/interventions.py): hand-computed batches, invariants.

For each intervention a flagged rollout's reward, advantage and gradient contribution are computed by hand
in the comments; the gradient goes through the loop's own pieces (clip_surrogate, the dr_grpo aggregation).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.advantages import ADVANTAGES, STD_EPS
from projected_grpo.objective.interventions import (
    MASKED,
    adv_stats,
    advantage,
    masked_advantages,
    penalty,
    precision_recall,
    screen,
)
from projected_grpo.objective.losses import AGGREGATIONS, Denominators, clip_surrogate

# one group of four: a hack the grader pays 1.25 (flagged), a well-formed miss 0.25, a solve 1.25, junk 0
R = torch.tensor([[1.25, 0.25, 1.25, 0.0]])
F = torch.tensor([[True, False, False, False]])


def _grads(adv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """d loss / d logp (N, T) of the loop's loss for one group at ratio 1: two tokens per row, dr_grpo
    aggregation with constant 8, rows outside `keep` weighted 0 (the loop's screen)."""
    logp = torch.zeros(4, 2, requires_grad=True)
    mask = torch.ones(4, 2)
    tok, _ = clip_surrogate(logp, logp.detach(), adv.reshape(-1), mask)
    loss, _ = AGGREGATIONS["dr_grpo"](keep.reshape(-1, 1).float() * tok, mask, Denominators(4, 8, 8.0))
    loss.backward()
    return logp.grad


def test_penalty_hand_example():
    # flagged hack: 1.25 - 2 = -0.75; the others unchanged; 1 of 4 rows penalised
    out, stats = penalty(R, F, 2.0)
    torch.testing.assert_close(out, torch.tensor([[-0.75, 0.25, 1.25, 0.0]]))
    assert stats["monitor/penalised_frac"].item() == 0.25
    # its advantage (dr_grpo): mean (-0.75 + 0.25 + 1.25 + 0) / 4 = 0.1875 -> -0.9375 (0.5625 before)
    adv, _ = ADVANTAGES["dr_grpo"](out)
    assert adv[0, 0].item() == pytest.approx(-0.9375)
    # its gradient: d(-A * ratio)/d logp = -A per token, / the constant 8 -> +0.1171875 (descent lowers it)
    g = _grads(adv, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(g[0], torch.full((2,), 0.9375 / 8))


def test_penalty_zero_amount_penalises_nothing():
    out, stats = penalty(R, F, 0.0)
    torch.testing.assert_close(out, R)
    assert stats["monitor/penalised_frac"].item() == 0.0


def test_screen_drop_hand_example_dr_grpo():
    # baseline over the unflagged rows (0.25, 1.25, 0): mean 0.5 -> adv (0, -0.25, 0.75, -0.5)
    adv, keep, stats = screen(R, F, "dr_grpo", "drop")
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.25, 0.75, -0.5]]))
    assert keep.tolist() == [[False, True, True, True]]
    assert stats["monitor/screened_frac"].item() == 0.25
    assert stats["groups/screened_out"].item() == 0.0
    # the flagged row's gradient is exactly 0; a kept row's is -A / 8 per token (row 2: -0.75 / 8)
    g = _grads(adv, keep)
    assert (g[0] == 0).all()
    torch.testing.assert_close(g[2], torch.full((2,), -0.75 / 8))


def test_screen_keep_baseline_hand_example():
    # baseline over all four rows: mean 2.75 / 4 = 0.6875 -> (0, -0.4375, 0.5625, -0.6875)
    adv, keep, _ = screen(R, F, "dr_grpo", "keep")
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.4375, 0.5625, -0.6875]]))
    assert keep.tolist() == [[False, True, True, True]]


def test_screen_drop_hand_example_grpo_and_rloo():
    # grpo over (0.25, 1.25, 0): deviations (-.25, .75, -.5), squares .0625 + .5625 + .25 = .875, / 2 = .4375
    adv, _, _ = screen(R, F, "grpo", "drop")
    s = math.sqrt(0.4375) + STD_EPS
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.25 / s, 0.75 / s, -0.5 / s]]))
    # rloo: kept sum 1.5, n 3: .25 - 1.25/2 = -.375, 1.25 - .25/2 = 1.125, 0 - 1.5/2 = -.75
    adv, _, _ = screen(R, F, "rloo", "drop")
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.375, 1.125, -0.75]]))


def test_screen_can_leave_a_group_without_signal():
    # two hacks flagged, two equal misses left: no spread among the kept rows -> the group teaches nothing
    r = torch.tensor([[1.25, 0.25, 1.25, 0.25]])
    f = torch.tensor([[True, False, True, False]])
    adv, _, stats = screen(r, f, "dr_grpo", "drop")
    assert (adv == 0).all()
    assert stats["groups/screened_out"].item() == 1.0


def test_masked_advantages_one_kept_row_is_no_signal():
    adv, zero = masked_advantages(torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[True, False, False]]),
                                  "dr_grpo")
    assert (adv == 0).all() and zero.tolist() == [True]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0, 1.25, 3.5]), min_size=4, max_size=4),
                min_size=1, max_size=4), st.sampled_from(sorted(MASKED)))
def test_masked_advantages_with_every_row_kept_is_the_estimator(rows, name):
    r = torch.tensor(rows)
    adv, zero = masked_advantages(r, torch.ones_like(r, dtype=torch.bool), name)
    ref, _ = ADVANTAGES[name](r)
    torch.testing.assert_close(adv, ref, atol=1e-6, rtol=1e-5)
    assert zero.tolist() == (ref.abs().amax(1) == 0).tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 1.25]), st.booleans()), min_size=2,
                         max_size=6), min_size=1, max_size=3).filter(lambda g: len({len(x) for x in g}) == 1))
def test_screen_drop_is_the_estimator_on_the_kept_rows_alone(groups):
    r = torch.tensor([[v for v, _ in g] for g in groups])
    f = torch.tensor([[b for _, b in g] for g in groups])
    adv, _, _ = screen(r, f, "dr_grpo", "drop")
    for b in range(len(groups)):
        kept = r[b][~f[b]]
        if len(kept) >= 2 and float(kept.max() - kept.min()) > 0:
            ref, _ = ADVANTAGES["dr_grpo"](kept[None])
            torch.testing.assert_close(adv[b][~f[b]], ref[0])
        else:
            assert (adv[b] == 0).all()
        assert (adv[b][f[b]] == 0).all()


def test_advantage_hand_example():
    # scores (1, 0) centred: (.5, -.5); coef .4 -> shift (.2, -.2); (.5, -.5) -> (.3, -.3)
    out, stats = advantage(torch.tensor([[0.5, -0.5]]), torch.tensor([[1.0, 0.0]]), 0.4)
    torch.testing.assert_close(out, torch.tensor([[0.3, -0.3]]))
    assert stats["monitor/adv_shift"].item() == pytest.approx(0.2)
    # its gradient: -A / 8 per token for the flagged (score 1) row: -0.3 / 8
    adv = torch.tensor([[0.3, -0.3, 0.0, 0.0]])
    g = _grads(adv, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(g[0], torch.full((2,), -0.3 / 8))


def test_advantage_common_score_changes_nothing():
    adv = torch.tensor([[0.5, -0.5, 0.0]])
    out, _ = advantage(adv, torch.full((1, 3), 0.7), 5.0)
    torch.testing.assert_close(out, adv)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 1.25]), st.booleans()), min_size=2, max_size=8),
       st.sampled_from([0.5, 1.0, 2.0]))
def test_advantage_of_binary_scores_under_dr_grpo_is_the_penalty(group, coef):
    # dr_grpo(R - c f) = (R - c f) - mean(R - c f) = dr_grpo(R) - c (f - mean f), when R has a spread
    r = torch.tensor([[v for v, _ in group]], dtype=torch.float64)
    f = torch.tensor([[b for _, b in group]])
    pen, _ = ADVANTAGES["dr_grpo"](penalty(r, f, coef)[0])
    base, _ = ADVANTAGES["dr_grpo"](r)
    mod, _ = advantage(base, f.double(), coef)
    if float(r.max() - r.min()) > 0 and float((r - coef * f).amax() - (r - coef * f).amin()) > 0:
        torch.testing.assert_close(mod, pen)


def test_precision_recall_hand_example():
    # flagged rows 0, 1; hacks rows 0, 2: one true positive of 2 flagged, of 2 hacks
    st_ = precision_recall(torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False]))
    assert {k: v.item() for k, v in st_.items()} == {"monitor/flagged_frac": 0.5, "monitor/precision": 0.5,
                                                     "monitor/recall": 0.5}


def test_precision_recall_undefined_ratios_have_no_key():
    st_ = precision_recall(torch.tensor([False, False]), torch.tensor([False, False]))
    assert set(st_) == {"monitor/flagged_frac"}


def test_adv_stats_and_shapes_checked():
    assert adv_stats(torch.tensor([[1.0, -1.0]]))["adv/abs_max"].item() == 1.0
    with pytest.raises(ValueError, match="same shape"):
        penalty(R, torch.tensor([[True]]), 1.0)
    with pytest.raises(ValueError, match="baseline"):
        screen(R, F, "dr_grpo", "maybe")
    with pytest.raises(KeyError, match="unknown advantage"):
        masked_advantages(R, F, "ppo")
