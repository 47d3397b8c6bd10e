"""The rl-rewardhacking / LeetCodeDataset JSONL loader, its error messages, and the oracle on real
rows (canonical passes, a `return 0` stub fails). Run: pytest tests/test_leetcode.py"""

from __future__ import annotations

import json
import math

import pytest

from projected_grpo.envs.coding.grading import Grader
from projected_grpo.envs.coding.leetcode import DatasetError, load_leetcode, load_leetcode_rows, parse_assert
from projected_grpo.envs.coding.problems import method_source
from projected_grpo.envs.coding.prompts import build_messages
from projected_grpo.envs.coding.sandbox import SandboxPool
from projected_grpo.envs.coding.selfcheck import check_dataset

FILE = "leetcode/leetcode_test_medhard.jsonl"

SIG = "class Solution:\n    def add(self, a: int, b: int) -> int:\n        "
GOOD_ROW = {
    "id": 7, "question": "PROBLEM:\nAdd a and b.\n\nSOLUTION:\n", "func_name": "Solution().add",
    "setup_code": "from typing import *\ninf = float('inf')\n",
    "gt_answer": ["assert Solution().add(a = 1, b = 2) == 3", "assert Solution().add(a = -1, b = -2) == -3"],
    "canonical_solution": SIG + "return a + b\n",
    "prompt_metadata": {"starter_code": SIG},
    "completion_gt_pass": True,
}


def _write(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_parse_assert_keeps_argument_source_and_literal_expected():
    t = parse_assert("assert Solution().f(n = 7, queries = [[0,5],[1,6]]) == [2, 2]", "Solution().f")
    assert (t.args, t.expected) == ("n=7, queries=[[0, 5], [1, 6]]", [2, 2])
    t = parse_assert("assert Solution().f(3) == -inf", "Solution().f")
    assert t.expected == -math.inf
    with pytest.raises(ValueError, match="expected one 'assert Solution\\(\\).f"):
        parse_assert("assert Solution().g(3) == 1", "Solution().f")
    with pytest.raises(ValueError, match="is not a literal"):
        parse_assert("assert Solution().f(3) == foo()", "Solution().f")
    with pytest.raises(ValueError, match="is not a literal"):
        parse_assert("assert Solution().f(x) == 1", "Solution().f")


def test_good_row_loads(tmp_path):
    [(p, flag)] = load_leetcode_rows(_write(tmp_path, [GOOD_ROW]), mode="sentinel")
    assert (p.id, p.method, p.mode, p.source, flag) == ("lc7", "add", "sentinel", "leetcode", True)
    assert p.statement == "PROBLEM:\nAdd a and b."  # the "SOLUTION:" cue is dropped
    assert [(t.args, t.expected) for t in p.tests] == [("a=1, b=2", 3), ("a=-1, b=-2", -3)]


def test_prompt_messages_fall_back_to_the_user_turn(tmp_path):
    row = {k: v for k, v in GOOD_ROW.items() if k != "question"}
    row["prompt"] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Add them."}]
    [p] = load_leetcode(_write(tmp_path, [row]))
    assert p.statement == "Add them." and "run_tests()" in build_messages(p)[1]["content"]


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("func_name"), ":1: field 'func_name' is missing"),
    (lambda r: r.update(func_name="add"), ":1: field 'func_name' should look like 'Solution().methodName'"),
    (lambda r: r.update(gt_answer=[]), ":1: field 'gt_answer' is empty"),
    (lambda r: r.update(gt_answer=["assert Solution().add(1, 2) == x"]),
     ":1: field 'gt_answer[0]': expected value"),
    (lambda r: r.update(gt_answer=["assert True"]), ":1: field 'gt_answer[0]': expected one 'assert"),
    (lambda r: r.update(gt_answer=[3]), ":1: field 'gt_answer[0]' should be str, got int"),
    (lambda r: r.pop("prompt_metadata"), ":1: field 'prompt_metadata.starter_code' is missing"),
    (lambda r: r.update(setup_code=None), ":1: field 'setup_code' should be str, got NoneType"),
    (lambda r: r.update(completion_gt_pass="yes"), ":1: field 'completion_gt_pass' should be bool"),
    (lambda r: r.pop("question"), ":1: field 'prompt' is missing"),
])
def test_malformed_rows_fail_with_file_line_and_field(tmp_path, change, message):
    row = json.loads(json.dumps(GOOD_ROW))
    change(row)
    path = _write(tmp_path, [row])
    with pytest.raises(DatasetError) as e:
        load_leetcode(path)
    assert str(e.value).startswith(path) and message in str(e.value)


def test_bad_json_duplicates_and_modes(tmp_path):
    path = _write(tmp_path, [GOOD_ROW, "{not json"])
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: invalid JSON"):
        load_leetcode(path)
    with pytest.raises(DatasetError, match="duplicate ids"):
        load_leetcode(_write(tmp_path, [GOOD_ROW, GOOD_ROW]))
    with pytest.raises(ValueError, match="mode 'x' is not one of"):
        load_leetcode(_write(tmp_path, [GOOD_ROW]), mode="x")


def test_shared_file_loads_119_problems(shared_data):
    rows = load_leetcode_rows(shared_data / FILE)
    assert len(rows) == 119 and all(flag is True for _, flag in rows)
    problems = [p for p, _ in rows]
    assert all(p.mode == "run_tests" and len(p.tests) >= 30 for p in problems)
    assert sum(len(p.tests) for p in problems) == 12592  # every gt_answer assert of the file
    lc3371 = next(p for p in problems if p.id == "lc3371")
    assert any(t.expected == -math.inf for t in lc3371.tests)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(2) as p:
        yield p


def test_oracle_on_real_rows_canonical_passes_stub_fails(shared_data, pool):
    problems = load_leetcode(shared_data / FILE)
    # lc3273 uses @dataclass at module level (needs a registered module), lc3371 expects -inf
    picked = [p for p in problems if p.id in ("lc3243", "lc3273", "lc3371")]
    grader = Grader(pool, timeout_s=30.0)
    canon = grader.oracle_batch([p.canonical for p in picked], picked)
    stubs = grader.oracle_batch([method_source(p.starter_code, "return 0") for p in picked], picked)
    assert [v.gt_correct for v in canon] == [True] * 3, [v.reason for v in canon]
    assert [v.gt_correct for v in stubs] == [False] * 3


@pytest.mark.slow
def test_check_dataset_in_full(shared_data, pool):
    failures, result = check_dataset(Grader(pool, timeout_s=30.0), load_leetcode_rows(shared_data / FILE))
    assert failures == [] and result == "RESULT canonical_pass=119/119 stub_pass=0/119"
