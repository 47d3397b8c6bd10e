"""objective/schedule.py: the one learning-rate schedule (training loop and organism warm-up), by hand.

Run: .venv/bin/pytest -q tests/test_schedule.py
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from projected_grpo.objective.schedule import lr_at


def test_warmup_then_cosine_by_hand():
    # 100 steps, warm-up 5: (step + 1) / 5 of the peak (0.2, 0.4, ... 1.0), then cosine toward 0.1 * peak
    lr = lambda s: lr_at(s, peak=1.0, total=100, warmup=5, floor_frac=0.1)
    assert lr(0) == pytest.approx(0.2) and lr(4) == pytest.approx(1.0)
    assert lr(5) == pytest.approx(1.0)  # cos(0) = 1
    # 47 of 95 decay steps: 0.1 + 0.9 * (1 + cos(pi * 47 / 95)) / 2
    assert lr(52) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 47 / 95)) / 2)
    assert lr(100) == pytest.approx(0.1)  # the floor, at step = total


def test_no_warmup_starts_at_the_peak_and_floor_zero_decays_to_zero():
    assert lr_at(0, peak=0.3, total=10, warmup=0, floor_frac=0.0) == 0.3
    assert lr_at(10, peak=0.3, total=10, warmup=0, floor_frac=0.0) == pytest.approx(0.0, abs=1e-12)


@given(total=st.integers(1, 500), warmup=st.integers(0, 50), floor=st.floats(0.0, 1.0))
def test_between_floor_and_peak_and_non_increasing_after_warmup(total, warmup, floor):
    lrs = [lr_at(s, peak=1.0, total=total, warmup=warmup, floor_frac=floor) for s in range(total)]
    assert all(0.0 <= x <= 1.0 + 1e-12 for x in lrs)
    after = lrs[warmup:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))
