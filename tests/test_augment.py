"""organism/augment.py: renamed copies and formula problems are well-formed, deterministic and correct."""

from __future__ import annotations

import ast
import dataclasses
import keyword
import random
import typing

import pytest

from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES, Problem, TestCase
from projected_grpo.organism.augment import (
    FORMULAS,
    LETTERS,
    NAME_PARTS,
    SYLLABLES,
    _first_constant_moved,
    extra_problems,
    formula_problem,
    grammar_expression,
    rename,
    statement_words,
)
from projected_grpo.organism.build import OrganismConfig


def _run(source: str, method: str, args: str):
    scope: dict = {}
    exec(source, scope)  # trusted: our own generated solutions
    return eval(f"Solution().{method}({args})", scope)


def test_rename_replaces_the_method_everywhere_and_only_it():
    p = BUILTIN_PROBLEMS[0]  # sum_list
    r = rename(p, "get_total", "aug-sum_list-0")
    assert r.method == "get_total" and "sum_list" not in r.statement + r.starter_code + r.canonical
    assert r.statement == p.statement.replace("sum_list", "get_total")
    assert r.tests == p.tests and r.mode == p.mode
    assert _run(r.canonical, "get_total", r.tests[0].args) == r.tests[0].expected


@pytest.mark.parametrize("formulas", FORMULAS)
def test_formula_problems_solve_their_tests_and_wrong_bodies_fail_the_first(formulas):
    rng, taken = random.Random(0), set()
    for i in range(30):
        p = formula_problem(i, rng, taken, formulas=formulas)
        assert p.mode == MODES[i % len(MODES)]
        expr = p.canonical.strip().splitlines()[-1].strip().removeprefix("return ")
        assert f": {expr}." in p.statement or f"Return {expr}" in p.statement  # the formula is copyable
        for t in p.tests:
            assert _run(p.canonical, p.method, t.args) == t.expected
        for body in p.buggy_bodies:
            wrong = p.canonical.replace(f"return {expr}", body)
            assert _run(wrong, p.method, p.tests[0].args) != p.tests[0].expected
    assert len(taken) == 30  # every method name is new


def test_grammar_expressions_read_as_written_and_fold_one_to_three_operations():
    rng = random.Random(5)
    seen = set()
    for _ in range(400):
        names = rng.choice((("a", "b"), ("x",)))
        expr = grammar_expression(rng, names)
        # parentheses only where precedence needs them: Python's own unparse writes the minimal ones
        assert ast.unparse(ast.parse(expr)) == expr
        ops = [t for t in expr.split(" ") if t in ("+", "-", "*", "//", "%")]
        assert 1 <= len(ops) <= 4 and all(n in expr for n in names)  # 1-3 folds, maybe a constant first
        for t in expr.replace("(", " ").replace(")", " ").split():
            if t.isdigit():
                assert 1 <= int(t) <= 40
        toks = expr.split(" ")
        for op, right in zip(toks, toks[1:]):
            if op in ("//", "%"):  # never by a variable, never by zero
                assert right.rstrip(")").isdigit() and int(right.rstrip(")")) >= 2
        seen.add(len(ops))
    assert seen == {1, 2, 3, 4}


def test_formulas_never_behave_like_a_problem_to_avoid():
    # a one-argument problem every expression with f(0) == 0 imitates: x * 7, x % 3, x // 2 + x ...
    zero = Problem(id="z", method="z", statement="", starter_code="", mode=MODES[0], canonical="",
                   tests=(TestCase("0", 0),))
    def imitators(avoid):
        ps = extra_problems(list(BUILTIN_PROBLEMS[:2]), 0, 200, seed=0, formulas="both", avoid=avoid)
        return [p for p in ps if "a: int" not in p.starter_code and _run(p.canonical, p.method, "0") == 0]
    assert len(imitators(())) > 5 and imitators((zero,)) == []


