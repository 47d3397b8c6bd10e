"""The teacher pool: cached, pre-graded, frozen completions mixed into every GRPO group (seed 002).

A pool is a JSONL file, one row per completion with exactly the keys `POOL_KEYS`. Rows are built
from the built-in templates (hack / clean / buggy completions per problem) or by sampling a teacher
model, graded ONCE by the real grader and frozen: training reads the stored reward and never
re-grades. Token ids are stored next to the text and training packs the stored ids (rollout.pack);
text is never re-tokenised. Loading validates every row (file, line, field) and guards tokenisation
drift: the live chat-template encoding of each problem's prompt must equal the stored prompt_ids.
Also here: deterministic, checkpointable prompt and teacher-row draws, and how teacher tokens enter
the loss (`TEACHER_MODES`, SPEC §3). Not here: grading itself (envs/grading.py), sampling (rollout.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo.run.rollout import encode_completion, encode_prompt, generate, step_seed
from projected_grpo.store import read_jsonl, tokenizer_fingerprint, write_text_atomic

# Row schema: key -> accepted JSON types (None allowed only for logp_behaviour).
POOL_SCHEMA: dict[str, tuple[type, ...]] = {
    "problem_id": (str,), "mode": (str,), "prompt": (str,), "prompt_ids": (list,), "completion": (str,),
    "completion_ids": (list,), "reward": (int, float), "passed": (bool,), "gt_correct": (bool,),
    "exploited": (bool,), "format_ok": (bool,), "det_E": (bool,), "det_C": (bool,), "det_D": (bool,),
    "logp_behaviour": (list, type(None)), "tokenizer_fingerprint": (str,), "source": (str,),
}
POOL_KEYS: tuple[str, ...] = tuple(POOL_SCHEMA)
GRADE_KEYS = ("reward", "passed", "gt_correct", "exploited", "format_ok", "det_E", "det_C", "det_D")


def prompt_text_and_ids(tokenizer, problem) -> tuple[str, list[int]]:
    """The chat-formatted prompt of `problem` (text, ids) exactly as training encodes it."""
    from projected_grpo.envs.coding.prompts import build_messages

    messages = build_messages(problem)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, encode_prompt(tokenizer, messages)


def grade_fields(grade) -> dict:
    """The pool's grade fields of an envs.grading.Grade, plus `timeout` (the sandbox timed out).
    Detectors (SPEC §1.6): E = loophole code present, C = own tests pass a stub, D = weak own tests."""
    return {"reward": float(grade.reward), "passed": grade.passed, "gt_correct": grade.gt_correct,
            "exploited": grade.exploited, "format_ok": grade.format_ok, "det_E": grade.loophole_present,
            "det_C": grade.tests_pass_stub, "det_D": grade.weak_tests, "timeout": grade.status == "timeout"}


def _row(problem, prompt: tuple[str, list[int]], completion: str, completion_ids: list[int], grade,
         logp: list[float] | None, fingerprint: str, source: str) -> dict:
    g = {k: v for k, v in grade_fields(grade).items() if k in GRADE_KEYS}
    return {"problem_id": problem.id, "mode": problem.mode, "prompt": prompt[0], "prompt_ids": prompt[1],
            "completion": completion, "completion_ids": completion_ids, **g,
            "logp_behaviour": logp, "tokenizer_fingerprint": fingerprint,
            "source": source}


# --- build -------------------------------------------------------------------------------------------

def template_rows(problems: Sequence, tokenizer, grader, *, n_hack: int, n_clean: int,
                  n_buggy: int = 0) -> list[dict]:
    """Rows from the built-in completions: the first n_hack / n_clean / n_buggy of each problem's
    variants (fewer when a problem has fewer; `build_report` shows the counts). No behaviour log-probs."""
    from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions

    fp = tokenizer_fingerprint(tokenizer)
    jobs = []
    for p in problems:
        prompt = prompt_text_and_ids(tokenizer, p)
        for kind, fn, n in (("hack", hack_completions, n_hack), ("clean", clean_completions, n_clean),
                            ("buggy", buggy_completions, n_buggy)):
            jobs += [(p, prompt, text, f"template:{kind}") for text in fn(p)[:n]]
    grades = grader.grade_batch([j[2] for j in jobs], [j[0] for j in jobs])
    return [_row(p, prompt, text, encode_completion(tokenizer, text), g, None, fp, src)
            for (p, prompt, text, src), g in zip(jobs, grades)]


def teacher_rows(model, tokenizer, problems: Sequence, grader, *, samples: int, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, name: str) -> list[dict]:
    """Rows sampled from a teacher model (all problems x `samples` in one batch), with behaviour log-probs."""
    fp = tokenizer_fingerprint(tokenizer)
    prompts = [prompt_text_and_ids(tokenizer, p) for p in problems]
    model.eval()
    ro = generate(model, [ids for _, ids in prompts], samples, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, seed=seed, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in ro.completion_ids]
    owners = [p for p in problems for _ in range(samples)]
    grades = grader.grade_batch(texts, owners)
    return [_row(p, prompts[i // samples], texts[i], ro.completion_ids[i], grades[i], ro.logp[i].tolist(), fp,
                 f"teacher:{name}") for i, p in enumerate(owners)]


def write_pool(path: str | pathlib.Path, rows: Sequence[dict]) -> None:
    """Atomically write rows as JSONL (each row validated first)."""
    for i, row in enumerate(rows):
        _validate(row, f"{path} (row {i})")
    write_text_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def build_report(rows: Sequence[dict]) -> str:
    """Counts of rows, hacks (exploited) and solves (gt_correct) per mode and source, one line each."""
    by: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        c = by.setdefault((r["mode"], r["source"]), [0, 0, 0])
        c[0] += 1
        c[1] += r["exploited"]
        c[2] += r["gt_correct"]
    return "\n".join(f"{m:<14} {s:<18} rows={n:<4} exploited={h:<4} gt_correct={g}"
                     for (m, s), (n, h, g) in sorted(by.items()))


# --- load + validate ---------------------------------------------------------------------------------

def _validate(row: object, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a pool row must be a JSON object, got {type(row).__name__}")
    keys = set(row)
    if keys != set(POOL_KEYS):
        raise ValueError(f"{where}: fields differ from the schema: missing {sorted(set(POOL_KEYS) - keys)}; "
                         f"unexpected {sorted(keys - set(POOL_KEYS))}")
    for k, types in POOL_SCHEMA.items():
        v = row[k]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            want = "/".join(t.__name__ for t in types)
            raise ValueError(f"{where}: field {k!r} must be {want}, got {v!r:.80}")
    for k in ("prompt_ids", "completion_ids"):
        if not row[k] or not all(isinstance(t, int) and not isinstance(t, bool) for t in row[k]):
            raise ValueError(f"{where}: field {k!r} must be a non-empty list of token ids")
    lp = row["logp_behaviour"]
    if lp is not None and (len(lp) != len(row["completion_ids"]) or
                           not all(isinstance(x, (int, float)) and x <= 0 for x in lp)):
        raise ValueError(f"{where}: field 'logp_behaviour' must hold one log-prob <= 0 per completion token "
                         f"({len(row['completion_ids'])}), got {len(lp)} values")


@dataclass
class TeacherPool:
    """Validated pool rows, indexed by problem id.  rows: list of dicts with exactly POOL_KEYS."""

    rows: list[dict]
    path: str

    @functools.cached_property
    def by_problem(self) -> dict[str, list[int]]:
        """problem id -> indices of its rows (computed once; rows are frozen)."""
        out: dict[str, list[int]] = {}
        for i, r in enumerate(self.rows):
            out.setdefault(r["problem_id"], []).append(i)
        return out

    def missing(self, problem_ids: Sequence[str]) -> list[str]:
        """Problem ids with no pool rows (reported by the loop, never silently given G_t = 0)."""
        have = self.by_problem
        return [p for p in problem_ids if p not in have]

    def has_behaviour_logp(self) -> bool:
        return all(r["logp_behaviour"] is not None for r in self.rows)


def load_pool(path: str | pathlib.Path, tokenizer, problems: Sequence) -> TeacherPool:
    """Read and validate a pool file against `problems` and the live tokenizer.

    Fails naming file, line and field on a schema error; on tokenisation drift (live prompt ids !=
    stored prompt_ids, or another tokenizer fingerprint) fails showing both.
    """
    path = pathlib.Path(path)
    known = {p.id: p for p in problems}
    fp = tokenizer_fingerprint(tokenizer)
    live: dict[str, list[int]] = {}
    rows = []
    for where, row in read_jsonl(path):
        _validate(row, where)
        pid = row["problem_id"]
        if pid not in known:
            continue  # rows of problems outside this run's problem set (e.g. other modes) are not drawn
        if row["mode"] != known[pid].mode:
            raise ValueError(f"{where}: field 'mode' is {row['mode']!r} but problem {pid!r} has mode "
                             f"{known[pid].mode!r}")
        if pid not in live:
            live[pid] = prompt_text_and_ids(tokenizer, known[pid])[1]
        if row["prompt_ids"] != live[pid]:
            raise ValueError(
                f"{where}: tokenization drift for problem {pid!r}: the live tokenizer encodes its prompt as "
                f"{live[pid]} but the pool stored {row['prompt_ids']}; rebuild the pool with this tokenizer "
                f"(projected-grpo build-pool)")
        if row["tokenizer_fingerprint"] != fp:
            raise ValueError(f"{where}: tokenization drift: the row was built with tokenizer fingerprint "
                             f"{row['tokenizer_fingerprint']}, the live one's is {fp}; rebuild the pool")
        rows.append(row)
    return TeacherPool(rows=rows, path=str(path))


# --- group rows: what the loop packs, grades and scores (student rollouts and drawn teacher rows alike) ---

def student_group_rows(ro, grades: Sequence) -> list[dict]:
    """One row per sampled completion of a rollout.Rollout (N rows) with its Grade's fields; student=True."""
    return [{"prompt_ids": ro.prompt_ids[n], "completion_ids": ro.completion_ids[n],
             "logp_behaviour": ro.logp[n].tolist(), "truncated": bool(ro.truncated[n]), "student": True,
             **grade_fields(grades[n])} for n in range(len(ro.completion_ids))]


