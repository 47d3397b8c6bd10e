"""The statistics of every verdict and check: t-intervals, paired differences, Holm's correction, seeds.

Choices (docs/preregistration.md, "Statistics"):
  t_interval    mean ± t_{n-1, 1-α/2} · sd / sqrt(n): exact for normal values, and the usual interval for
                3-10 values (seeds, held-out prompts), where a bootstrap has too few values to resample.
  paired        per-key differences a[k] − b[k] over the keys both have (same seed: same prompts, same
                sampling seeds, so run-to-run noise shared by the two arms cancels), its t-interval and the
                two-sided one-sample t-test's p-value.
  holm          Holm-Bonferroni adjusted p-values over one family of comparisons (a report's, a check's):
                controls the chance of any false "beats" at α without assuming the tests independent.
  seeds_needed  n ≥ ((z_{1-α/2} + z_{1-β}) · σ / δ)², the normal-approximation sample size of a paired
                two-sided test (slightly optimistic at small n, where t replaces z).
  cluster_bootstrap  the percentile interval of a statistic of whole clusters (held-out prompts) resampled
                with replacement: for a statistic that is not a mean of per-cluster values (a pooled AUC),
                where a t-interval has no per-cluster values to use.
Plain numbers in, plain numbers out: no tensors, no config. scipy gives the t distribution; Holm's step-down
is eight lines that scipy does not have (statsmodels does, as a much larger dependency).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from scipy import stats as _sp

LEVEL = 0.95  # two-sided confidence level of every interval
ALPHA = 1 - LEVEL  # family-wise error rate of every Holm family
POWER = 0.8  # 1 - β of seeds_needed


@dataclass(frozen=True)
class Interval:
    """Mean of n values, its two-sided LEVEL t-interval [lo, hi] and sample sd (lo, hi, sd None: n < 2)."""

    mean: float
    lo: float | None
    hi: float | None
    sd: float | None
    n: int

    def fmt(self, scale: float = 100.0, digits: int = 1) -> str:
        ci = ("n/a" if self.lo is None else
              f"[{self.lo * scale:+.{digits}f}, {self.hi * scale:+.{digits}f}]")
        return f"{self.mean * scale:+.{digits}f} {ci}"


def t_interval(xs: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of xs with the two-sided t-interval at `level`; no interval for fewer than 2 values."""
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("t_interval: no values")
    n, mean = len(xs), sum(xs) / len(xs)
    if n < 2:
        return Interval(mean, None, None, None, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(_sp.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, sd, n)


def t_pvalue(xs: Sequence[float]) -> float | None:
    """Two-sided p-value of the one-sample t-test of mean(xs) = 0; None for fewer than 2 values. Values equal
    up to rounding (sd <= 1e-12 of their scale) give 0 when their mean is not 0 and 1 when it is (the t
    statistic is ±inf or 0/0; rates like 0.6 - 0.2 and 0.9 - 0.5 differ in the last bit)."""
    xs = [float(x) for x in xs]
    if len(xs) < 2:
        return None
    iv = t_interval(xs)
    scale = max(1.0, max(abs(x) for x in xs))
    if iv.sd <= 1e-12 * scale:
        return 0.0 if abs(iv.mean) > 1e-12 * scale else 1.0
    return float(_sp.ttest_1samp(xs, 0.0).pvalue)


@dataclass(frozen=True)
class Paired:
    """a − b over the keys both have (e.g. seeds): the differences in key order, their interval and p."""

    keys: tuple
    diffs: tuple[float, ...]
    interval: Interval
    p: float | None


def paired(a: Mapping, b: Mapping) -> Paired:
    """Per-key differences a[k] − b[k] over the shared keys (sorted), their t-interval and t-test p-value.
    Raises when the two share no key (nothing to pair)."""
    keys = tuple(sorted(set(a) & set(b)))
    if not keys:
        raise ValueError(f"paired: no shared key between {sorted(a)} and {sorted(b)}")
    diffs = tuple(float(a[k]) - float(b[k]) for k in keys)
    return Paired(keys, diffs, t_interval(diffs), t_pvalue(diffs))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values, in the input order; None entries (undecided comparisons) are left
    out of the family and stay None. Step-down: the i-th smallest of m is multiplied by m − i (i from 0),
    then made non-decreasing, capped at 1."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), [None] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def seeds_needed(sd: float | None, delta: float, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Smallest n with ((z_{1-α/2} + z_{power}) · sd / delta)² ≤ n (at least 2); None when sd is unknown."""
    if sd is None:
        return None
    if delta <= 0:
        raise ValueError(f"seeds_needed: delta must be > 0, got {delta}")
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return max(2, math.ceil((z * sd / delta) ** 2 - 1e-9))


def cluster_bootstrap(clusters: Sequence[int], stat: Callable[[list[int]], float], n: int = 2000,
                      seed: int = 0, level: float = LEVEL) -> tuple[float, float]:
    """(lo, hi): the two-sided percentile interval at `level` of stat(resample) over n resamples, each as many
    clusters as given, drawn with replacement (scipy.stats.bootstrap with a seeded generator:
    deterministic). stat receives the drawn cluster ids, repeats included. With few clusters (under ~10)
    the interval is too narrow: read it as rough."""
    import numpy as np

    if not clusters:
        raise ValueError("cluster_bootstrap: no clusters")
    ci = _sp.bootstrap((np.asarray(clusters),), lambda ids: float(stat([int(i) for i in ids])),
                       vectorized=False, n_resamples=n, confidence_level=level, method="percentile",
                       rng=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)
