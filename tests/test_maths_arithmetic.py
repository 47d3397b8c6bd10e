"""The arithmetic generator: evaluation with precedence and slips, determinism, level growth, lists.
Run: pytest tests/test_maths_arithmetic.py"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.envs.maths.arithmetic import LEVELS, Step, evaluate, generate, problem_list
from projected_grpo.errors import UserError


def test_evaluate_precedence_and_steps():
    # 3 + 5 * 2 - 8 / 4: 5 * 2 = 10, 8 / 4 = 2 first, then 3 + 10 = 13, 13 - 2 = 11
    value, steps = evaluate([3, 5, 2, 8, 4], ["+", "*", "-", "/"])
    assert value == 11
    assert steps == (Step(5, "*", 2, 10), Step(8, "/", 4, 2), Step(3, "+", 10, 13), Step(13, "-", 2, 11))


def test_evaluate_slip_is_carried_through():
    # 3 + 5 * 2 with step 0 off by +1: 5 * 2 = 11, then 3 + 11 = 14 (the true value is 13)
    assert evaluate([3, 5, 2], ["+", "*"], slip=(0, 1)) == (14, (Step(5, "*", 2, 11), Step(3, "+", 11, 14)))
    # 6 * 2 / 4: 6 * 2 = 12, 12 / 4 = 3; a slip to 13 makes 13 / 4 inexact: no such working
    assert evaluate([6, 2, 4], ["*", "/"]) == (3, (Step(6, "*", 2, 12), Step(12, "/", 4, 3)))
    assert evaluate([6, 2, 4], ["*", "/"], slip=(0, 1)) is None


def test_levels_grow():
    specs = [LEVELS[k] for k in sorted(LEVELS)]
    assert sorted(LEVELS) == list(range(1, len(LEVELS) + 1))
    for a, b in zip(specs, specs[1:]):
        assert a.digits <= b.digits and a.operands <= b.operands and set(a.ops) <= set(b.ops)
        assert (a.digits, a.operands, len(a.ops)) != (b.digits, b.operands, len(b.ops))  # each level adds


def _expr_of(p):
    return p.operands, p.ops


def _expression(question: str) -> str | None:
    m = re.fullmatch(r"(?:What is|Compute|Calculate) ([\d +\-*/]+)[?.]", question)
    return None if m is None else m.group(1)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_problems_follow_their_level(level):
    spec = LEVELS[level]
    for i in range(150):
        p = generate(7, i, level, "contains")
        assert (p.level, p.mode, p.source, p.id) == (level, "contains", "arithmetic", f"arith-7-L{level}-{i}")
        assert len(p.operands) == spec.operands and set(p.ops) <= set(spec.ops)
        assert all(1 <= x < 10 ** spec.digits for x in p.operands)
        assert p.gold.denominator == 1 and p.gold == evaluate(p.operands, p.ops)[0]
        if not spec.negative:
            assert all(s.result >= 0 for s in evaluate(p.operands, p.ops)[1])
        expr = _expression(p.question)
        if expr is not None:  # the text is the expression: Python's exact arithmetic agrees with the gold
            assert eval(re.sub(r"(\d+)", r"Fraction(\1)", expr), {"Fraction": Fraction}) == p.gold
        else:  # a word problem names both operands
            assert len(p.ops) == 1 and all(str(x) in p.question for x in p.operands)


def test_levels_get_harder():
    # digits written in the worked steps (a, b and result of each), mean over 200 problems per level:
    # not monotone level to level (a division or a subtraction shortens results), but it grows overall
    def work_digits(level):
        return sum(len(str(abs(x))) for i in range(200)
                   for s in evaluate(*_expr_of(generate(0, i, level)))[1] for x in (s.a, s.b, s.result)) / 200
    means = [work_digits(k) for k in sorted(LEVELS)]
    assert means[0] < 4 and means[-1] > 25, means  # level 1: a + b = c, one digit each (c up to 18)
    assert means[0] < means[2] < means[4] < means[6], means


def test_levels_use_every_operator_and_both_question_forms():
    ps = [generate(0, i, lv) for lv in (1, 4, 6) for i in range(300)]
    assert {op for p in ps for op in p.ops} == {"+", "-", "*", "/"}
    assert any(_expression(p.question) is None for p in ps) and any(_expression(p.question) for p in ps)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(sorted(LEVELS)))
def test_generate_is_a_function_of_its_arguments(seed, index, level):
    assert generate(seed, index, level) == generate(seed, index, level)


def test_generate_is_the_same_in_another_process():
    code = ("from projected_grpo.envs.maths.arithmetic import generate\n"
            "print([generate(3, i, lv).question for lv in (1, 5, 8) for i in range(5)])")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([generate(3, i, lv).question for lv in (1, 5, 8) for i in range(5)])


def test_seeds_differ():
    assert [generate(0, i, 5).question for i in range(20)] != [generate(1, i, 5).question for i in range(20)]


def test_problem_list_cycles_levels_and_modes_and_skips_held_out():
    held = frozenset(generate(0, i, 4).question for i in (0, 2))
    ps = problem_list(0, [3, 4], 6, ("strict", "contains"), exclude=held)
    assert [p.level for p in ps][:1] == [3] and all(p.question not in held for p in ps)
    assert [p.mode for p in ps] == ["strict", "strict", "contains", "contains", "strict", "strict"]
    assert len({p.id for p in ps}) == 6


def test_problem_list_does_not_tie_levels_to_modes():
    # two levels and two modes: every (level, mode) pair occurs, in equal numbers
    ps = problem_list(0, [4, 5], 40, ("strict", "contains"))
    pairs = [(p.level, p.mode) for p in ps]
    assert {pair: pairs.count(pair) for pair in set(pairs)} == {
        (4, "strict"): 10, (5, "strict"): 10, (4, "contains"): 10, (5, "contains"): 10}


def test_problem_list_runs_out_loudly():
    every = frozenset(generate(0, i, 1).question for i in range(2000))
    with pytest.raises(UserError, match="held-out"):
        problem_list(0, [1], 10, ("strict",), exclude=every)
    with pytest.raises(UserError, match="level 9"):
        generate(0, 0, 9)
