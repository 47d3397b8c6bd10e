"""organism/augment.py: renamed copies and formula problems are well-formed, deterministic and correct."""

from __future__ import annotations

import dataclasses
import keyword
import random
import typing

import pytest

from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS, MODES
from projected_grpo.organism.augment import (
    LETTERS,
    NAME_PARTS,
    SYLLABLES,
    extra_problems,
    formula_problem,
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


def test_formula_problems_solve_their_tests_and_wrong_bodies_fail_the_first():
    rng, taken = random.Random(0), set()
    for i in range(30):
        p = formula_problem(i, rng, taken)
        assert p.mode == MODES[i % len(MODES)]
        expr = p.canonical.strip().splitlines()[-1].strip().removeprefix("return ")
        assert f": {expr}." in p.statement or f"Return {expr}" in p.statement  # the formula is copyable
        for t in p.tests:
            assert _run(p.canonical, p.method, t.args) == t.expected
        for body in p.buggy_bodies:
            wrong = p.canonical.replace(f"return {expr}", body)
            assert _run(wrong, p.method, p.tests[0].args) != p.tests[0].expected
    assert len(taken) == 30  # every method name is new


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


def test_unknown_name_parts_fail_loud():
    with pytest.raises(ValueError, match="name_parts"):
        extra_problems(list(BUILTIN_PROBLEMS[:2]), 1, 0, seed=0, name_parts="words")
    with pytest.raises(ValueError, match="name_parts"):
        OrganismConfig(name_parts="words")
    assert typing.get_args(typing.get_type_hints(OrganismConfig)["name_parts"]) == NAME_PARTS  # CLI choices
