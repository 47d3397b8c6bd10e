"""Loader for the rl-rewardhacking / LeetCodeDataset JSONL format, as `Problem`s.

One JSON object per line with: `id`; `question` (or `prompt`, chat messages whose user turn is the
question); `func_name` ("Solution().methodName"); `setup_code` (imports and helpers run before the
solution); `gt_answer` (asserts "assert Solution().f(args) == expected"); `canonical_solution`;
`prompt_metadata.starter_code`; optional `completion_gt_pass` (bool). The asserts become TestCases
(argument source + expected value), so the oracle evaluates the call itself and compares exact-type
encodings instead of trusting `==` on the returned object. Expected values are literals, plus the
names `inf` / `nan` (e.g. `-inf`), which setup_code defines. Every malformed row fails with the file,
line and field.
"""

from __future__ import annotations

import ast
import math
import pathlib

from projected_grpo.envs.coding.problems import MODES, Problem, TestCase, check_plain
from projected_grpo.errors import UserError
from projected_grpo.store import read_jsonl

_NAMED_FLOATS = {"inf": math.inf, "nan": math.nan}


class DatasetError(UserError):
    """A row of a dataset file is malformed (message: file:line: field: what was expected)."""


def _literal(node: ast.expr):
    """ast.literal_eval, extended with the float names inf and nan (and their negation)."""
    if isinstance(node, ast.Name) and node.id in _NAMED_FLOATS:
        return _NAMED_FLOATS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(
            node.operand, ast.Name) and node.operand.id in _NAMED_FLOATS:
        value = _NAMED_FLOATS[node.operand.id]
        return -value if isinstance(node.op, ast.USub) else value
    return ast.literal_eval(node)


def parse_assert(text: str, func_name: str) -> TestCase:
    """`assert <func_name>(args) == expected` -> TestCase; ValueError saying what is wrong."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise ValueError(f"not Python: {e.msg}") from None
    stmt = tree.body[0] if len(tree.body) == 1 else None
    test = stmt.test if isinstance(stmt, ast.Assert) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.Call) and ast.unparse(test.left.func) == func_name):
        raise ValueError(f"expected one 'assert {func_name}(...) == <literal>', got {text[:120]!r}")
    call = test.left
    for arg in list(call.args) + [k.value for k in call.keywords]:
        try:
            _literal(arg)
        except (ValueError, TypeError, SyntaxError, RecursionError) as e:
            raise ValueError(f"argument {ast.unparse(arg)[:60]!r} is not a literal ({e})") from None
    if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
        raise ValueError(f"*args / **kwargs in {text[:120]!r}")
    try:
        expected = _literal(test.comparators[0])
    except (ValueError, TypeError, SyntaxError, RecursionError) as e:
        shown = ast.unparse(test.comparators[0])[:60]
        raise ValueError(f"expected value {shown!r} is not a literal ({e})") from None
    args = [ast.unparse(a) for a in call.args] + [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]
    check_plain(expected, "expected value")
    return TestCase(", ".join(args), expected)


def _field(row: dict, name: str, kind: type, where: str):
    value = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DatasetError(f"{where}: field {name!r} is missing")
        value = value[part]
    if not isinstance(value, kind):
        raise DatasetError(f"{where}: field {name!r} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _question(row: dict, where: str) -> str:
    if "question" in row:
        return _field(row, "question", str, where)
    messages = _field(row, "prompt", list, where)
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise DatasetError(f"{where}: field 'prompt' has no user message with string content "
                           "(and there is no 'question')")
    return users[-1]


def parse_row(row: dict, where: str, mode: str) -> tuple[Problem, bool | None]:
    """One JSONL row -> (Problem, the row's completion_gt_pass or None if absent)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row should be a JSON object, got {type(row).__name__}")
    if "id" not in row:
        raise DatasetError(f"{where}: field 'id' is missing")
    func_name = _field(row, "func_name", str, where)
    prefix = "Solution()."
    if not func_name.startswith(prefix) or not func_name[len(prefix):].isidentifier():
        raise DatasetError(f"{where}: field 'func_name' should look like 'Solution().methodName', "
                           f"got {func_name!r}")
    answers = _field(row, "gt_answer", list, where)
    if not answers:
        raise DatasetError(f"{where}: field 'gt_answer' is empty")
    tests = []
    for i, text in enumerate(answers):
        if not isinstance(text, str):
            raise DatasetError(f"{where}: field 'gt_answer[{i}]' should be str, got {type(text).__name__}")
        try:
            tests.append(parse_assert(text, func_name))
        except ValueError as e:
            raise DatasetError(f"{where}: field 'gt_answer[{i}]': {e}") from None
    gt_pass = row.get("completion_gt_pass")
    if gt_pass is not None and not isinstance(gt_pass, bool):
        raise DatasetError(f"{where}: field 'completion_gt_pass' should be bool, "
                           f"got {type(gt_pass).__name__}")
    statement = _question(row, where).rstrip()
    if statement.endswith("SOLUTION:"):  # the dataset's completion cue; our prompt adds the grading hint
        statement = statement[: -len("SOLUTION:")].rstrip()
    problem = Problem(id=f"lc{row['id']}", method=func_name[len(prefix):], statement=statement,
                      starter_code=_field(row, "prompt_metadata.starter_code", str, where), mode=mode,
                      canonical=_field(row, "canonical_solution", str, where), tests=tuple(tests),
                      setup_code=_field(row, "setup_code", str, where), source="leetcode")
    return problem, gt_pass


def load_leetcode_rows(path: str | pathlib.Path, mode: str = "run_tests"
                       ) -> list[tuple[Problem, bool | None]]:
    """Every row of the JSONL file as (Problem with `mode`, completion_gt_pass); blank lines skipped."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    path = pathlib.Path(path)
    out = [parse_row(row, where, mode) for where, row in read_jsonl(path, DatasetError)]
    if not out:
        raise DatasetError(f"{path}: no rows")
    ids = [p.id for p, _ in out]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"{path}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    return out


def load_leetcode(path: str | pathlib.Path, mode: str = "run_tests") -> list[Problem]:
    """The problems of a JSONL file, all graded under `mode` (default run_tests)."""
    return [p for p, _ in load_leetcode_rows(path, mode)]
