"""Wall time of the preregistered study with --jobs 1 against --jobs 2, and the projected full study.

Runs a reduced study (`projected-grpo study`, the demo preset on the embedded organism, 1 seed, --steps steps
per run, one leave-one-mode-out fold: 9 + 3 = 12 runs) twice on fresh output directories sharing one warm
cache, once with --jobs 1 and once with --jobs 2, and prints the two wall times side by side. A warm-up study
(1 step per run, untimed) first builds the organism and every V_hack the study needs, so neither timed
side pays for a cold cache. From each side it measures what a run costs under that concurrency:
  step_s      median `time/step` over every step of every run (sampling, grading, backward, update)
  overhead_s  the rest of a run's share of the wall time: slot_s - steps * step_s, where
              slot_s = wall * jobs / runs (process start, model, pool, V_hack load, sandbox, report)
and projects the full preregistered study on the demo preset (every arm and control, no_pool, one fold per
mode the preset trains on, --seeds 3, the preset's run.steps): runs * (overhead_s + steps * step_s) / jobs.

    PYTHONPATH=src .venv/bin/python benchmarks/study_speedup.py [--steps 6] [--cache DIR]

Last line: `RESULT study_speedup=<wall jobs 1 / wall jobs 2> projected_full_study_min=<jobs 2>`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from projected_grpo import presets
from projected_grpo.study import experiment, preregistered

FOLD = "run_tests"


def study(out: pathlib.Path, steps: int, jobs: int, env: dict) -> tuple[float, float]:
    """Run the reduced study; (wall s, children's CPU s)."""
    cmd = [sys.executable, "-m", "projected_grpo.cli", "study", "--preset", "demo", "--seeds", "1",
           "--out", str(out), "--lomo-modes", FOLD, "--jobs", str(jobs), "--run.steps", str(steps)]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"study failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)


def step_times(out: pathlib.Path) -> list[float]:
    return [json.loads(line)["time/step"] for p in sorted(out.glob("*/*-s0/metrics.jsonl"))
            for line in p.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run of the reduced study")
    ap.add_argument("--cache", default="", help="cache root (default: a fresh temporary directory)")
    opt = ap.parse_args()
    demo = presets.PRESETS["demo"]
    runs = sum(len(p.arms) for p in preregistered.parts(demo, experiment.DEMO_ARMS, [FOLD]))
    full_parts = preregistered.parts(demo, experiment.DEMO_ARMS)
    full_runs = 3 * sum(len(p.arms) for p in full_parts)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        env = dict(os.environ, PROJECTED_GRPO_CACHE=opt.cache or str(root / "cache"))
        t0 = time.perf_counter()
        study(root / "warmup", 1, 2, env)  # organism, pools, every V_hack into the cache
        print(f"warm-up (untimed): {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sides = {}
        for jobs in (1, 2):
            wall, cpu = study(root / f"jobs{jobs}", opt.steps, jobs, env)
            step = statistics.median(step_times(root / f"jobs{jobs}"))
            slot = wall * jobs / runs
            sides[jobs] = {"wall": wall, "cpu": cpu, "step": step, "slot": slot,
                           "overhead": slot - opt.steps * step}
            print(f"--jobs {jobs}: {wall:.0f} s", file=sys.stderr)
    steps_full = demo.run.steps
    print(f"reduced study: demo preset, {runs} runs (9 arms + 3 arms without {FOLD}), 1 seed, "
          f"{opt.steps} steps each; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| | wall s | CPU s (all runs) | step s (median) | per-run slot s | overhead s/run | "
          f"projected full study (min): {full_runs} runs x {steps_full} steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    proj = {}
    for jobs, s in sides.items():
        proj[jobs] = full_runs * (s["overhead"] + steps_full * s["step"]) / jobs / 60
        print(f"| --jobs {jobs} | {s['wall']:.0f} | {s['cpu']:.0f} | {s['step']:.2f} | {s['slot']:.1f} | "
              f"{s['overhead']:.1f} | {proj[jobs]:.0f} |")
    verdict = "meets" if proj[2] < 60 else "does not meet"
    print(f"full study ({', '.join(p.name for p in full_parts)}; 3 seeds): projected {proj[1]:.0f} min with "
          f"--jobs 1, {proj[2]:.0f} min with --jobs 2: {verdict} the one-hour goal on this machine")
    speedup = sides[1]["wall"] / sides[2]["wall"]
    print(f"RESULT study_speedup={speedup:.2f} projected_full_study_min={proj[2]:.0f}")


if __name__ == "__main__":
    main()