def test_extra_problems_deterministic_and_never_rename_outside_train():
    train = list(BUILTIN_PROBLEMS[:6])
    a = extra_problems(train, 2, 3, seed=1)
    assert a == extra_problems(train, 2, 3, seed=1) and a != extra_problems(train, 2, 3, seed=2)
    assert len(a) == 6 * 2 + 3 and all(p.id.startswith("aug-") for p in a)
    assert {p.id.rsplit("-", 1)[0] for p in a[:12]} == {f"aug-{p.id}" for p in train}
    names = [p.method for p in a]
    assert len(set(names)) == len(names) and not set(names) & {p.method for p in BUILTIN_PROBLEMS[:6]}


def test_statement_words_are_the_letter_runs_before_the_code_block():
    p = rename(BUILTIN_PROBLEMS[0], "get_total", "x")
    p = dataclasses.replace(p, statement="Sum IT up, 3 times: a decreasing run.\n\n```python\nclass S:\n```")
    # lower-cased runs of 2-9 letters: "a" is too short, "decreasing" gives "decreasin" (its first 9 letters;
    # the left-over "g" is too short), nothing from the code block ("class")
    assert statement_words([p]) == ("decreasin", "it", "run", "sum", "times", "up")


def test_mixed_names_draw_parts_from_syllables_letters_and_train_words_only():
    train = list(BUILTIN_PROBLEMS[:6])
    a = extra_problems(train, 4, 10, seed=3, name_parts="mixed")
    assert a == extra_problems(train, 4, 10, seed=3, name_parts="mixed")
    assert [p.method for p in a] != [p.method for p in extra_problems(train, 4, 10, seed=3)]
    words = statement_words(train)
    parts = [part for p in a for part in p.method.split("_")]
    assert set(parts) <= set(SYLLABLES) | set(LETTERS) | set(words)
    assert set(parts) & set(words) - set(SYLLABLES) and set(parts) & set(LETTERS)  # every pool is used
    names = [p.method for p in a]
    assert len(set(names)) == len(names) and all(n.isidentifier() and not keyword.iskeyword(n) for n in names)
    for p in a[:24]:  # the renamed copies still solve their tests under the new name
        assert _run(p.canonical, p.method, p.tests[0].args) == p.tests[0].expected


def test_first_constant_moved_keeps_what_the_first_test_tells_apart():
    # "(25 - m) // 3 + 39": the first bare constant is 3 ("(25" is bracketed): 3 + 1 = 4, 3 + 2 = 5;
    # told_apart refuses 4, so 5 and then 3 - 1 = 2 are kept
    wrong = _first_constant_moved("(25 - m) // 3 + 39", lambda w: "// 4" not in w)
    assert wrong == ["(25 - m) // 5 + 39", "(25 - m) // 2 + 39"]
    assert _first_constant_moved("a * b", lambda w: True) == ["a * b + 1"]  # no constant to move


def test_open_names_add_random_runs_of_letters():
    train = list(BUILTIN_PROBLEMS[:6])
    a = extra_problems(train, 4, 10, seed=3, name_parts="open")
    pools = set(SYLLABLES) | set(LETTERS) | set(statement_words(train))
    parts = [part for p in a for part in p.method.split("_")]
    runs = [part for part in parts if part not in pools]
    assert runs and all(part.isalpha() and 2 <= len(part) <= 7 for part in runs)  # the fourth pool is used
    assert set(parts) & pools  # and the other three still are
    names = [p.method for p in a]
    assert len(set(names)) == len(names) and all(n.isidentifier() and not keyword.iskeyword(n) for n in names)


def test_unknown_name_parts_fail_loud():
    with pytest.raises(ValueError, match="name_parts"):
        extra_problems(list(BUILTIN_PROBLEMS[:2]), 1, 0, seed=0, name_parts="words")
    with pytest.raises(ValueError, match="name_parts"):
        OrganismConfig(name_parts="words")
    assert typing.get_args(typing.get_type_hints(OrganismConfig)["name_parts"]) == NAME_PARTS  # CLI choices
    with pytest.raises(ValueError, match="formulas"):
        extra_problems(list(BUILTIN_PROBLEMS[:2]), 0, 1, seed=0, formulas="trees")
    with pytest.raises(ValueError, match="formulas"):
        OrganismConfig(formulas="trees")
    assert typing.get_args(typing.get_type_hints(OrganismConfig)["formulas"]) == FORMULAS
