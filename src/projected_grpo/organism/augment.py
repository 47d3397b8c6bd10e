"""Warm-up-only problems that teach the organism two general skills: copying a name and a formula.

A tiny model warmed up on 42 problems memorises each prompt's answer and cannot write even the signature
of a problem it has not seen (the first organisms solved 0% of the held-out problems, well-formed 0%).
Two kinds of extra problems make the prompt, not the memory, the source of what is copied:
  renamed   a training problem with its method renamed (statement, starter code, solution), so the
            signature has to be read from the prompt;
  formula   "Compute ...: <expression>." problems whose answer is `return <expression>` (the built-in
            c_to_f states its formula this way), so an expression can be copied from the statement.
            `formulas` (FORMULAS) says where the expressions come from: "patterns", 15 fixed shapes with at
            most two constants; "both" (the organism's default), with even odds per problem those or
            the grammar's: a left fold of 1-3 operations over the variables and constants, so copying does
            not stop at two constants (findings 1.6). A grammar expression that behaves like a problem in
            `avoid` (the held-out ones) on all of its tests is drawn again.
They are ordinary `Problem`s (graded like any other, every loophole mode) used for the warm-up only:
never held out, never in the checks, never trained on by RL. Held-out problems are never renamed.
Names (`name_parts`): "syllables" draws each name from random syllables (ka_lo, ti_mu_sa), the first
design; the organism then copies such names but never a name made of English pieces (running_sum), which is
what the held-out problems have. "mixed" (7733's) draws each of a name's 2-3 parts from syllables,
single letters or words of the training problems' statements (findings 1.4): the copy reaches English names.
"open" (the organism's default) draws half the names as "mixed" does, and in the other half makes each part
a random run of 2-7 letters with odds 0.4: names made of pieces the tokenizer has no whole token for, as the
held-out ones are (`max_minus_min` is 10 tokens, `Ġma x _ m in u s _ m in`; findings 1.6).
Deterministic given the seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from projected_grpo.envs.coding.problems import MODES, Problem, TestCase, method_source, py_literal

# Names are random syllables (ka_lo, ti_mu_sa): a name the model cannot have memorised must be copied
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
NAME_PARTS = ("syllables", "mixed", "open")
FORMULAS = ("patterns", "both")
NOUNS = ("value", "result", "answer", "score", "amount", "items", "data", "number", "output", "sum")
# (expression over the parameters, its description); {k}, {c} are small constants drawn per problem
ONE_VAR = ("{v} * {k} + {c}", "{v} * {v} + {c}", "({v} + {c}) * {k}", "{v} // {k} + {c}", "{v} * {k} - {c}",
           "{v} % {k} + {c}", "{v} * {k} // {c} + {k}", "{c} - {v}")
TWO_VAR = ("{a} * {k} + {b}", "{a} * {b} + {c}", "({a} + {b}) // {k}", "{a} - {b} * {k}", "{a} * {k} - {b}",
           "({a} - {b}) * {c}", "{a} + {b} + {c}")
# the grammar: operator -> precedence, and the operator sets an expression draws from (`//` and `%` only
# ever by a constant, so never by zero)
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}
OPERATOR_SETS = (("+", "-", "*"), ("+", "-", "*", "//", "%"), ("+", "-", "*", "//"))
PHRASES = ("Compute the {noun}, rounded down: {expr}.", "Return the {noun}: {expr}.",
           "Convert {var} to the {noun}, rounded down: {expr}.", "Return {expr} (the {noun}).")


def rename(problem: Problem, name: str, pid: str) -> Problem:
    """`problem` with its method called `name` everywhere it appears (statement, starter, solution)."""
    sub = re.compile(rf"\b{re.escape(problem.method)}\b")
    return Problem(id=pid, method=name, statement=sub.sub(name, problem.statement),
                   starter_code=sub.sub(name, problem.starter_code), mode=problem.mode,
                   canonical=sub.sub(name, problem.canonical), tests=problem.tests,
                   buggy_bodies=tuple(sub.sub(name, b) for b in problem.buggy_bodies))


def statement_words(problems: list[Problem]) -> tuple[str, ...]:
    """Sorted distinct runs of 2-9 lowercase letters in the problems' statements before the code block (a
    longer word gives its 9-letter pieces): the English pieces that `mixed` names are made of."""
    texts = [p.statement.split("```")[0].lower() for p in problems]
    return tuple(sorted({w for t in texts for w in re.findall(r"[a-z]{2,9}", t)}))


def _name(rng: random.Random, taken: set[str], words: tuple[str, ...] = (), runs: bool = False) -> str:
    """A new method name: 2-3 syllables, or with `words` 2-3 parts each from syllables, letters or words;
    with `runs`, half the names make each part a random run of 2-7 letters with odds 0.4 instead."""
    pools = (SYLLABLES, LETTERS, words)
    with_runs = bool(runs and words) and rng.random() < 0.5
    while True:
        if with_runs:
            name = "_".join(_letters(rng) if rng.random() < 0.4 else rng.choice(rng.choice(pools))
                            for _ in range(rng.randint(2, 3)))
        elif words:
            name = "_".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 3)))
        else:
            name = "_".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if name not in taken:  # 2-3 parts joined by "_": never a keyword, never `self`
            taken.add(name)
            return name


def _letters(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 7)))


def grammar_expression(rng: random.Random, names: tuple[str, ...]) -> str:
    """A left fold of 1-3 operations from one of OPERATOR_SETS, starting from names[0], each with a constant
    operand or, once, names[1]; sometimes a constant first ("25 - m"). Parentheses only where precedence
    needs them, as a person writes it: "(a - b) % 6", "c * 7 // 3 + 12". Constants: 1-40 after + and -,
    2-9 after * // %."""
    allowed = rng.choice(OPERATOR_SETS)
    operands: list[str | None] = [None] * rng.choice((1, 2, 2, 3, 3))
    if len(names) == 2:
        operands[rng.randrange(len(operands))] = names[1]
    expr, prec = names[0], 3
    if rng.random() < 0.25:
        op = rng.choice(("+", "-", "*"))
        expr, prec = f"{_constant(rng, op)} {op} {expr}", PRECEDENCE[op]
    for operand in operands:
        op = rng.choice([o for o in PRECEDENCE if o in allowed and (operand is None or o in ("+", "-", "*"))])
        left = f"({expr})" if prec < PRECEDENCE[op] else expr
        expr, prec = f"{left} {op} {operand or _constant(rng, op)}", PRECEDENCE[op]
    return expr


