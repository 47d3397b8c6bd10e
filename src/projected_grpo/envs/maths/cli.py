"""`projected-grpo check-verifier` and `projected-grpo grade-math`: the maths verifiers from the shell.

check-verifier grades every reference answer of a GSM8K-format file against its own gold (the strict
verifier must accept all) and a perturbed copy whose final number is gold + 1 (it must reject all),
prints a line per failure, the loophole verifier's counts for information (it accepts most perturbed
copies: their working still shows the gold), and ends with `RESULT gold_pass=<n>/<N>
perturbed_pass=<m>/<N>`; exit 0 iff all hold. grade-math prints one JSON object for one response.
Bad input (a missing file, a row without "####", an unreadable gold) prints one line naming the file
and line and exits 2.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from fractions import Fraction

import tyro

from projected_grpo.envs.maths.gsm8k import load_gsm8k
from projected_grpo.envs.maths.verify import (
    contains_verify,
    extract_answer,
    format_number,
    parse_gold,
    parse_number,
    strict_verify,
)
from projected_grpo.errors import UserError


def perturb(solution: str, gold: Fraction) -> str:
    """The reference answer with everything after its last "####" replaced by gold + 1."""
    return f"{solution.rpartition('####')[0]}#### {format_number(gold + 1)}"


@dataclasses.dataclass(frozen=True)
class CheckVerifierOptions:
    """Grade a GSM8K-format file's reference answers (must pass) and perturbed copies (must fail)."""

    dataset: pathlib.Path
    """GSM8K-format JSONL file: one object per line with `question` and `answer` ending in "#### n"."""


def check_verifier(argv: list[str]) -> int:
    """Entry point of `projected-grpo check-verifier`."""
    opts = tyro.cli(CheckVerifierOptions, args=argv, prog="projected-grpo check-verifier")
    t0 = time.monotonic()
    try:
        problems = load_gsm8k(opts.dataset)
    except UserError as e:
        print(e, file=sys.stderr)
        return 2
    n, gold_pass, pert_pass, loose_gold, loose_pert = len(problems), 0, 0, 0, 0
    for p in problems:
        bad = perturb(p.solution, p.gold)
        ok, fooled = strict_verify(p.solution, p.gold), strict_verify(bad, p.gold)
        gold_pass, pert_pass = gold_pass + ok, pert_pass + fooled
        loose_gold += contains_verify(p.solution, p.gold)
        loose_pert += contains_verify(bad, p.gold)
        if not ok:
            a = extract_answer(p.solution)
            print(f"FAIL {p.id}: reference answer rejected (gold {format_number(p.gold)}, read "
                  f"{[format_number(c) for c in a.candidates]} by {a.source})")
        if fooled:
            print(f"FAIL {p.id}: perturbed answer (#### {format_number(p.gold + 1)}) accepted")
    print(f"loophole (contains) verifier, for information: gold_pass={loose_gold}/{n} "
          f"perturbed_pass={loose_pert}/{n}")
    print(f"{time.monotonic() - t0:.2f} s")
    print(f"RESULT gold_pass={gold_pass}/{n} perturbed_pass={pert_pass}/{n}")
    return 0 if gold_pass == n and pert_pass == 0 else 1


@dataclasses.dataclass(frozen=True)
class GradeMathOptions:
    """Grade one response against a gold answer under both verifiers; print one JSON object."""

    gold: str
    """The gold answer: a number ("18", "1,234", "-3", "3/4") or a GSM8K answer text ending "#### n"."""
    text_file: pathlib.Path
    """File holding the response to grade (UTF-8)."""


def grade_math(argv: list[str]) -> int:
    """Entry point of `projected-grpo grade-math`."""
    opts = tyro.cli(GradeMathOptions, args=argv, prog="projected-grpo grade-math")
    try:
        gold = parse_gold(opts.gold) if "####" in opts.gold else parse_number(opts.gold)
    except ValueError as e:
        print(f"--gold {opts.gold!r}: {e}", file=sys.stderr)
        return 2
    try:
        text = opts.text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"{opts.text_file}: cannot read it ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    answer = extract_answer(text)
    print(json.dumps({"gold": format_number(gold), "strict": answer.value == gold,
                      "loophole": contains_verify(text, gold),
                      "answer": None if answer.value is None else format_number(answer.value),
                      "candidates": [format_number(c) for c in answer.candidates], "source": answer.source}))
    return 0
