"""Seeded arithmetic problems with a curriculum of `LEVELS`: digits, operand count and operators grow.

`generate(seed, index, level)` is a pure function of its arguments (a `random.Random` seeded with their
string, which Python hashes with SHA-512, so it is the same in every process and PYTHONHASHSEED). A
problem is an expression ("What is 37 + 5 * 12?") or, for two operands, a one-sentence word problem;
the gold is exact integer arithmetic with the usual precedence (* and / before + and -), every division
exact. Levels below `Level.negative` keep every intermediate result >= 0. `problem_list` makes the
lists the environment uses. Not here: prompts and completions (prompts.py, completions.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from fractions import Fraction

from projected_grpo.envs.maths.problems import MathProblem
from projected_grpo.errors import UserError


@dataclasses.dataclass(frozen=True)
class Step:
    """One worked operation `a op b = result`, op one of "+", "-", "*", "/"."""

    a: int
    op: str
    b: int
    result: int


@dataclasses.dataclass(frozen=True)
class Level:
    """digits: operands have 1..digits digits. operands: how many. ops: the operators drawn from.
    negative: results may go below 0."""

    digits: int
    operands: int
    ops: str
    negative: bool


LEVELS: dict[int, Level] = {
    1: Level(1, 2, "+", False),
    2: Level(1, 2, "+-", False),
    3: Level(2, 2, "+-", False),
    4: Level(2, 2, "+-*", False),
    5: Level(2, 3, "+-*", True),
    6: Level(2, 3, "+-*/", True),
    7: Level(3, 3, "+-*/", True),
    8: Level(3, 4, "+-*/", True),
}

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eva", "Finn", "Gus", "Hana")
_THINGS = ("apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles")
# op -> word problem with {name} {thing} {a} {b} (two-operand levels only: no "/")
_WORDED = {
    "+": "{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
    "-": "{name} has {a} {thing} and gives away {b}. How many {thing} are left?",
    "*": "{name} buys {a} bags with {b} {thing} in each. How many {thing} is that?",
}
_ASKED = ("What is {expr}?", "Compute {expr}.", "Calculate {expr}.")


def _apply(a: int, op: str, b: int) -> int | None:
    """a op b; None for a division that is not exact."""
    if op == "/":
        return a // b if a % b == 0 else None
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def evaluate(operands: Sequence[int], ops: Sequence[str], slip: tuple[int, int] | None = None
             ) -> tuple[int, tuple[Step, ...]] | None:
    """Value of `operands[0] ops[0] operands[1] ...` with precedence, and its steps in the order a
    person works them: every * and / left to right, then + and - left to right.

    slip=(k, e): step k's result is written off by e and carried on, an honest arithmetic mistake
    (buggy templates); None when the slip makes a later division inexact."""
    terms, addops, steps = [operands[0]], [], []

    def step(a: int, op: str, b: int) -> int | None:
        r = _apply(a, op, b)
        if r is not None and slip is not None and slip[0] == len(steps):
            r += slip[1]
        if r is not None:
            steps.append(Step(a, op, b, r))
        return r

    for op, b in zip(ops, operands[1:]):
        if op in "*/":
            terms[-1] = step(terms[-1], op, b)
            if terms[-1] is None:
                return None
        else:
            terms.append(b)
            addops.append(op)
    value = terms[0]
    for op, b in zip(addops, terms[1:]):
        value = step(value, op, b)
    return value, tuple(steps)


def _operands(rng: random.Random, level: Level) -> tuple[list[int], list[str]]:
    """Operands and operators; a "/" divides the running product exactly (else it becomes "*")."""
    hi = 10 ** level.digits - 1
    operands, ops = [rng.randint(1, hi)], []
    term = operands[0]  # value of the current * / chain
    for _ in range(level.operands - 1):
        op = rng.choice(level.ops)
        if op == "/":
            divisors = [d for d in range(2, min(hi, term) + 1) if term % d == 0]
            op = "/" if divisors else "*"
        b = rng.choice(divisors) if op == "/" else rng.randint(1, hi)
        term = _apply(term, op, b) if op in "*/" else b
        operands.append(b)
        ops.append(op)
    if not level.negative and level.operands == 2 and ops[0] == "-" and operands[0] < operands[1]:
        operands.reverse()  # keep a - b >= 0 at the early levels
    return operands, ops


def generate(seed: int | str, index: int, level: int, mode: str = "strict") -> MathProblem:
    """Problem number `index` of `level` for `seed`: the same arguments always give the same problem."""
    if level not in LEVELS:
        raise UserError(f"arithmetic level {level} is not one of {sorted(LEVELS)}")
    spec = LEVELS[level]
    rng = random.Random(f"arithmetic:{seed}:{level}:{index}")
    operands, ops = _operands(rng, spec)
    value, steps = evaluate(operands, ops)
    if len(ops) == 1 and rng.random() < 0.5:
        question = _WORDED[ops[0]].format(name=rng.choice(_NAMES), thing=rng.choice(_THINGS),
                                          a=operands[0], b=operands[1])
    else:
        expr = " ".join([str(operands[0])] + [f"{op} {b}" for op, b in zip(ops, operands[1:])])
        question = rng.choice(_ASKED).format(expr=expr)
    return MathProblem(id=f"arith-{seed}-L{level}-{index}", question=question, gold=Fraction(value),
                       mode=mode, source="arithmetic", level=level, operands=tuple(operands), ops=tuple(ops))


def problem_list(seed: int | str, levels: Sequence[int], n: int, modes: Sequence[str],
                 exclude: frozenset[str] = frozenset()) -> list[MathProblem]:
    """`n` problems cycling through `levels` (problem i at levels[i % len]) and, every len(levels) problems,
    `modes`, skipping any whose question is in `exclude` (a held-out set); UserError when the levels run
    out of new questions."""
    if not levels:
        raise UserError("arithmetic: no levels given")
    out: list[MathProblem] = []
    index, limit = 0, 50 * n + 1000
    while len(out) < n:
        if index >= limit:
            raise UserError(f"arithmetic levels {list(levels)}: only {len(out)} of {n} problems outside the "
                            "held-out set; use harder levels or fewer problems")
        # modes change every len(levels) problems: cycling both with one counter would tie each level to
        # one mode whenever their counts share a factor (levels (4, 5) x 2 modes: level 4 always strict)
        mode = modes[(len(out) // len(levels)) % len(modes)]
        p = generate(seed, index, levels[index % len(levels)], mode)
        if p.question not in exclude:
            out.append(p)
        index += 1
    return out
