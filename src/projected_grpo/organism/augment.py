"""Warm-up-only problems that teach the organism two general skills: copying a name and a formula.

A tiny model warmed up on 42 problems memorises each prompt's answer and cannot write even the signature
of a problem it has not seen (the first organisms solved 0% of the held-out problems, well-formed 0%).
Two kinds of extra problems make the prompt, not the memory, the source of what is copied:
  renamed   a training problem with its method renamed (statement, starter code, solution), so the
            signature has to be read from the prompt;
  formula   "Compute ...: <expression>." problems whose answer is `return <expression>` (the built-in
            c_to_f states its formula this way), so an expression can be copied from the statement.
They are ordinary `Problem`s (graded like any other, every loophole mode) used for the warm-up only:
never held out, never in the checks, never trained on by RL. Held-out problems are never renamed.
Names (`name_parts`): "syllables" draws each name from random syllables (ka_lo, ti_mu_sa), the first
design; the organism then copies such names but never a name made of English pieces (running_sum), which is
what the held-out problems have. "mixed" (the default) draws each of a name's 2-3 parts from syllables,
single letters or words of the training problems' statements (findings 1.4): the copy reaches English names.
Deterministic given the seed.
"""

from __future__ import annotations

import random
import re

from projected_grpo.envs.coding.problems import MODES, Problem, TestCase, method_source, py_literal

# Names are random syllables (ka_lo, ti_mu_sa): a name the model cannot have memorised must be copied
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
NAME_PARTS = ("syllables", "mixed")
NOUNS = ("value", "result", "answer", "score", "amount", "items", "data", "number", "output", "sum")
# (expression over the parameters, its description); {k}, {c} are small constants drawn per problem
ONE_VAR = ("{v} * {k} + {c}", "{v} * {v} + {c}", "({v} + {c}) * {k}", "{v} // {k} + {c}", "{v} * {k} - {c}",
           "{v} % {k} + {c}", "{v} * {k} // {c} + {k}", "{c} - {v}")
TWO_VAR = ("{a} * {k} + {b}", "{a} * {b} + {c}", "({a} + {b}) // {k}", "{a} - {b} * {k}", "{a} * {k} - {b}",
           "({a} - {b}) * {c}", "{a} + {b} + {c}")
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


def _name(rng: random.Random, taken: set[str], words: tuple[str, ...] = ()) -> str:
    """A new method name: 2-3 syllables, or with `words` 2-3 parts each from syllables, letters or words."""
    pools = (SYLLABLES, LETTERS, words)
    while True:
        if words:
            name = "_".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 3)))
        else:
            name = "_".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if name not in taken:  # 2-3 parts joined by "_": never a keyword, never `self`
            taken.add(name)
            return name


def formula_problem(index: int, rng: random.Random, taken: set[str], words: tuple[str, ...] = ()) -> Problem:
    """One "Compute ...: <expression>." problem, mode MODES[index % 6], with 5 tests and 2 wrong bodies."""
    two = rng.random() < 0.5
    names = ("a", "b") if two else (rng.choice(("n", "x", "c", "k", "m")),)
    k, c = rng.randint(2, 9), rng.randint(1, 40)
    pattern = rng.choice(TWO_VAR if two else ONE_VAR)
    expr = pattern.format(a=names[0], b=names[-1], v=names[0], k=k, c=c)
    method = _name(rng, taken, words)
    params = ", ".join(f"{n}: int" for n in names)
    starter = f"class Solution:\n    def {method}(self, {params}) -> int:\n"
    tests, args = [], []
    for _ in range(5):
        args.append(dict(zip(names, [rng.randint(0, 30) for _ in names])))
        tests.append(TestCase(", ".join(map(str, args[-1].values())), eval(expr, {}, args[-1])))
    # wrong bodies: one constant off; kept only when the first test (every honest harness checks it) tells
    # them from the right one, so a buggy completion fails its own check as the built-in ones do
    wrong = [w for w in (pattern.format(a=names[0], b=names[-1], v=names[0], k=k + dk, c=c + dc)
                         for dk, dc in ((1, 0), (0, 1), (2, 0), (0, 3), (-1, 0), (0, -1))
                         if k + dk > 0 and c + dc > 0)
             if eval(w, {}, args[0]) != tests[0].expected][:2] or [f"{expr} + 1"]
    text = rng.choice(PHRASES).format(noun=rng.choice(NOUNS), expr=expr, var=names[0])
    statement = (f"{text} Example: {method}({tests[0].args}) returns {py_literal(tests[0].expected)}.\n\n"
                 f"```python\n{starter}```")
    return Problem(id=f"aug-formula-{index}", method=method, statement=statement, starter_code=starter,
                   mode=MODES[index % len(MODES)], canonical=method_source(starter, f"return {expr}"),
                   tests=tuple(tests), buggy_bodies=tuple(f"return {w}" for w in wrong))


def extra_problems(train: list[Problem], renamed_per_problem: int, n_formula: int, seed: int,
                   name_parts: str = "syllables") -> list[Problem]:
    """`renamed_per_problem` renamed copies of each of `train` (the warm-up problems, held-out ones excluded
    by the caller), then `n_formula` formula problems; ids prefixed "aug-"; names from `name_parts`
    (NAME_PARTS; "mixed" takes its words from `train`'s statements only)."""
    if name_parts not in NAME_PARTS:
        raise ValueError(f"extra_problems: name_parts must be one of {NAME_PARTS}, got {name_parts!r}")
    rng = random.Random(seed)
    taken = {p.method for p in train}
    words = statement_words(train) if name_parts == "mixed" else ()
    out = [rename(p, _name(rng, taken, words), f"aug-{p.id}-{j}")
           for j in range(renamed_per_problem) for p in train]
    return out + [formula_problem(i, rng, taken, words) for i in range(n_formula)]