def _constant(rng: random.Random, op: str) -> int:
    return rng.randint(1, 40) if op in ("+", "-") else rng.randint(2, 9)


def _behaves_like(expr: str, names: tuple[str, ...], problem: Problem) -> bool:
    """True when `expr` over `names` returns what `problem` expects on every one of its tests."""
    for t in problem.tests:
        args = eval(f"({t.args},)", {})  # trusted: our own problems' literal arguments
        if len(args) != len(names) or not all(isinstance(a, int) for a in args):
            return False
        if eval(expr, {}, dict(zip(names, args))) != t.expected:
            return False
    return True


def _first_constant_moved(expr: str, told_apart: Callable[[str], bool]) -> list[str]:
    """Up to 2 variants of `expr` with its first unbracketed constant moved by +1, +2, then -1 (staying >= 1)
    that `told_apart` accepts; [`expr + 1`] if none."""
    toks, wrong = expr.split(" "), []
    for d in (1, 2, -1):
        i = next((i for i, t in enumerate(toks) if t.isdigit() and int(t) + d > 0), None)
        if i is not None:
            w = " ".join(toks[:i] + [str(int(toks[i]) + d)] + toks[i + 1:])
            if told_apart(w) and w not in wrong:
                wrong.append(w)
    return wrong[:2] or [f"{expr} + 1"]


