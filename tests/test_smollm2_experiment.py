"""The real-model path end to end (slow, issue 19): SmolLM2-135M-Instruct samples its own teacher pool,
V_hack is extracted from its own gradients, arms `none` and `erase` train a few steps, the report is written.

Needs `projected-grpo get-model smollm2` (skips without it). Measured numbers: docs/benchmarks.md,
"Real-model experiment". Run: .venv/bin/pytest -q -m slow tests/test_smollm2_experiment.py
"""

from __future__ import annotations

import json
import math
import time

import pytest

from projected_grpo.cli import main
from projected_grpo.run import metrics
from projected_grpo.store import read_jsonl


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_teacher_pool_v_hack_and_two_arms_end_to_end(smollm2_dir, smollm2_cache, tmp_path,
                                                              monkeypatch, capsys):
    model_dir = smollm2_dir
    monkeypatch.setenv("PROJECTED_GRPO_CACHE", str(smollm2_cache))
    common = ["--preset", "smollm2-cpu", "--model", str(model_dir), "--rollout.max-new-tokens", "64"]

    t0 = time.perf_counter()
    pool = tmp_path / "pool.jsonl"
    assert main(["build-pool", *common, "--source", "teacher", "--samples", "2", "--out", str(pool)]) == 0
    rows = [row for _, row in read_jsonl(pool)]
    t_pool = time.perf_counter() - t0
    # the model's own samples, graded, with the log-probs they were sampled under (loss.teacher importance)
    assert len(rows) == 6 * 2
    assert all(r["logp_behaviour"] and len(r["logp_behaviour"]) == len(r["completion_ids"]) for r in rows)

    out = tmp_path / "sweep"
    argv = ["experiment", *common, "--arms", "none,erase", "--seeds", "1", "--out", str(out),
            "--pool.path", str(pool), "--run.steps", "2", "--run.checkpoint-every", "2"]
    assert main(argv) == 0
    t_all = time.perf_counter() - t0
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert "## Verdicts" in md and "erase" in printed
    for arm in ("none", "erase"):
        (run,) = [d for d in out.iterdir() if d.is_dir() and d.name.startswith(arm + "-")]
        rows = metrics.read_rows(run / metrics.METRICS_FILE)
        assert [r["step"] for r in rows] == [0, 1]
        assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["proj/cin"]) for r in rows)
        summary = json.loads((run / metrics.SUMMARY_FILE).read_text())
        print(f"{arm}: steps {summary['steps']}, s/step {[round(r['time/step'], 1) for r in rows]}, "
              f"proj/cin {[round(r['proj/cin'], 4) for r in rows]}, proj/cout "
              f"{[round(r['proj/cout'], 4) for r in rows]}, hack/deploy {summary['hack/deploy']:.3f}, "
              f"solve/deploy {summary['solve/deploy']:.3f}, zero-variance groups "
              f"{[r['groups/zero_std'] for r in rows]}, grad/norm {[round(r['grad/norm'], 4) for r in rows]}")
    erase = metrics.read_rows(next(out.glob("erase-*")) / metrics.METRICS_FILE)
    assert all(r["proj/cout"] <= 1e-6 for r in erase)  # erase: no hack-ward gradient left on the main knob
    print(f"SmolLM2 experiment: teacher pool {t_pool:.0f} s, everything {t_all:.0f} s")
