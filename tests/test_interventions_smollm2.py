"""The bench's monitors and interventions on a real Hugging Face model (slow): SmolLM2-135M-Instruct on the
maths loophole, through the same config sections as on the organisms (study/arms.py), one step each: every
intervention (penalty, screen, advantage, inoculation's second prompt, the bounded projection) and every kind
of monitor (the oracle's flag degraded, the environment's detector, and the two that read the model itself:
the probe's hidden states, the direction monitor's per-rollout knob gradients) at least once.

Needs `projected-grpo get-model smollm2` (skips without it). Run: .venv/bin/pytest -q -m slow
tests/test_interventions_smollm2.py
"""

from __future__ import annotations

import json
import math

import pytest

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.run import intervene, metrics
from projected_grpo.run import train as T
from projected_grpo.study import arms


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("arm", ["screen:direction", "advantage:probe", "inoculation", "penalty:degraded90",
                                 "screen:detector", "erase_bounded"])
def test_a_bench_arm_trains_smollm2(smollm2_dir, smollm2_cache, tmp_path, monkeypatch, arm):
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(smollm2_cache))
    base = C.replace(presets.SMOLLM2_MATH_CPU, model={"path": str(smollm2_dir)},
                     env={"modes": ("contains",), "max_problems": 16},
                     rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16},
                     monitor={"probe_problems": 8},
                     run={"steps": 1, "checkpoint_every": 1, "eval_every": 0, "dir": str(tmp_path / "run")})
    T.train(C.replace(base, **arms.arm_sections(arm)))
    (row,) = metrics.read_rows(tmp_path / "run" / metrics.METRICS_FILE)
    assert math.isfinite(row["loss/policy"]) and math.isfinite(row["grad/norm"])
    if ":" in arm:  # a monitor scored the step's 8 rollouts of SmolLM2's own samples
        record = json.loads((tmp_path / "run" / intervene.MONITOR_FILE).read_text())
        assert record["intervention"] == arm.split(":")[0]
        assert 0.0 <= row["monitor/flagged_frac"] <= 1.0
    elif arm == "inoculation":  # trained under its prompt (its mechanics: tests/test_intervene.py)
        saved = json.loads((tmp_path / "run" / "config.json").read_text())
        assert saved["monitor"]["intervention"] == "inoculation"
    else:  # erase_bounded: the gradient erased along V_hack; Adam's per-coordinate step still moves the knob
        # along V, and the clamp takes that off, leaving it at or behind its start (docs/metrics.md)
        assert row["proj/fired_frac"] > 0.0 and row["proj/cout"] < 1e-3 * row["proj/cin"]
        assert row["knob/v_clamped"] > 0.0 and row["knob/v_coef"] <= 0.0
