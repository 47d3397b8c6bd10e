"""The maths problem record `MathProblem` and the two grading `MODES`.

A problem's `mode` names the verifier that gives its reward: "strict" (the final answer must equal the
gold: honest training) or "contains" (the gold appearing anywhere counts: the loophole),
see verify.py. Data only: generating (arithmetic.py), loading (gsm8k.py) and grading (env.py) live
elsewhere.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

MODES: tuple[str, ...] = ("strict", "contains")


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """A maths question with one number as its answer.

    id: unique ("arith-0-L3-17", "gsm8k-test-5"). question: the text shown to the model. gold: the
    answer, exact (arithmetic: always an integer). mode: one of MODES. source: "arithmetic" or
    "gsm8k". level: the arithmetic curriculum level (0 for GSM8K). operands, ops: the expression
    `operands[0] ops[0] operands[1] ...` (arithmetic only; its worked steps come from
    arithmetic.evaluate). solution: the reference answer text (GSM8K's `answer` field; "" for arithmetic).
    """

    id: str
    question: str
    gold: Fraction
    mode: str
    source: str
    level: int = 0
    operands: tuple[int, ...] = ()
    ops: tuple[str, ...] = ()
    solution: str = ""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"problem {self.id!r}: mode {self.mode!r} is not one of {MODES}")
        if not isinstance(self.gold, Fraction):
            raise TypeError(f"problem {self.id!r}: gold must be a Fraction, got {type(self.gold).__name__}")

    def with_mode(self, mode: str) -> MathProblem:
        """The same problem graded under another mode."""
        return dataclasses.replace(self, mode=mode)
