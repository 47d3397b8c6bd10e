"""Wall time of the preregistered study with --jobs 1 against --jobs 2, and the projected full study.

Runs a reduced study (`projected-grpo study` with its default arms: the demo preset on the embedded organism,
1 seed, --steps steps per run, one leave-one-mode-out fold, so 7 + 2 = 9 runs: no_pool is none on the demo
preset and the fold borrows main's none) on fresh output directories sharing one
warm cache, once with --jobs 1 and once with --jobs 2, and prints the two wall times side by side. An
untimed warm-up study (1 step per run) first builds the organism and every V_hack the study needs, so no
timed side pays for a cold cache. A third side (--jobs 1, 2 steps) gives the CPU a step costs.

Projections of the full preregistered study on the demo preset (`study --preset demo --seeds 3`: the
preregistered arms and controls, one fold per mode the preset trains on, 3 seeds, the preset's run.steps;
runs trained once as the study trains them, preregistered.trained_runs):
  measured   runs * (overhead_s + steps * step_s) / jobs, from each side's own figures under its load:
             step_s the median `time/step` of every step of every run; overhead_s the rest of a run's
             share of the wall time, wall * jobs / runs - steps * step_s (process start, model, pool,
             V_hack load, sandbox, report)
  CPU bound  the study's CPU time / 2 cores: what --jobs 2 reaches on an otherwise idle 2-core machine
             when the two runs keep both cores busy (a run is one torch thread, and grades only while it
             waits), from CPU per step and per run overhead fitted on the 2- and --steps-step sides
On shared cores the measured figures include other tenants' load: the CPU/wall column says how many
cores the study's processes actually got. Both projections scale a run's first --steps steps, which are
slower than a 200-step run's average (completions shorten as the organism learns short hacks), so they
overestimate: time the study itself (`projected-grpo study --preset demo --seeds 3 --jobs 2`) to answer
the one-hour question.

    PYTHONPATH=src .venv/bin/python benchmarks/study_speedup.py [--steps 6] [--cache DIR]

Last line: `RESULT study_speedup=<wall jobs 1 / wall jobs 2> projected_min=<measured, jobs 2>
projected_cpu_bound_min=<CPU / 2 cores>`.
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
from projected_grpo.study import preregistered

FOLD = "run_tests"
SHORT = 2


def study(out: pathlib.Path, steps: int, jobs: int, env: dict) -> dict[str, float]:
    """Run the reduced study: wall s, CPU s of every process it started, median step s."""
    cmd = [sys.executable, "-m", "projected_grpo.cli", "study", "--preset", "demo", "--seeds", "1",
           "--out", str(out), "--lomo-modes", FOLD, "--jobs", str(jobs), "--run.steps", str(steps)]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"study failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    steps_s = [json.loads(line)["time/step"] for p in sorted(out.glob("*/*-s0/metrics.jsonl"))
               for line in p.read_text().splitlines()]
    return {"wall": wall, "cpu": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "step": statistics.median(steps_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run of the reduced study")
    ap.add_argument("--cache", default="", help="cache root (default: a fresh temporary directory)")
    opt = ap.parse_args()
    demo = presets.PRESETS["demo"]
    reduced = preregistered.parts(demo, preregistered.LOMO_ARMS, [FOLD])
    runs = preregistered.trained_runs(demo, reduced, [0])
    full_parts = preregistered.parts(demo, preregistered.LOMO_ARMS)
    full_runs, full_steps = preregistered.trained_runs(demo, full_parts, [0, 1, 2]), demo.run.steps
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        env = dict(os.environ, PROJECTED_GRPO_CACHE=opt.cache or str(root / "cache"))
        warm = study(root / "warmup", 1, 2, env)  # organism, pools, every V_hack into the cache
        print(f"warm-up (untimed: fills the cache): {warm['wall']:.0f} s", file=sys.stderr)
        sides = {}
        for jobs in (1, 2):
            sides[jobs] = study(root / f"jobs{jobs}", opt.steps, jobs, env)
            print(f"--jobs {jobs}: {sides[jobs]['wall']:.0f} s", file=sys.stderr)
        short = study(root / "short", SHORT, 1, env)
    # CPU per step and per run overhead: a line through the 2-step and --steps-step sides at --jobs 1
    cpu_step = (sides[1]["cpu"] - short["cpu"]) / (runs * (opt.steps - SHORT))
    cpu_overhead = short["cpu"] / runs - SHORT * cpu_step
    cpu_bound = full_runs * (cpu_overhead + full_steps * cpu_step) / 2 / 60
    print(f"reduced study: demo preset, {runs} runs ({', '.join(p.name for p in reduced)}), 1 seed, "
          f"{opt.steps} steps each, warm cache; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"| | wall s | CPU s | CPU/wall (cores got) | step s (median) | overhead s/run | projected full "
          f"study, min ({full_runs} runs x {full_steps} steps) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    proj = {}
    for jobs, s in sides.items():
        overhead = s["wall"] * jobs / runs - opt.steps * s["step"]
        proj[jobs] = full_runs * (overhead + full_steps * s["step"]) / jobs / 60
        print(f"| --jobs {jobs} | {s['wall']:.0f} | {s['cpu']:.0f} | {s['cpu'] / s['wall']:.2f} | "
              f"{s['step']:.2f} | {overhead:.1f} | {proj[jobs]:.0f} |")
    print(f"CPU per step {cpu_step:.2f} s, per run overhead {cpu_overhead:.1f} s (fit on {SHORT} and "
          f"{opt.steps} steps); the full study's CPU {2 * cpu_bound:.0f} min, so {cpu_bound:.0f} min on 2 "
          "idle cores")
    for name, value in (("measured (--jobs 2, this load)", proj[2]), ("CPU bound (2 idle cores)", cpu_bound)):
        print(f"full study, {name}: {value:.0f} min: {'meets' if value < 60 else 'does not meet'} the "
              "one-hour goal")
    speedup = sides[1]["wall"] / sides[2]["wall"]
    print(f"RESULT study_speedup={speedup:.2f} projected_min={proj[2]:.0f} "
          f"projected_cpu_bound_min={cpu_bound:.0f}")


if __name__ == "__main__":
    main()
