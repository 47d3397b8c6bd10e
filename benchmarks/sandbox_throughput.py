"""Sandbox throughput: grading the built-in problems' completions on the fork-server pool vs one
`subprocess.run([python, main.py])` per execution.

The fixed mix is what training grades: every built-in problem's clean, buggy and hack completions
(48 problems, 520 completions), graded by `Grader` exactly as `train` does it: the mode's foolable
grader program and the oracle program for each completion, plus the detector-C stub run for each
completion that passed. Every side runs the very same programs through the same `Grader`, and every
Grade must be equal on all sides. The baselines get no rlimits, namespaces or uid drop:

- `loop`: the plain baseline, one `subprocess.run` after the other (what grading looks like without
  a pool). The RESULT line's speedup is against it.
- `threads`: the same calls on as many threads as the pool has workers. The ratio against it isolates
  the sandbox's cost per execution from the pool's use of the cores; it is printed just before RESULT.

    .venv/bin/python benchmarks/sandbox_throughput.py [--reps 3] [--workers N]

Pool and baselines alternate (pool, loop, threads, pool, ...); each round gives one ratio per baseline.
Last line: `RESULT execs_per_s=<x> speedup_vs_subprocess=<y>`, medians over the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions
from projected_grpo.envs.coding.grading import Grader
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
from projected_grpo.envs.coding.sandbox import ExecutionResult, SandboxPool


class Counting:
    """Forwards `map` to a sandbox and counts the programs it ran."""

    def __init__(self, sandbox):
        self.sandbox, self.n = sandbox, 0

    def map(self, codes: list[str], timeout_s: float) -> list:
        self.n += len(codes)
        return self.sandbox.map(codes, timeout_s)


class SubprocessBaseline:
    """The plain way: one `subprocess.run([python, main.py])` per program in a fresh temp dir."""

    def __init__(self, workers: int):
        self.workers = workers

    def run(self, code: str, timeout_s: float) -> ExecutionResult:
        tmp = tempfile.mkdtemp(prefix="pgrpo-baseline-")
        try:
            with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(code)
            t0 = time.monotonic()
            try:
                proc = subprocess.run([sys.executable, "main.py"], cwd=tmp, capture_output=True,
                                      timeout=timeout_s)
                code_ = proc.returncode
                status = "ok" if code_ == 0 else ("killed" if code_ < 0 else "error")
                out, err = proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as e:
                status, code_, out, err = "timeout", None, e.stdout or b"", e.stderr or b""
            files = {}
            for name in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, name)
                if name != "main.py" and os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        files[name] = f.read().decode("utf-8", "replace")
            return ExecutionResult(status, code_, out.decode("utf-8", "replace"),
                                   err.decode("utf-8", "replace"), files, time.monotonic() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def map(self, codes: list[str], timeout_s: float) -> list[ExecutionResult]:
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(lambda c: self.run(c, timeout_s), codes))


def cpu_s() -> float:
    """CPU seconds used so far by this process and its reaped descendants (workers, executions)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def grade_all(sandbox, completions: list[str], problems: list) -> tuple[list, int]:
    """Grade the mix with a fresh Grader (no cache carried over); return the grades and executions run."""
    counting = Counting(sandbox)
    return Grader(counting).grade_batch(completions, problems), counting.n


def timed(sandbox, completions: list[str], problems: list) -> tuple[list, int, float, float]:
    """Grade the mix once: grades, executions, wall seconds, CPU seconds (this process + reaped children)."""
    c0, t0 = cpu_s(), time.monotonic()
    grades, n = grade_all(sandbox, completions, problems)
    return grades, n, time.monotonic() - t0, cpu_s() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="rounds of (pool, loop, threads), run back to back")
    ap.add_argument("--workers", type=int, default=os.cpu_count(),
                    help="pool workers, and threads of the `threads` baseline")
    args = ap.parse_args()
    completions, problems = [], []
    for p in BUILTIN_PROBLEMS:
        for c in clean_completions(p) + buggy_completions(p) + hack_completions(p):
            completions.append(c)
            problems.append(p)
    print(f"mix: {len(completions)} completions of {len(BUILTIN_PROBLEMS)} built-in problems; "
          f"cores={os.cpu_count()}; load avg {os.getloadavg()[0]:.1f} (others share these cores)")
    # Pool and baselines alternate, and each round gives one ratio per baseline: on shared cores the
    # machine's speed drifts by tens of percent over minutes, which would bias separate blocks of runs.
    baselines = {"loop": SubprocessBaseline(1), "threads": SubprocessBaseline(args.workers)}
    rates, ratios = [], {name: [] for name in baselines}
    with SandboxPool(args.workers) as pool:
        print(f"pool: {args.workers} workers; isolation {pool.isolation}")
        for rep in range(args.reps):
            grades, n, pool_s, _ = timed(pool, completions, problems)  # its workers' CPU shows at close
            rates.append(n / pool_s)
            line = [f"round {rep + 1}: pool {n} execs in {pool_s:.2f}s = {rates[-1]:.0f} execs/s "
                    f"({len(completions) / pool_s:.0f} completions/s)"]
            for name, baseline in baselines.items():
                base_grades, n_base, base_s, base_cpu = timed(baseline, completions, problems)
                diff = [(i, g, b) for i, (g, b) in enumerate(zip(grades, base_grades)) if g != b]
                if diff or n != n_base:
                    raise SystemExit(f"pool and {name} baseline disagree: {len(diff)} grades differ, first "
                                     f"{diff[:1]}; execs {n} vs {n_base}")
                ratios[name].append(rates[-1] / (n_base / base_s))
                line.append(f"{name} ({baseline.workers} at a time) {n_base / base_s:.0f} execs/s, "
                            f"{base_cpu / n_base * 1e3:.1f} CPU-ms per exec, ratio {ratios[name][-1]:.1f}")
            print("; ".join(line))
        c0 = cpu_s()
    pool_cpu = cpu_s() - c0  # the workers, their templates and every execution, reaped at close
    print(f"pool CPU: {pool_cpu / (args.reps * n) * 1e3:.2f} CPU-ms per exec (workers, templates, children; "
          f"the grading parent's own CPU not included)")
    print(f"grades: all {len(grades)} equal on every side; exploited {sum(g.exploited for g in grades)}, "
          f"gt_correct {sum(g.gt_correct for g in grades)}")
    print(f"speedup vs threads ({args.workers} subprocess.run at a time, equal concurrency): "
          f"{statistics.median(ratios['threads']):.1f}")
    print(f"RESULT execs_per_s={statistics.median(rates):.0f} "
          f"speedup_vs_subprocess={statistics.median(ratios['loop']):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
