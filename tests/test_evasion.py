"""The bench's evasion table (study/evasion.py): a monitor's recall early and late, the hack's form.

Run: pytest tests/test_evasion.py
"""

from __future__ import annotations

import pytest

from projected_grpo.study import evasion

E, L = evasion.EARLY, evasion.LATE  # 30, 50


def run(recall_early, recall_late, hack_late, hedge_late, steps=100, flagged=0.1):
    """Metric rows of one run: recall alternates the two values of recall_early over the first E steps and
    is recall_late over the last L (absent at odd steps there, as at a step with no hack); hack/deploy and
    detect/hedge/deploy constant over the last L steps, 0.5 / 0.9 before."""
    rows = []
    for s in range(steps):
        r = {"step": s, "monitor/flagged_frac": flagged, "hack/deploy": 0.5, "detect/hedge/deploy": 0.9,
             "detect/grade_error/deploy": 0.0}
        if s < E:
            r["monitor/recall"] = recall_early[s % 2]
        if s >= steps - L:
            r["hack/deploy"], r["detect/hedge/deploy"] = hack_late, hedge_late
            if s % 2 == 0 and recall_late is not None:
                r["monitor/recall"] = recall_late
        rows.append(r)
    return rows


def test_run_windows_hand_example():
    rows = run((0.2, 0.4), 0.0, 0.7, 0.0)
    w = evasion.run_windows(list(reversed(rows)), ["monitor/recall", "hack/deploy", "detect/hedge/deploy"])
    # first 30 steps: recall 0.2, 0.4, ... -> 0.3; last 50: 0.0 at the 25 even steps that logged it
    assert w["monitor/recall"] == pytest.approx((0.3, 0.0))
    # hack: 0.5 over the first 30 steps (all before the last 50 of 100), 0.7 over the last 50
    assert w["hack/deploy"] == pytest.approx((0.5, 0.7))
    assert w["detect/hedge/deploy"] == pytest.approx((0.9, 0.0))
    no_late_hack = run((0.2, 0.4), None, 0.7, 0.0)
    assert evasion.run_windows(no_late_hack, ["monitor/recall"])["monitor/recall"][1] is None


def test_detector_keys_leave_out_grade_errors():
    assert evasion.detector_keys(run((0.2, 0.4), 0.0, 0.7, 0.0)) == ["detect/hedge/deploy"]


def test_table_hand_example():
    md = evasion.table({
        # seeds: recall 0.3 -> 0.0 and 0.5 -> 0.1 (mean 0.4 -> 0.05, SEM |a - b| / 2 = 0.1 and 0.05);
        # hack 0.7 / 0.5 (0.6 ± 0.1), hedge 0.0 / 0.2 (0.1 ± 0.1)
        "penalty:detector": [run((0.2, 0.4), 0.0, 0.7, 0.0), run((0.4, 0.6), 0.1, 0.5, 0.2)],
        # a seed with no hack late: recall late from one seed only
        "screen:direction@random": [run((0.2, 0.4), None, 0.0, 0.0), run((0.2, 0.4), 0.8, 0.2, 0.2)],
        "none": [[{k: v for k, v in r.items() if not k.startswith("monitor/")} for r in
                  run((0, 0), None, 0.9, 0.8)]] * 2})
    head, rule, pen, scr, none = md.splitlines()
    assert head == ("| intervention | monitor | seeds | recall, first 30 -> last 50 steps | flagged, "
                    "first 30 -> last 50 | hack, last 50 | hedge, last 50 |")
    assert rule == "|---|---|---|---|---|---|---|"
    assert pen == ("| penalty | detector | 2 | 0.400 ± 0.100 -> 0.050 ± 0.050 | "
                   "0.100 ± 0.000 -> 0.100 ± 0.000 | 0.600 ± 0.100 | 0.100 ± 0.100 |")
    assert scr.startswith("| screen | direction@random | 2 | 0.300 ± 0.000 -> 0.800 ± n/a (n 1) |")
    assert none == "| none | - | 2 | - | - | 0.900 ± 0.000 | 0.800 ± 0.000 |"
