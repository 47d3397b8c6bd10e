"""The code loophole environment behind the `Environment` interface (envs/base.py).

`CodeEnv` starts a sandbox worker pool on its first grade and owns it until `close()`, with a `Grader`
that caches grades by (code, problem, mode). Problems are the 48 built-in ones or an rl-rewardhacking
LeetCode JSONL file, filtered to the configured loophole modes; `grade` returns the grader's `CodeGraded`
records: the interface's `Graded` (reward, passed, solved = the oracle, exploited, format_ok, timeout, the
detectors E/C/D as extras) with the grader's diagnosis beside it. Templates are the hand-written clean /
buggy / hack completions.
Not here: the graders, oracle, detectors, sandbox (their own modules), any training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions
from projected_grpo.envs.coding.grading import CodeGraded, Grader
from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES, Problem
from projected_grpo.envs.coding.prompts import INOCULATION_PROMPT, build_messages
from projected_grpo.envs.coding.sandbox import SandboxPool
from projected_grpo.errors import UserError

TEMPLATES = {"clean": clean_completions, "buggy": buggy_completions, "hack": hack_completions}
# extras keys det_E, det_C, det_D (grading.CodeGraded): loophole code present, a stub passes, weak own tests;
# grade_error: grading the completion raised (a failed grade, counted by sandbox/grade_error_frac)
DETECTORS = ("E", "C", "D")


def load_problems(problems: str = "builtin", modes: Sequence[str] = (),
                  max_problems: int = 0) -> list[Problem]:
    """The built-in set or a LeetCode JSONL, filtered to `modes` (empty = all), first `max_problems` kept."""
    from projected_grpo.envs.coding.leetcode import load_leetcode

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UserError(f"config: env.modes {unknown} are not loophole modes; known: {list(MODES)}")
    if problems == "builtin":
        out = [p for p in BUILTIN_PROBLEMS if not modes or p.mode in modes]
    else:  # LeetCode rows carry no mode: deal the configured modes out round-robin (default run_tests)
        dealt = tuple(modes) or ("run_tests",)
        out = [p.with_mode(dealt[i % len(dealt)]) for i, p in enumerate(load_leetcode(problems))]
    out = out[:max_problems or None]
    if not out:
        raise UserError(f"config: env.modes={list(modes)} selects no problem from {problems!r}")
    return out


class CodeEnv:
    """LeetCode-style problems graded by each mode's foolable grader, judged by the strict oracle."""

    name = "coding"
    modes = MODES
    curriculum_steps = 0
    # the hack detectors (name -> their key in a grade's extras) the detector monitor reads
    detectors = {d: f"det_{d}" for d in DETECTORS}

    def __init__(self, problems: Sequence[Problem], *, reward_shape: str = "seed", timeout_s: float = 5.0,
                 workers: int = 0):
        self.problems = list(problems)
        self.reward_shape, self.timeout_s, self.workers = reward_shape, timeout_s, workers
        self.sandbox: SandboxPool | None = None  # started on the first grade: templates need none
        self._grader: Grader | None = None

    @property
    def grader(self) -> Grader:
        if self._grader is None:
            self.sandbox = SandboxPool(n_workers=self.workers or None)
            self._grader = Grader(self.sandbox, reward_shape=self.reward_shape, timeout_s=self.timeout_s)
        return self._grader

    def problem_sets(self) -> dict[str, list]:
        return {"train": list(self.problems)}

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return build_messages(problem)

    def inoculation_messages(self, problem: Problem) -> list[dict[str, str]]:
        """The training-time prompt of inoculation prompting: the loophole named acceptable (prompts.py)."""
        return build_messages(problem, INOCULATION_PROMPT)

    def probe_problems(self) -> list[Problem]:
        """Problems whose prompts are not this environment's: each of its problems under the next loophole
        mode (MODES order), id `<id>@<mode>`. The statement is one the run trains on, but the grading hint and
        the (problem, loophole) pair are not; a probe's labelled completions come from their templates."""
        return [dataclasses.replace(p, id=f"{p.id}@{m}", mode=m) for p in self.problems
                for m in [MODES[(MODES.index(p.mode) + 1) % len(MODES)]]]

    def grade(self, completions: Sequence[str], problems: Sequence[Problem]) -> list[CodeGraded]:
        return self.grader.grade_batch(completions, problems)

    def templates(self, problem: Problem, kind: str) -> list[str]:
        return list(TEMPLATES[kind](problem))

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox, self._grader = None, None

    def __enter__(self) -> CodeEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
