"""The environment interface: problems -> chat prompt -> grade a batch of completions -> `Graded` records.

An environment is any object with the methods of `Environment` (a Protocol: nothing to inherit). The
training loop, pool building, organism checks and the experiment runner talk to it only through them:
  problem_sets()     named problem lists: "train" always; "warmup" (a curriculum drawn for the first
                     `curriculum_steps` steps) and "eval" (a fixed held-out slice) where it has them
  messages(problem)  the chat messages of the problem's prompt (the tokenizer's chat template encodes them)
  grade(texts, problems) -> list[Graded], one per completion, in order
  templates(problem, kind) -> hand-written completions of kind "clean" | "buggy" | "hack" ([] when none):
                     teacher pools, V_hack's built-in pairs and the organism's warm-up are made of them
Optional members, which the interventions read where an environment has them (docs/interventions.md; a
monitor or intervention that needs one the environment lacks is refused in one line):
  inoculation_messages(problem)  the training-time prompt of inoculation prompting (the loophole named
                     acceptable); evaluation and the deployed model keep messages(problem)
  probe_problems()   problems none of whose prompts the run trains on: the probe monitor's labelled
                     completions are their templates
  detectors          hack detector name -> its key in a grade's extras (coding E -> det_E, maths hedge ->
                     hedge): what the detector monitor reads
  ground_truth       False when `solved` / `exploited` carry no ground truth (the oracle monitors refuse it)
Every problem has `.id` (unique) and `.mode` (its loophole: the foolable mechanism that grades it).
`Graded` is the one shape a graded completion has everywhere (rollout batch, pool row, metrics); a hack is
`passed and not solved`: the foolable grader accepted what the ground truth rejects (docs/architecture.md).
`RewardFnEnv` wraps a plain reward callable in TRL's style, `fn(prompts, completions, **columns)`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from projected_grpo.errors import UserError
from projected_grpo.store import read_jsonl

KINDS = ("clean", "buggy", "hack")  # template completions: honest-correct, honest-wrong, loophole


@dataclasses.dataclass(frozen=True)
class Graded:
    """One graded completion.

    reward: what training optimises (the foolable grader's verdict, shaped; never the ground truth).
    gt_reward: the same shape with the ground truth in the grader's place: what the `gt_reward` baseline
    (env.reward_from = "oracle") trains on, stored beside `reward` so one pool serves every arm.
    passed: the foolable grader accepted it. solved: the ground truth (oracle / strict verifier) accepted it.
    exploited: passed and not solved, a hack. format_ok: a well-formed answer (code: a compiling block with
    the method; maths: a final answer the strict verifier can read). timeout: grading ran out of time.
    extras: environment-specific flags, logged and stored, never rewarded (code: detectors det_E, det_C,
    det_D, and grade_error: grading it raised); keys are fixed per environment.
    """

    reward: float
    gt_reward: float
    passed: bool
    solved: bool
    exploited: bool
    format_ok: bool
    timeout: bool = False
    extras: Mapping[str, bool] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"reward": float(self.reward), "gt_reward": float(self.gt_reward), "passed": self.passed,
                "solved": self.solved, "exploited": self.exploited, "format_ok": self.format_ok,
                "timeout": self.timeout, "extras": dict(self.extras)}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "grade") -> Graded:
        """Inverse of `to_dict`; a missing or mistyped field raises UserError naming `where`."""
        types = {"reward": (int, float), "gt_reward": (int, float), "passed": bool, "solved": bool,
                 "exploited": bool, "format_ok": bool, "timeout": bool, "extras": dict}
        if not isinstance(d, Mapping) or set(d) != set(types):
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise UserError(f"{where}: a grade needs exactly the fields {sorted(types)}, got {got}")
        for k, t in types.items():
            if not isinstance(d[k], t) or (t is not bool and isinstance(d[k], bool)):
                want = getattr(t, "__name__", "number")
                raise UserError(f"{where}: grade field {k!r} must be {want}, got {d[k]!r}")
        if d["exploited"] != (d["passed"] and not d["solved"]):
            raise UserError(f"{where}: grade says exploited={d['exploited']} but passed={d['passed']}, "
                            f"solved={d['solved']} (exploited must be passed and not solved)")
        return cls(**{**d, "reward": float(d["reward"]), "gt_reward": float(d["gt_reward"]),
                      "extras": dict(d["extras"])})


@runtime_checkable
class Problem(Protocol):
    """What every environment's problem has."""

    id: str
    mode: str


@runtime_checkable
class Environment(Protocol):
    """See the module docstring. `name` is the registry name; `modes` the loophole modes it knows."""

    name: str
    modes: tuple[str, ...]
    curriculum_steps: int

    def problem_sets(self) -> dict[str, list]: ...

    def messages(self, problem) -> list[dict[str, str]]: ...

    def grade(self, completions: Sequence[str], problems: Sequence) -> list[Graded]: ...

    def templates(self, problem, kind: str) -> list[str]: ...

    def close(self) -> None: ...


# --- a plain reward callable as an environment (TRL's reward-function contract) ----------------------------


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """A row of a prompts file: `prompt` (a string or chat messages) and any other columns."""

    id: str
    prompt: object
    columns: Mapping[str, object]
    mode: str = "reward_fn"


def load_reward_fn(spec: str) -> Callable:
    """`module.path:function` -> the callable; a bad spec raises UserError saying what was expected."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise UserError(f"env.reward_fn={spec!r}: expected 'module.path:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"env.reward_fn={spec!r}: cannot import it ({type(e).__name__}: {e})") from e
    if not callable(fn):
        raise UserError(f"env.reward_fn={spec!r} is not callable")
    return fn


class RewardFnEnv:
    """A TRL-style reward `fn(prompts, completions, **columns) -> list[float]` as an environment.

    Problems come from a JSONL file (one object per line: `prompt`, a string or a list of chat messages,
    and any other columns, passed to fn by name as lists, as TRL does) or are given directly. There is no
    ground truth: `passed` is reward > 0, `solved` and `exploited` are False (hack and solve rates read 0),
    and gt_reward is the reward itself.
    """

    name = "reward_fn"
    modes = ("reward_fn",)
    curriculum_steps = 0
    ground_truth = False  # solved and exploited are always False: nothing for an oracle monitor to read

    def __init__(self, fn: Callable, rows: Sequence[PromptRow], system_prompt: str = ""):
        if not rows:
            raise UserError("reward_fn environment: no prompts")
        self.fn, self.rows, self.system_prompt = fn, list(rows), system_prompt
        self.fn_name = f"env.reward_fn {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"

    @classmethod
    def from_jsonl(cls, fn: Callable, path: str, max_rows: int = 0) -> RewardFnEnv:
        rows = []
        for where, obj in read_jsonl(path):
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise UserError(f"{where}: a prompt row must be a JSON object with a 'prompt' field")
            rows.append(PromptRow(id=str(obj.get("id", where.rpartition(":")[2])), prompt=obj["prompt"],
                                  columns={k: v for k, v in obj.items() if k not in ("prompt", "id")}))
        return cls(fn, rows[:max_rows or None])

    def problem_sets(self) -> dict[str, list]:
        return {"train": list(self.rows)}

    def messages(self, problem: PromptRow) -> list[dict[str, str]]:
        if isinstance(problem.prompt, str):
            head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return head + [{"role": "user", "content": problem.prompt}]
        return list(problem.prompt)

    def grade(self, completions: Sequence[str], problems: Sequence[PromptRow]) -> list[Graded]:
        """One Graded per completion from the user's function, which is called once per batch; what it
        returns is checked (a sequence of finite numbers, one per completion) and its exceptions are reported
        as the user's (UserError naming the function; --debug shows its traceback)."""
        if not completions:
            return []
        keys = sorted({k for p in problems for k in p.columns})
        columns = {k: [p.columns.get(k) for p in problems] for k in keys}
        try:
            rewards = self.fn(prompts=[p.prompt for p in problems], completions=list(completions), **columns)
        except Exception as e:  # the user's code: one line naming it, the traceback under --debug
            raise UserError(f"{self.fn_name} raised {type(e).__name__}: {e} (called on {len(completions)} "
                            "completions; --debug shows its traceback)") from e
        return [Graded(reward=r, gt_reward=r, passed=r > 0, solved=False, exploited=False, format_ok=True)
                for r in self._checked(rewards, completions)]

    def _checked(self, rewards: object, completions: Sequence[str]) -> list[float]:
        """rewards as floats, or UserError naming the function, the index and what was expected."""
        n, want = len(completions), f"expected a list of {len(completions)} finite floats, one per completion"
        if isinstance(rewards, (str, bytes, Mapping)) or not hasattr(rewards, "__len__"):
            raise UserError(f"{self.fn_name} returned a {type(rewards).__name__}; {want}")
        if len(rewards) != n:
            raise UserError(f"{self.fn_name} returned {len(rewards)} rewards for {n} completions; {want}")
        out = []
        for i, r in enumerate(rewards):
            try:
                x = float(r) if not isinstance(r, (str, bytes)) else None
            except (TypeError, ValueError):
                x = None
            if x is None or not math.isfinite(x):
                raise UserError(f"{self.fn_name} returned {r!r:.40} at index {i} (completion "
                                f"{completions[i][:40]!r}); {want}")
            out.append(x)
        return out

    def templates(self, problem, kind: str) -> list[str]:
        return []

    def close(self) -> None:
        return None
