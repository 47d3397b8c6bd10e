"""Loader for the GSM8K JSONL format as `MathProblem`s.

One JSON object per line with `question` (str) and `answer` (str: the worked solution, its last line
"#### <number>", e.g. "#### 1,234"); other fields are ignored. The gold is the one number after the last
"####" (verify.parse_gold). Every malformed row fails with a UserError naming file, line and field;
blank lines are skipped. Ids are "gsm8k-<file stem>-<line>", so they are stable and unique per file.
Not here: where the files live (the caller passes a path; no default data directory in the library).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from projected_grpo.envs.maths.problems import MODES, MathProblem
from projected_grpo.envs.maths.verify import parse_gold
from projected_grpo.errors import UserError
from projected_grpo.store import read_jsonl


def parse_row(row: object, where: str, mode: str) -> MathProblem:
    """One JSONL row ("path:line" = where) -> MathProblem; UserError naming where and the field."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row should be a JSON object, got {type(row).__name__}")
    for field in ("question", "answer"):
        if field not in row:
            raise UserError(f"{where}: field {field!r} is missing")
        if not isinstance(row[field], str) or not row[field].strip():
            raise UserError(f"{where}: field {field!r} should be a non-empty string, got {row[field]!r:.60}")
    try:
        gold = parse_gold(row["answer"])
    except ValueError as e:
        raise UserError(f"{where}: field 'answer': {e}") from None
    path, _, line = where.rpartition(":")
    return MathProblem(id=f"gsm8k-{pathlib.Path(path).stem}-{line}", question=row["question"].strip(),
                       gold=gold, mode=mode, source="gsm8k", solution=row["answer"])


def load_gsm8k(path: str | pathlib.Path, modes: Sequence[str] = ("strict",)) -> list[MathProblem]:
    """Every row of a GSM8K-format JSONL file, row i graded under modes[i % len(modes)]."""
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"modes {list(modes)}: expected a non-empty list of {list(MODES)}")
    out = [parse_row(row, where, modes[i % len(modes)])
           for i, (where, row) in enumerate(read_jsonl(path))]
    if not out:
        raise UserError(f"{path}: no rows")
    return out