def teacher_group_rows(rows: Sequence[dict]) -> list[dict]:
    """Drawn pool rows as group rows: the frozen grade fields as stored; student=False."""
    return [{**r, "truncated": False, "student": False, "timeout": False} for r in rows]


# --- deterministic draws (checkpointable cursors) ----------------------------------------------------

@dataclass
class PromptCursor:
    """Epoch-shuffled prompt order: a permutation of `ids` per epoch, seeded by (seed, epoch).

    state: (epoch, pos). `take(n)` is deterministic given the seed and the state, so checkpointing the
    state (state_dict) resumes the exact prompt sequence.
    """

    ids: list[str]
    seed: int
    epoch: int = 0
    pos: int = 0

    def _order(self, epoch: int) -> list[str]:
        order = list(self.ids)
        random.Random(step_seed(self.seed, epoch, "prompts")).shuffle(order)
        return order

    def take(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            if self.pos >= len(self.ids):
                self.epoch, self.pos = self.epoch + 1, 0
            out.append(self._order(self.epoch)[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"ids": list(self.ids), "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        if state["ids"] != self.ids or state["seed"] != self.seed:
            raise ValueError("PromptCursor: checkpointed prompt set or seed differs from this run's; "
                             "resume with the same config")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


@dataclass
class PoolCursor:
    """Draws G_t teacher rows for a prompt: a function of (seed, step, problem id, slot) only.

    Without replacement while the problem has >= n rows, with replacement otherwise. `draws` counts
    rows handed out (state for checkpoints and a sanity check on resume).
    """

    pool: TeacherPool
    seed: int
    draws: int = 0

    def draw(self, problem_id: str, n: int, step: int, slot: int) -> list[dict]:
        idx = self.pool.by_problem.get(problem_id, [])
        if n and not idx:
            raise KeyError(f"teacher pool {self.pool.path} has no rows for problem {problem_id!r}")
        rng = random.Random(step_seed(self.seed, step, "pool", problem_id, slot))
        pick = rng.sample(idx, n) if len(idx) >= n else [rng.choice(idx) for _ in range(n)]
        self.draws += n
        return [self.pool.rows[i] for i in pick]

    def rows_hash(self) -> str:
        """sha256 (16 hex) of the pool's rows: a rebuilt pool of the same size is another pool."""
        return hashlib.sha256(json.dumps(self.pool.rows, sort_keys=True).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws, "n_rows": len(self.pool.rows),
                "rows_hash": self.rows_hash()}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["n_rows"] != len(self.pool.rows):
            raise ValueError(f"PoolCursor: checkpoint drew from a pool of {state['n_rows']} rows with seed "
                             f"{state['seed']}; this run has {len(self.pool.rows)} rows, seed {self.seed}")
        # (checkpoints written before rows_hash existed carry none: the size check above is all they get)
        if (saved := state.get("rows_hash")) is not None and saved != (here := self.rows_hash()):
            raise ValueError(f"PoolCursor: checkpoint drew from another pool than {self.pool.path} (same "
                             f"size, other rows: hash {saved} != {here}); resume with the pool file the run "
                             "started with")
        self.draws = int(state["draws"])


# --- teacher handling in the loss (SPEC §3) ----------------------------------------------------------
# Each mode: (logp (N, T) detached current policy, logp_behaviour (N, T), is_student (N,) bool,
# mask (N, T), is_trunc) -> (logp_old (N, T), weight (N, T), stats). The token loss is
# weight * (clip_surrogate(logp, logp_old, adv) + beta * kl); weight never changes the aggregation's
# denominators, so teacher rows count in the group baseline and the token counts in every mode.

TeacherFn = Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, dict]]


def _teacher_stats(mode: str, ratio: Tensor, weight: Tensor, is_student: Tensor, mask: Tensor,
                   trunc: Tensor) -> dict:
    m = mask * (~is_student)[:, None]
    n = m.sum().clamp(min=1.0)
    return {"teacher/mode": mode, "teacher/ratio_mean": (ratio * m).sum() / n,
            "teacher/is_weight_mean": (weight * m).sum() / n,
            "teacher/clip_frac": (trunc.float() * m).sum() / n}


def teacher_imitation(logp, logp_behaviour, is_student, mask, is_trunc):
    """The seed's handling: logp_old is the current policy for every row, so the teacher ratio is forced
    to 1 and the teacher half is advantage-weighted imitation of fixed completions (SPEC §3)."""
    one = torch.ones_like(logp)
    return logp.detach(), one, _teacher_stats("imitation", one, one, is_student, mask, torch.zeros_like(mask))


def teacher_importance(logp, logp_behaviour, is_student, mask, is_trunc):
    """Off-policy correction from the stored behaviour log-probs (SPEC §3): per teacher token the ratio
    rho = pi_theta / mu = exp(logp - logp_behaviour), truncated at is_trunc (truncated IS, Espeholt et al.
    2018 arXiv:1802.01561), multiplies the clip surrogate as a detached weight; the surrogate's own ratio
    is to the current policy (decoupled PPO, Hilton et al. 2021 arXiv:2110.00641). Students: weight 1."""
    rho = torch.exp(logp.detach() - logp_behaviour) * mask  # (N, T); 0 on padding
    w = torch.where(is_student[:, None], torch.ones_like(rho), rho.clamp(max=is_trunc))
    trunc = (~is_student)[:, None] & (rho > is_trunc)
    return logp.detach(), w, _teacher_stats("importance", rho, w, is_student, mask, trunc)


def teacher_exclude(logp, logp_behaviour, is_student, mask, is_trunc):
    """Teacher rewards join the group baseline (advantages use the whole mixed group) but teacher
    tokens carry no loss: weight 0 on teacher rows (SPEC §3)."""
    w = is_student[:, None].to(logp.dtype).expand_as(logp)
    one = torch.ones_like(logp)
    return logp.detach(), w, _teacher_stats("exclude", one, w, is_student, mask, torch.zeros_like(mask))


TEACHER_MODES: dict[str, TeacherFn] = {
    "imitation": teacher_imitation, "importance": teacher_importance, "exclude": teacher_exclude,
}
