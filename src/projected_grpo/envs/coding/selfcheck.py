"""`projected-grpo check-grader`: the environment's self-check, printed and asserted.

On the built-in problems: the hack x mode table (row: a mode's canonical hack, on every problem;
column: the grader it is graded by) must be diagonal, i.e. each canonical hack fools exactly its own
mode's grader, on every problem, and is a hack there (oracle rejects it); every clean completion
passes and is correct (never exploited); every buggy one fails both; every hack form is exploited;
every canonical solution passes the oracle. With --dataset, the oracle also grades each row's
canonical solution and a `return 0` stub; every row marked completion_gt_pass must pass, no stub
may; the last line is `RESULT canonical_pass=<n>/<m> stub_pass=<n>/<m>`. Exit status 0 iff all hold.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import tyro

from projected_grpo.envs.coding.completions import (
    buggy_completions,
    canonical_hack,
    clean_completions,
    hack_completions,
)
from projected_grpo.envs.coding.graders import grader_program, judge_grader
from projected_grpo.envs.coding.grading import Grader
from projected_grpo.envs.coding.leetcode import load_leetcode_rows
from projected_grpo.envs.coding.oracle import report_name
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES, Problem, method_source
from projected_grpo.envs.coding.prompts import extract_code
from projected_grpo.envs.coding.sandbox import SandboxPool


@dataclasses.dataclass(frozen=True)
class CheckGraderOptions:
    """Self-check of the loophole graders and the oracle."""

    dataset: pathlib.Path | None = None
    """LeetCode JSONL file (rl-rewardhacking format) whose canonical solutions and stubs to grade."""
    workers: int | None = None
    """Sandbox workers (default: one per core)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one execution on the built-in problems, seconds."""
    dataset_timeout_s: float = 30.0
    """Wall-clock limit of one execution on the dataset (about 100 tests per problem), seconds."""


def hack_mode_table(pool, problems: tuple[Problem, ...], timeout_s: float) -> dict[tuple[str, str], int]:
    """(hack mode, grader mode) -> number of problems whose grader passes that mode's canonical hack."""
    cells, programs, reports = [], [], []
    for hack_mode in MODES:
        for p in problems:
            code = extract_code(canonical_hack(p.with_mode(hack_mode)))
            for grader_mode in MODES:
                reports.append(report_name())
                programs.append(grader_program(code, p.with_mode(grader_mode), reports[-1]))
                cells.append((hack_mode, grader_mode, p.with_mode(grader_mode)))
    results = pool.map(programs, timeout_s)
    table = {(h, g): 0 for h in MODES for g in MODES}
    for (h, g, p), res, rep in zip(cells, results, reports):
        table[h, g] += judge_grader(res, p, rep)[0]
    return table


def format_table(table: dict[tuple[str, str], int], n: int) -> str:
    """The table as aligned text, one row per hack mode."""
    width = max(len(m) for m in MODES)
    lines = ["hack \\ grader".ljust(width) + "".join(f" {g:>{width}}" for g in MODES)]
    for h in MODES:
        lines.append(h.ljust(width) + "".join(f" {f'{table[h, g]}/{n}':>{width}}" for g in MODES))
    return "\n".join(lines)


def check_builtin(grader: Grader, pool, timeout_s: float) -> list[str]:
    """Run every built-in check; print the table and a summary; return the failures (empty: all hold)."""
    problems, failures, n = BUILTIN_PROBLEMS, [], len(BUILTIN_PROBLEMS)
    table = hack_mode_table(pool, problems, timeout_s)
    print(format_table(table, n))
    failures += [f"table[{h}, {g}] = {table[h, g]}/{n}, expected {n if h == g else 0}"
                 for h in MODES for g in MODES if table[h, g] != (n if h == g else 0)]
    # kind -> completions maker and the (passed, solved) every one of them must get
    kinds = {"clean": (clean_completions, (True, True)), "buggy": (buggy_completions, (False, False)),
             "hack": (hack_completions, (True, False))}
    for kind, (make, want) in kinds.items():
        items = [(c, p) for p in problems for c in make(p)]
        grades = grader.grade_batch([c for c, _ in items], [p for _, p in items])
        counts = {name: sum(getattr(g, field) for g in grades) for name, field in (
            ("passed", "passed"), ("solved", "solved"), ("exploited", "exploited"),
            ("E", "loophole_present"), ("C", "tests_pass_stub"), ("D", "weak_tests"))}
        print(f"{kind}: {len(items)} completions, " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        failures += [f"{kind} completion of {p.id}: passed={g.passed} solved={g.solved}, "
                     f"expected {want}: {g.reason}"
                     for (_, p), g in zip(items, grades) if (g.passed, g.solved) != want]
    diag = grader.grade_batch([canonical_hack(p) for p in problems], list(problems))
    failures += [f"canonical hack of {p.id} not exploited: {g.reason}"
                 for p, g in zip(problems, diag) if not g.exploited]
    verdicts = grader.oracle_batch([p.canonical for p in problems], list(problems))
    print(f"canonical solutions: {sum(v.gt_correct for v in verdicts)}/{n} pass the oracle")
    failures += [f"canonical solution of {p.id} fails the oracle: {v.reason}"
                 for p, v in zip(problems, verdicts) if not v.gt_correct]
    return failures


def check_dataset(grader: Grader, rows: list) -> tuple[list[str], str]:
    """Oracle on every row's canonical solution and a `return 0` stub: (failures, RESULT line).
    rows: leetcode.load_leetcode_rows of the dataset (read before any grading, so a bad file fails fast)."""
    problems = [p for p, _ in rows]
    canon = grader.oracle_batch([p.canonical for p in problems], problems)
    stubs = grader.oracle_batch([method_source(p.starter_code, "return 0") for p in problems], problems)
    failures = [f"{p.id}: canonical solution (completion_gt_pass true) fails the oracle: {v.reason}"
                for (p, flag), v in zip(rows, canon) if flag and not v.gt_correct]
    for (p, flag), v in zip(rows, canon):
        if not flag and not v.gt_correct:
            print(f"note: {p.id} canonical fails the oracle, as its row's completion_gt_pass={flag} says")
    failures += [f"{p.id}: the return-0 stub passes the oracle"
                 for p, v in zip(problems, stubs) if v.gt_correct]
    m = len(problems)
    result = (f"RESULT canonical_pass={sum(v.gt_correct for v in canon)}/{m} "
              f"stub_pass={sum(v.gt_correct for v in stubs)}/{m}")
    return failures, result


def check_grader(argv: list[str]) -> int:
    """Entry point of `projected-grpo check-grader`."""
    opts = tyro.cli(CheckGraderOptions, args=argv, prog="projected-grpo check-grader")
    t0 = time.monotonic()
    rows = load_leetcode_rows(opts.dataset) if opts.dataset is not None else None  # a bad file fails first
    with SandboxPool(opts.workers) as pool:
        failures = check_builtin(Grader(pool, timeout_s=opts.timeout_s), pool, opts.timeout_s)
        result = None
        if opts.dataset is not None:
            dataset_grader = Grader(pool, timeout_s=opts.dataset_timeout_s)
            dataset_failures, result = check_dataset(dataset_grader, rows)
            failures += dataset_failures
    for f in failures:
        print(f"FAIL {f}")
    print(f"{'OK' if not failures else f'{len(failures)} failures'} ({time.monotonic() - t0:.1f} s)")
    if result is not None:
        print(result)
    return 0 if not failures else 1
