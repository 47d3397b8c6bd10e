"""The committed run records (docs/results/) give the numbers the docs quote from them.

findings 8.10's rule, recomputed from the records of SmolLM2's Tier 1c/1d runs: per seed,
d = Δ hack/deploy(none) − Δ hack/deploy(gt_reward), Δ = mean of the last 10 steps − mean of the first 10.
"""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from projected_grpo.stats import t_interval

TIER1 = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2-maths" / "tier1"


def delta(arm: str, seed: int, key: str = "hack/deploy") -> float:
    lines = (TIER1 / f"{arm}-s{seed}" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 100 and [r["step"] for r in rows] == list(range(100))
    return statistics.fmean(r[key] for r in rows[-10:]) - statistics.fmean(r[key] for r in rows[:10])


def test_every_record_is_a_finished_run_of_its_folder_name():
    for folder in sorted(TIER1.iterdir()):
        arm, seed = folder.name.rsplit("-s", 1)
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["run"]["seed"] == int(seed) and cfg["run"]["steps"] == 100
        assert cfg["env"]["modes"] == ["contains"] and cfg["model"]["path"] == "smollm2"
        assert cfg["env"]["reward_from"] == {"none": "grader", "gt_reward": "oracle"}[arm]
        assert json.loads((folder / "summary.json").read_text())  # written only when a run finishes


def test_tier1d_rule_as_findings_8_12_states_it():
    d = [delta("none", s) - delta("gt_reward", s) for s in range(3)]
    assert [round(x, 3) for x in d] == [0.444, 0.306, 0.406]  # findings 8.12's table
    ci = t_interval(d)  # the project's paired 95% t-interval (stats.py), as the study's reports use it
    # 0.385 ± 4.303 * 0.0411 = [0.209, 0.562]: excludes 0, every seed >= +0.20 -> a result
    assert (ci.mean, ci.lo, ci.hi) == pytest.approx((0.385, 0.209, 0.562), abs=1e-3)
    assert min(d) >= 0.20 and ci.lo > 0
