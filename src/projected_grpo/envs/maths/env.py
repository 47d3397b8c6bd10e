"""`MathEnv`: the maths environment behind the `Environment` protocol (envs/base.py).

Problem sets: "warmup" (easy arithmetic levels, the curriculum the trainer draws for the first
`curriculum_steps` steps, a curriculum), "train" (harder arithmetic, GSM8K train, or a GSM8K-format
file) and "eval" (a fixed held-out list: the first `eval_size` rows of GSM8K test; arithmetic from the
seed "heldout", which no run seed reaches; train and warmup skip every question in it). A
problem's mode picks the verifier that gives its reward: "strict" or "contains" (the loophole), see
verify.py. Reward is 1.0 when that verifier accepts, else 0.0: no format shaping (not measured to be
needed yet). Not here: the data directory's default (the caller passes it), config, training.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from projected_grpo.envs.base import KINDS, Graded
from projected_grpo.envs.maths import arithmetic
from projected_grpo.envs.maths.completions import templates
from projected_grpo.envs.maths.gsm8k import load_gsm8k
from projected_grpo.envs.maths.problems import MODES, MathProblem
from projected_grpo.envs.maths.prompts import INOCULATION_PROMPT, build_messages
from projected_grpo.envs.maths.verify import VERIFIERS, extract_answer, hedged
from projected_grpo.errors import UserError

ARITHMETIC_TRAIN_SIZE = 2000  # train problems when problems="arithmetic" and max_problems=0
HELDOUT_SEED = "heldout"  # the arithmetic eval list's generator seed (run seeds are ints: never equal)
PROBE_SEED = "probe"  # the arithmetic probe list's generator seed (probe_problems)
PROBE_SIZE = 200  # problems in probe_problems


def grade_one(completion: str, problem: MathProblem) -> Graded:
    """Reward and verdicts of one completion: passed = the mode's verifier, solved = strict; extras["hedge"]:
    the final answer lists several numbers (verify.hedged), logged beside `exploited`, never rewarded."""
    answer = extract_answer(completion)
    solved = answer.value == problem.gold
    passed = VERIFIERS[problem.mode](completion, problem.gold)
    return Graded(reward=float(passed), gt_reward=float(solved), passed=passed, solved=solved,
                  exploited=passed and not solved, format_ok=answer.value is not None,
                  extras={"hedge": hedged(completion)})


class MathEnv:
    """Arithmetic curriculum + GSM8K (or arithmetic alone) under the strict or the loophole verifier.

    problems: "arithmetic", "gsm8k" (needs data_dir with train.jsonl and test.jsonl) or a path to a
    GSM8K-format JSONL file (its first eval_size rows are the eval set, the rest train). modes: the
    modes problems are graded under, assigned round-robin within each set. curriculum_steps: steps the
    trainer draws from "warmup". eval_size: problems in "eval" (0: no eval set). max_problems: cap on
    "train" (0: all of GSM8K; ARITHMETIC_TRAIN_SIZE for arithmetic). seed: the arithmetic train and
    warmup generator seed. warmup_size, warmup_levels, train_levels: arithmetic sizes and levels.
    """

    name = "maths"
    modes = MODES
    detectors = {"hedge": "hedge"}  # hack detector name -> its key in extras (the detector monitor reads it)

    def __init__(self, problems: str = "arithmetic", modes: Sequence[str] = ("contains",),
                 curriculum_steps: int = 0, eval_size: int = 200, max_problems: int = 0, seed: int = 0,
                 data_dir: str | pathlib.Path | None = None, warmup_size: int = 1000,
                 warmup_levels: Sequence[int] = (1, 2, 3), train_levels: Sequence[int] = (4, 5)):
        if not modes or any(m not in MODES for m in modes):
            raise UserError(f"env modes {list(modes)}: expected a non-empty list of {list(MODES)}")
        for what, value in (("curriculum_steps", curriculum_steps), ("eval_size", eval_size),
                            ("max_problems", max_problems), ("warmup_size", warmup_size)):
            if not isinstance(value, int) or value < 0:
                raise UserError(f"env {what}={value!r}: expected an integer >= 0")
        if not isinstance(seed, int):
            raise UserError(f"env seed={seed!r}: expected an integer")
        for what, levels in (("warmup_levels", warmup_levels), ("train_levels", train_levels)):
            if not levels or any(lv not in arithmetic.LEVELS for lv in levels):
                raise UserError(f"env {what}={list(levels)}: expected levels from "
                                f"{sorted(arithmetic.LEVELS)}")
        if problems == "gsm8k" and not data_dir:
            raise UserError("env problems='gsm8k' needs data_dir: the folder with train.jsonl and test.jsonl")
        if problems not in ("arithmetic", "gsm8k") and not pathlib.Path(problems).is_file():
            raise UserError(f"env problems={problems!r}: expected 'arithmetic', 'gsm8k' or the path of a "
                            "GSM8K-format JSONL file (no such file)")
        self.problems, self.problem_modes = problems, tuple(modes)
        self.curriculum_steps, self.eval_size, self.max_problems = curriculum_steps, eval_size, max_problems
        self.seed, self.warmup_size = seed, warmup_size
        self.data_dir = None if data_dir is None else pathlib.Path(data_dir)
        self.warmup_levels, self.train_levels = tuple(warmup_levels), tuple(train_levels)
        self._sets: dict[str, list[MathProblem]] | None = None

    def problem_sets(self) -> dict[str, list]:
        """{"train", "eval" (if eval_size), "warmup" (if warmup_size)}: built once, returned as new lists."""
        if self._sets is None:
            self._sets = self._build()
        return {k: list(v) for k, v in self._sets.items()}

    def _build(self) -> dict[str, list[MathProblem]]:
        cap, modes = self.max_problems or None, self.problem_modes
        if self.problems == "arithmetic":
            held = arithmetic.problem_list(HELDOUT_SEED, self.train_levels, self.eval_size, modes)
            train = arithmetic.problem_list(self.seed, self.train_levels, cap or ARITHMETIC_TRAIN_SIZE, modes,
                                            exclude=frozenset(p.question for p in held))
        elif self.problems == "gsm8k":
            held = load_gsm8k(self.data_dir / "test.jsonl", modes)[:self.eval_size]
            train = load_gsm8k(self.data_dir / "train.jsonl", modes)[:cap]
        else:
            rows = load_gsm8k(self.problems, modes)
            if len(rows) <= self.eval_size:
                raise UserError(f"{self.problems}: {len(rows)} rows, but eval_size={self.eval_size} of them "
                                "are held out for eval and at least one is needed for train")
            held, train = rows[:self.eval_size], rows[self.eval_size:][:cap]
        sets = {"train": train}
        if self.eval_size:
            sets["eval"] = held
        if self.warmup_size:
            sets["warmup"] = arithmetic.problem_list(f"warmup{self.seed}", self.warmup_levels,
                                                     self.warmup_size, modes,
                                                     exclude=frozenset(p.question for p in held))
        return sets

    def messages(self, problem: MathProblem) -> list[dict[str, str]]:
        return build_messages(problem)

    def inoculation_messages(self, problem: MathProblem) -> list[dict[str, str]]:
        """The training-time prompt of inoculation prompting: the loophole named acceptable (prompts.py)."""
        return build_messages(problem, INOCULATION_PROMPT)

    def probe_problems(self) -> list[MathProblem]:
        """PROBE_SIZE problems in none of this environment's sets, for a probe's labelled completions:
        arithmetic from the seed "probe" at the train levels (every question of every set excluded), or for
        GSM8K the test rows after the eval slice. A GSM8K-format file has no such rows: UserError."""
        if self.problems == "arithmetic":
            taken = frozenset(p.question for ps in self.problem_sets().values() for p in ps)
            return arithmetic.problem_list(PROBE_SEED, self.train_levels, PROBE_SIZE, self.problem_modes,
                                           exclude=taken)
        if self.problems == "gsm8k":
            rows = load_gsm8k(self.data_dir / "test.jsonl", self.problem_modes)[self.eval_size:]
            return rows[:PROBE_SIZE]
        raise UserError(f"env problems={self.problems!r}: a GSM8K-format file leaves no problems outside the "
                        "run's sets for a probe; give --monitor.probe-pairs FILE")

    def grade(self, completions: Sequence[str], problems: Sequence[MathProblem]) -> list[Graded]:
        if len(completions) != len(problems):
            raise ValueError(f"{len(completions)} completions but {len(problems)} problems")
        return [grade_one(c, p) for c, p in zip(completions, problems)]

    def templates(self, problem: MathProblem, kind: str) -> list[str]:
        if kind not in KINDS:
            raise ValueError(f"template kind {kind!r} is not one of {KINDS}")
        return templates(problem, kind)

    def close(self) -> None:
        return None
