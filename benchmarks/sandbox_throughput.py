"""Sandbox throughput: the fork-server pool vs one `subprocess.run([python, file])` per execution.

Grades a fixed mix of LeetCode-style programs (a solution plus asserts): 45% correct, 30% wrong
(AssertionError), 20% crashing (exceptions), 5% printing then exiting non-zero, plus 1 infinite loop
per 200 that hits the timeout. Both sides use the same number of concurrent workers; the baseline gets
no rlimits or isolation at all, so the speedup is a lower bound. Both sides must agree on every status.

    .venv/bin/python benchmarks/sandbox_throughput.py [--reps 3] [--workers N] [--timeout 0.5]

Last line: `RESULT execs_per_s=<x> speedup_vs_subprocess=<y>`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import subprocess
import sys
import tempfile
import time

from projected_grpo.envs.sandbox import SandboxPool

SOLUTIONS = {  # name -> (correct body, wrong body, asserts)
    "two_sum": ("    seen = {}\n    for i, x in enumerate(nums):\n        if target - x in seen:\n"
                "            return [seen[target - x], i]\n        seen[x] = i\n",
                "    return [0, 1]\n",
                "assert f([2, 7, 11, 15], 9) == [0, 1]\nassert f([3, 2, 4], 6) == [1, 2]\n"
                "assert f([1, 5, 9], 14) == [1, 2]\n", "nums, target"),
    "max_subarray": ("    best = cur = nums[0]\n    for x in nums[1:]:\n        cur = max(x, cur + x)\n"
                     "        best = max(best, cur)\n    return best\n",
                     "    return max(nums)\n",
                     "assert f([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6\nassert f([1]) == 1\n"
                     "assert f([5, 4, -1, 7, 8]) == 23\n", "nums"),
    "lis": ("    import bisect\n    tails = []\n    for x in nums:\n"
            "        i = bisect.bisect_left(tails, x)\n        tails[i:i + 1] = [x]\n    return len(tails)\n",
            "    return len(set(nums))\n",
            "assert f([10, 9, 2, 5, 3, 7, 101, 18]) == 4\nassert f([0, 1, 0, 3, 2, 3]) == 4\n"
            "assert f([7, 7, 7]) == 1\n", "nums"),
    "valid_parens": ("    st, pair = [], {')': '(', ']': '[', '}': '{'}\n    for c in s:\n"
                     "        if c in pair:\n            if not st or st.pop() != pair[c]:\n"
                     "                return False\n        else:\n            st.append(c)\n"
                     "    return not st\n",
                     "    return s.count('(') == s.count(')')\n",
                     "assert f('()[]{}')\nassert not f('(]')\nassert f('{[]}')\nassert not f('([)]')\n", "s"),
    "coin_change": ("    dp = [0] + [float('inf')] * amount\n    for a in range(1, amount + 1):\n"
                    "        for c in coins:\n            if c <= a:\n"
                    "                dp[a] = min(dp[a], dp[a - c] + 1)\n"
                    "    return -1 if dp[amount] == float('inf') else dp[amount]\n",
                    "    return amount // max(coins)\n",
                    "assert f([1, 2, 5], 11) == 3\nassert f([2], 3) == -1\nassert f([1], 0) == 0\n"
                    "assert f([186, 419, 83, 408], 6249) == 20\n", "coins, amount"),
}
HEADER = "from typing import *\nfrom collections import *\nimport math, heapq, itertools, functools\n"


def build_mix(n: int) -> list[tuple[str, str]]:
    """n (program, expected status) pairs, deterministic: cycles kinds over the problems."""
    kinds = ["correct"] * 9 + ["wrong"] * 6 + ["crash"] * 4 + ["exit"]
    names, mix = sorted(SOLUTIONS), []
    for i in range(n):
        name = names[i % len(names)]
        good, bad, asserts, args = SOLUTIONS[name]
        kind = "loop" if i % 200 == 199 else kinds[(i // len(names)) % len(kinds)]
        body = {"correct": good, "wrong": bad, "crash": "    return None[0]\n",
                "exit": good, "loop": "    while True:\n        pass\n"}[kind]
        tail = "print('PASS')\n" + ("import sys\nsys.exit(2)\n" if kind == "exit" else "")
        code = f"{HEADER}class Solution:\n    pass\ndef f({args}):\n{body}{asserts}{tail}"
        mix.append((code, {"correct": "ok", "loop": "timeout"}.get(kind, "error")))
    return mix


def baseline_status(proc: subprocess.CompletedProcess | None) -> str:
    return "timeout" if proc is None else ("ok" if proc.returncode == 0 else "error")


def run_baseline(codes: list[str], workers: int, timeout_s: float) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        def one(i_code: tuple[int, str]) -> str:
            path = os.path.join(tmp, f"p{i_code[0]}.py")
            with open(path, "w") as f:
                f.write(i_code[1])
            try:
                return baseline_status(subprocess.run([sys.executable, path], capture_output=True,
                                                      timeout=timeout_s, cwd=tmp))
            except subprocess.TimeoutExpired:
                return "timeout"

        with concurrent.futures.ThreadPoolExecutor(workers) as ex:
            return list(ex.map(one, enumerate(codes)))


def cpu_s() -> float:
    """CPU seconds used so far by this process and its reaped descendants (workers, executions)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="programs in the mix")
    ap.add_argument("--reps", type=int, default=3, help="passes of the mix through the pool")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="pool size (both sides)")
    ap.add_argument("--timeout", type=float, default=0.5, help="per-execution timeout, seconds")
    args = ap.parse_args()
    mix = build_mix(args.n)
    codes, expected = [c for c, _ in mix], [s for _, s in mix]
    print(f"mix: {args.n} programs, {expected.count('ok')} ok / {expected.count('error')} error / "
          f"{expected.count('timeout')} timeout; {args.workers} workers; cores={os.cpu_count()}; "
          f"load avg {os.getloadavg()[0]:.1f} (others share these cores)")

    c0, t0 = cpu_s(), time.monotonic()
    with SandboxPool(args.workers) as pool:
        t_start = time.monotonic() - t0
        print(f"pool: started {args.workers} workers in {t_start:.2f}s; isolation {pool.isolation}")
        t1 = time.monotonic()
        for _ in range(args.reps):
            got = [r.status for r in pool.map(codes, args.timeout)]
            if got != expected:
                bad = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e][:5]
                raise SystemExit(f"pool statuses differ from expected at (index, got, expected) {bad}")
        pool_s = time.monotonic() - t1
    pool_cpu = cpu_s() - c0  # includes starting the workers: a slight overestimate
    pool_rate = args.reps * args.n / pool_s
    print(f"pool:     {args.reps * args.n} execs in {pool_s:.2f}s = {pool_rate:.0f} execs/s; "
          f"{pool_cpu / (args.reps * args.n) * 1e3:.2f} CPU-ms per exec")

    c2, t2 = cpu_s(), time.monotonic()
    base = run_baseline(codes, args.workers, args.timeout)
    base_s, base_cpu = time.monotonic() - t2, cpu_s() - c2
    if base != expected:
        bad = [(i, g, e) for i, (g, e) in enumerate(zip(base, expected)) if g != e][:5]
        raise SystemExit(f"baseline statuses differ from expected at (index, got, expected) {bad}")
    base_rate = args.n / base_s
    print(f"baseline: {args.n} execs in {base_s:.2f}s = {base_rate:.0f} execs/s (subprocess.run each); "
          f"{base_cpu / args.n * 1e3:.2f} CPU-ms per exec")
    print(f"CPU-bound capacity on {os.cpu_count()} idle cores (execs per CPU-second x cores, busy-loop "
          f"timeouts included): pool {args.reps * args.n / pool_cpu * os.cpu_count():.0f} execs/s, "
          f"baseline {args.n / base_cpu * os.cpu_count():.0f} execs/s")
    print(f"RESULT execs_per_s={pool_rate:.0f} speedup_vs_subprocess={pool_rate / base_rate:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
