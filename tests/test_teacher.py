"""objective/teacher.py: how teacher rows enter the loss (imitation, importance, exclude), by hand.

Run: .venv/bin/pytest -q tests/test_teacher.py
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.objective.losses import clip_surrogate
from projected_grpo.objective.teacher import TEACHER_MODES

LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])  # row 0 student, row 1 teacher
LOGP_B = torch.tensor([[-1.0, -2.0], [-1.0, -0.1]])
IS_S = torch.tensor([True, False])
MASK = torch.ones(2, 2)


def test_imitation_forces_ratio_one():
    logp_old, w, stats = TEACHER_MODES["imitation"](LOGP, LOGP_B, IS_S, MASK, 2.0)
    assert torch.equal(torch.exp(LOGP - logp_old), torch.ones(2, 2)) and torch.equal(w, torch.ones(2, 2))
    assert stats["teacher/mode"] == "imitation" and float(stats["teacher/ratio_mean"]) == 1.0


def test_importance_ratio_from_stored_logp_truncated():
    logp_old, w, stats = TEACHER_MODES["importance"](LOGP, LOGP_B, IS_S, MASK, 1.2)
    # teacher tokens: rho = exp(-0.5 - -1.0) = exp(0.5) = 1.6487 -> truncated to 1.2;
    #                 rho = exp(-0.5 - -0.1) = exp(-0.4) = 0.6703 (kept). Student weights stay 1.
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [1.2, math.exp(-0.4)]]))
    ratio_mean = torch.tensor((math.exp(0.5) + math.exp(-0.4)) / 2)  # untruncated rho, over teacher tokens
    torch.testing.assert_close(stats["teacher/ratio_mean"], ratio_mean)
    assert float(stats["teacher/clip_frac"]) == 0.5  # 1 of the 2 teacher tokens truncated
    assert torch.equal(logp_old, LOGP)


def test_exclude_teacher_tokens_carry_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    logp_old, w, _ = TEACHER_MODES["exclude"](logp, LOGP_B, IS_S, MASK, 2.0)
    loss_tok, _ = clip_surrogate(logp, logp_old, torch.tensor([1.0, -1.0]), MASK)
    (w * loss_tok).sum().backward()
    # on-policy (ratio 1): d(-r A)/dlogp = -A = -1 on the student row; teacher row weight 0
    assert torch.equal(logp.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 0), min_size=4, max_size=4), st.lists(st.floats(-5, 0), min_size=4, max_size=4),
       st.floats(1.0, 5.0))
def test_teacher_modes_leave_students_on_policy(lp, lb, trunc):
    logp, logp_b = torch.tensor(lp).reshape(2, 2), torch.tensor(lb).reshape(2, 2)
    for fn in TEACHER_MODES.values():
        logp_old, w, _ = fn(logp, logp_b, IS_S, MASK, trunc)
        assert torch.equal(logp_old[0], logp[0]) and torch.equal(w[0], torch.ones(2))  # student row untouched
        assert (w >= 0).all() and (w <= max(trunc, 1.0)).all()
