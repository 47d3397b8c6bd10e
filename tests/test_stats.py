"""stats.py: t-intervals, paired differences, Holm's step-down and the seeds needed, against hand arithmetic.

Run: pytest tests/test_stats.py
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from projected_grpo import stats


def test_t_interval_hand_computed():
    # xs 1, 2, 6: mean 3; deviations -2, -1, 3 -> squares 4 + 1 + 9 = 14; var 14 / 2 = 7; sd 2.645751
    # t_{2, 0.975} = 4.302653; half-width 4.302653 * 2.645751 / sqrt(3) = 4.302653 * 1.527525 = 6.572411
    iv = stats.t_interval([1.0, 2.0, 6.0])
    assert iv.mean == pytest.approx(3.0) and iv.sd == pytest.approx(2.645751, abs=1e-6) and iv.n == 3
    assert iv.lo == pytest.approx(3 - 6.572411, abs=1e-5) and iv.hi == pytest.approx(3 + 6.572411, abs=1e-5)
    one = stats.t_interval([0.4])
    assert (one.mean, one.lo, one.hi, one.sd) == (0.4, None, None, None)
    with pytest.raises(ValueError, match="no values"):
        stats.t_interval([])


def test_paired_differences_over_shared_keys_and_p_value():
    # seeds 0, 1, 2 shared (seed 3 only in a): diffs 0.5-0.2, 0.6-0.4, 0.9-0.3 = 0.3, 0.2, 0.6
    # mean 0.366667, sd: devs -0.066667, -0.166667, 0.233333 -> squares .004444 + .027778 + .054444 = .086667,
    # / 2 = .043333, sd .208167; t = .366667 / (.208167 / sqrt 3) = .366667 / .120185 = 3.050851, df 2:
    # two-sided p = 0.0928 (scipy.stats.t.sf(3.050851, 2) * 2)
    p = stats.paired({0: 0.5, 1: 0.6, 2: 0.9, 3: 1.0}, {0: 0.2, 1: 0.4, 2: 0.3})
    assert p.keys == (0, 1, 2) and p.diffs == pytest.approx((0.3, 0.2, 0.6))
    assert p.interval.mean == pytest.approx(0.366667, abs=1e-6)
    assert p.interval.sd == pytest.approx(0.208167, abs=1e-6)
    assert p.p == pytest.approx(0.0928, abs=5e-4)
    with pytest.raises(ValueError, match="no shared key"):
        stats.paired({0: 1.0}, {1: 1.0})


def test_t_pvalue_degenerate_cases():
    assert stats.t_pvalue([0.1]) is None
    assert stats.t_pvalue([0.2, 0.2, 0.2]) == 0.0  # no spread, non-zero mean: t = inf
    assert stats.t_pvalue([0.0, 0.0]) == 1.0


def test_holm_hand_computed():
    # m = 4 decided: sorted 0.01 (x4 = .04), 0.02 (x3 = .06), 0.03 (x2 = .06), 0.5 (x1 = .5); None stays None
    assert stats.holm([0.03, None, 0.01, 0.5, 0.02]) == pytest.approx([0.06, None, 0.04, 0.5, 0.06])
    # monotone: 0.04 * 2 = .08 would drop below the first step's .09 (0.03 * 3): raised to .09; capped at 1
    assert stats.holm([0.03, 0.04, 0.9]) == pytest.approx([0.09, 0.09, 0.9])
    assert stats.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    assert stats.holm([]) == []


@given(st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=12))
def test_holm_is_at_least_the_raw_p_and_keeps_the_order(ps):
    adj = stats.holm(ps)
    for p, a in zip(ps, adj):
        assert (p is None) == (a is None)
        if p is not None:
            assert p - 1e-12 <= a <= 1.0
    decided = sorted((p, a) for p, a in zip(ps, adj) if p is not None)
    assert all(a1 <= a2 + 1e-12 for (_, a1), (_, a2) in zip(decided, decided[1:]))


def test_seeds_needed_hand_computed():
    # z_{0.975} + z_{0.8} = 1.959964 + 0.841621 = 2.801585; sd 0.10, delta 0.15: (2.801585 * 0.666667)^2
    # = 1.867723^2 = 3.4884 -> 4
    assert stats.seeds_needed(0.10, 0.15) == 4
    # alpha 0.05 / 10: z_{0.9975} = 2.807034; (2.807034 + 0.841621) * 0.142 / 0.15 = 3.454 -> 11.93 -> 12
    assert stats.seeds_needed(0.142, 0.15, alpha=0.005) == 12
    assert stats.seeds_needed(None, 0.15) is None
    assert stats.seeds_needed(0.0, 0.15) == 2  # never fewer than 2: no interval with 1
    with pytest.raises(ValueError, match="delta"):
        stats.seeds_needed(0.1, 0.0)


def test_interval_format():
    assert stats.Interval(-0.373, -0.52, -0.225, 0.05, 3).fmt() == "-37.3 [-52.0, -22.5]"
    assert stats.Interval(0.1, None, None, None, 1).fmt() == "+10.0 n/a"
    assert math.isclose(stats.LEVEL + stats.ALPHA, 1.0)


def test_cluster_bootstrap_percentile_interval():
    # two clusters of values 0 and 1, stat = mean of the drawn ones: a resample of 2 gives 0, 0.5 or 1 with
    # probability 1/4, 1/2, 1/4, so with 2000 resamples the 2.5% and 97.5% quantiles are 0 and 1
    lo, hi = stats.cluster_bootstrap([0, 1], lambda ids: sum(ids) / len(ids), n=2000, seed=0)
    assert (lo, hi) == (0.0, 1.0)
    # a statistic that does not depend on the draw has a zero-width interval
    assert stats.cluster_bootstrap([3, 4, 5], lambda ids: 0.25) == (0.25, 0.25)
    # seeded: the same seed, the same interval; the draw receives cluster ids only
    def mean(ids):
        return sum(ids) / len(ids)

    assert stats.cluster_bootstrap(list(range(10)), mean, 500, 7) == \
        stats.cluster_bootstrap(list(range(10)), mean, 500, 7)
    with pytest.raises(ValueError, match="no clusters"):
        stats.cluster_bootstrap([], mean)