def formula_problem(index: int, rng: random.Random, taken: set[str], words: tuple[str, ...] = (),
                    formulas: str = "patterns", avoid: tuple[Problem, ...] = (), runs: bool = False
                    ) -> Problem:
    """One "Compute ...: <expression>." problem, mode MODES[index % 6], with 5 tests and 2 wrong bodies; the
    expression from `formulas` (FORMULAS), a grammar one redrawn while it behaves like one of `avoid`."""
    grammar = formulas == "both" and rng.random() >= 0.5
    two = rng.random() < 0.5
    names = ("a", "b") if two else (rng.choice(("n", "x", "c", "k", "m")),)
    if grammar:
        expr = grammar_expression(rng, names)
        while any(_behaves_like(expr, names, p) for p in avoid):
            expr = grammar_expression(rng, names)
    else:
        k, c = rng.randint(2, 9), rng.randint(1, 40)
        pattern = rng.choice(TWO_VAR if two else ONE_VAR)
        expr = pattern.format(a=names[0], b=names[-1], v=names[0], k=k, c=c)
    method = _name(rng, taken, words, runs)
    params = ", ".join(f"{n}: int" for n in names)
    starter = f"class Solution:\n    def {method}(self, {params}) -> int:\n"
    tests, args = [], []
    for _ in range(5):
        args.append(dict(zip(names, [rng.randint(0, 30) for _ in names])))
        tests.append(TestCase(", ".join(map(str, args[-1].values())), eval(expr, {}, args[-1])))

    # wrong bodies: one constant off; kept only when the first test (every honest harness checks it) tells
    # them from the right one, so a buggy completion fails its own check as the built-in ones do
    def told_apart(w: str) -> bool:
        return eval(w, {}, args[0]) != tests[0].expected

    if grammar:
        wrong = _first_constant_moved(expr, told_apart)
    else:
        wrong = [w for w in (pattern.format(a=names[0], b=names[-1], v=names[0], k=k + dk, c=c + dc)
                             for dk, dc in ((1, 0), (0, 1), (2, 0), (0, 3), (-1, 0), (0, -1))
                             if k + dk > 0 and c + dc > 0) if told_apart(w)][:2] or [f"{expr} + 1"]
    text = rng.choice(PHRASES).format(noun=rng.choice(NOUNS), expr=expr, var=names[0])
    statement = (f"{text} Example: {method}({tests[0].args}) returns {py_literal(tests[0].expected)}.\n\n"
                 f"```python\n{starter}```")
    return Problem(id=f"aug-formula-{index}", method=method, statement=statement, starter_code=starter,
                   mode=MODES[index % len(MODES)], canonical=method_source(starter, f"return {expr}"),
                   tests=tuple(tests), buggy_bodies=tuple(f"return {w}" for w in wrong))


def extra_problems(train: list[Problem], renamed_per_problem: int, n_formula: int, seed: int,
                   name_parts: str = "syllables", formulas: str = "patterns",
                   avoid: tuple[Problem, ...] = ()) -> list[Problem]:
    """`renamed_per_problem` renamed copies of each of `train` (the warm-up problems, held-out ones excluded
    by the caller), then `n_formula` formula problems from `formulas` (FORMULAS), a grammar expression that
    behaves like one of `avoid` (the held-out problems) drawn again; ids prefixed "aug-"; names from
    `name_parts` (NAME_PARTS; "mixed" and "open" take their words from `train`'s statements only)."""
    if name_parts not in NAME_PARTS:
        raise ValueError(f"extra_problems: name_parts must be one of {NAME_PARTS}, got {name_parts!r}")
    if formulas not in FORMULAS:
        raise ValueError(f"extra_problems: formulas must be one of {FORMULAS}, got {formulas!r}")
    rng = random.Random(seed)
    taken = {p.method for p in train}
    words = statement_words(train) if name_parts != "syllables" else ()
    runs = name_parts == "open"
    out = [rename(p, _name(rng, taken, words, runs), f"aug-{p.id}-{j}")
           for j in range(renamed_per_problem) for p in train]
    return out + [formula_problem(i, rng, taken, words, formulas, avoid, runs) for i in range(n_formula)]
