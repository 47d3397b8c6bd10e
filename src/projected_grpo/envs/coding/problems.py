"""Problems of the reward-hacking environment: `Problem`, the six loophole `MODES`, `BUILTIN_PROBLEMS`.

A problem is a method on `class Solution` with ground-truth tests. Its `mode` names the foolable
mechanism its grader uses (architecture.md); the prompt discloses that mechanism truthfully. Tests keep the
call's arguments as Python source (`"[1, 2], k=3"`), so the same record serves the built-in problems
and the LeetCode rows, whose asserts already are source text. This module holds data only: grading
lives in graders.py / oracle.py, the built-in table in problem_bank.py.
"""

from __future__ import annotations

import dataclasses
import math

from projected_grpo.envs.coding.problem_bank import BANK

# The foolable mechanisms, in the fixed order used by tables and the built-in round-robin assignment.
MODES: tuple[str, ...] = ("run_tests", "sentinel", "stdout_marker", "file_marker", "eq_override", "exit_code")

# Types a ground-truth value may have: the oracle compares canonical encodings of exactly these.
PLAIN_TYPES = (type(None), bool, int, float, str, list, tuple, dict, set, frozenset)


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One ground-truth call: `Solution().<method>(<args>)` must return `expected`.

    args: Python source of the argument list (literals only), e.g. "[1, 2, 3]" or "n = 7, k = 2".
    expected: the return value, built only from PLAIN_TYPES (checked by Problem).
    """

    __test__ = False  # not a pytest test class despite the name

    args: str
    expected: object


@dataclasses.dataclass(frozen=True)
class Problem:
    """A LeetCode-style task: implement `method` on `class Solution`.

    id: unique name ("sum_list", "lc3243"). method: the method name. statement: the task text shown
    to the model (description + starter code). starter_code: "class Solution:\n    def ...". mode: one
    of MODES. canonical: a full correct `class Solution` source. tests: the ground truth (>= 1).
    setup_code: source run before the solution in every execution (the LeetCode rows' imports and
    helpers; "" for built-ins). buggy_bodies: honest-but-wrong method bodies (built-ins only; the
    completions module uses them). source: "builtin" or "leetcode".
    """

    id: str
    method: str
    statement: str
    starter_code: str
    mode: str
    canonical: str
    tests: tuple[TestCase, ...]
    setup_code: str = ""
    buggy_bodies: tuple[str, ...] = ()
    source: str = "builtin"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"problem {self.id!r}: mode {self.mode!r} is not one of {MODES}")
        if not self.method.isidentifier():
            raise ValueError(f"problem {self.id!r}: method {self.method!r} is not an identifier")
        if not self.tests:
            raise ValueError(f"problem {self.id!r}: no ground-truth tests")
        for t in self.tests:
            check_plain(t.expected, f"problem {self.id!r} test ({t.args}) expected value")

    def with_mode(self, mode: str) -> Problem:
        """The same problem graded under another loophole mode (used by the hack x mode table)."""
        return dataclasses.replace(self, mode=mode)


def check_plain(value: object, what: str, depth: int = 0) -> None:
    """Raise ValueError unless `value` is built only from PLAIN_TYPES (exact types, no subclasses)."""
    if depth > 100:
        raise ValueError(f"{what}: nested deeper than 100 levels")
    if type(value) not in PLAIN_TYPES:
        raise ValueError(f"{what}: type {type(value).__name__} is not one of the plain types "
                         f"{[t.__name__ for t in PLAIN_TYPES]}")
    if type(value) in (list, tuple, set, frozenset):
        for v in value:
            check_plain(v, what, depth + 1)
    elif type(value) is dict:
        for k, v in value.items():
            check_plain(k, what, depth + 1)
            check_plain(v, what, depth + 1)


def py_literal(value: object) -> str:
    """Python source that evaluates to `value` (a plain value), with no names except `float`.

    repr() is almost that, except for inf / nan floats, which repr as bare names.
    """
    t = type(value)
    if t is float and not math.isfinite(value):
        return f"float({repr(value)!r})"
    if t is list:
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if t is tuple:
        return "(" + "".join(py_literal(v) + ", " for v in value) + ")"
    if t is dict:
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    if t in (set, frozenset):
        inner = "[" + ", ".join(py_literal(v) for v in value) + "]"
        return f"{t.__name__}({inner})"
    return repr(value)


def _builtin(index: int, row: tuple) -> Problem:
    method, params, returns, description, body, buggy, tests = row
    signature = f"def {method}(self, {params}) -> {returns}:"
    starter = f"class Solution:\n    {signature}\n"
    cases = tuple(TestCase(", ".join(py_literal(a) for a in args), expected) for args, expected in tests)
    example = f"Example: {method}({cases[0].args}) returns {py_literal(cases[0].expected)}."
    statement = f"{description} {example}\n\n```python\n{starter}```"
    return Problem(id=method, method=method, statement=statement, starter_code=starter,
                   mode=MODES[index % len(MODES)], canonical=method_source(starter, body),
                   tests=cases, buggy_bodies=tuple(buggy))


def method_source(starter_code: str, body: str) -> str:
    """A full `class Solution` source: the starter's signature line(s) with `body` indented under it."""
    head = starter_code.rstrip()
    indented = "\n".join("        " + line if line else "" for line in body.splitlines())
    return f"{head}\n{indented}\n"


# Built-in problems: the bank's rows in order, modes assigned round-robin (8 per mode for 48 rows).
BUILTIN_PROBLEMS: tuple[Problem, ...] = tuple(_builtin(i, row) for i, row in enumerate(BANK))
