"""The teacher pool: cached, pre-graded, frozen completions mixed into every GRPO group.

A pool is a JSONL file, one row per completion with exactly the keys `POOL_KEYS`; its `grade` is the
environment's `Graded` record (envs/base.py). Rows come from the environment's templates (hack / clean /
buggy completions per problem) or from sampling a teacher model (sample.sample_and_grade), graded ONCE
and frozen: training reads the stored grade and never re-grades. Token ids are stored beside the text
and training packs the stored ids: text is never re-tokenised. The file holds them as JSON lists, a row's
Sample as torch.long tensors: converted here, at the file's edge. Loading validates every row (file, line,
field) and guards tokenisation drift: the live chat-template encoding of each problem's prompt must equal
the stored prompt_ids. Also here: deterministic, checkpointable prompt and teacher-row draws.
Not here: grading (envs/), sampling (sampling/), how teacher tokens enter the loss (objective/teacher.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo.envs.base import KINDS, Graded
from projected_grpo.errors import UserError
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.pack import as_ids, encode_completion
from projected_grpo.sampling.sample import Sample
from projected_grpo.store import read_jsonl, tokenizer_fingerprint, write_jsonl_atomic

# Row schema: key -> accepted JSON types (None allowed only for logp_behaviour).
POOL_SCHEMA: dict[str, tuple[type, ...]] = {
    "problem_id": (str,), "mode": (str,), "prompt": (str,), "prompt_ids": (list,), "completion": (str,),
    "completion_ids": (list,), "grade": (dict,), "logp_behaviour": (list, type(None)),
    "tokenizer_fingerprint": (str,), "source": (str,),
}
POOL_KEYS: tuple[str, ...] = tuple(POOL_SCHEMA)
# Row order within a problem (PoolCursor draws by row index, so this order is part of every run's draws).
TEMPLATE_ORDER = ("hack", "clean", "buggy")


def pool_row(sample: Sample, prompt_text: str, fingerprint: str, source: str) -> dict:
    """A graded Sample as a pool row (student/truncated are not stored: a drawn row is a teacher row)."""
    return {"problem_id": sample.problem_id, "mode": sample.mode, "prompt": prompt_text,
            "prompt_ids": sample.prompt_ids.tolist(), "completion": sample.text,
            "completion_ids": sample.completion_ids.tolist(), "grade": sample.grade.to_dict(),
            "logp_behaviour": None if sample.logp_behaviour is None else sample.logp_behaviour.tolist(),
            "tokenizer_fingerprint": fingerprint, "source": source}


# --- build -------------------------------------------------------------------------------------------

def template_rows(env, problems: Sequence, tokenizer, prompts: Mapping[str, tuple[str, Tensor]],
                  counts: Mapping[str, int]) -> list[dict]:
    """Rows from the environment's templates: the first counts[kind] of each problem's completions of that
    kind (fewer when a problem has fewer; `build_report` shows the counts). No behaviour log-probs.
    prompts: problem id -> (chat-formatted text, (T_p,) long ids): setup.prompt_table."""
    unknown = set(counts) - set(KINDS)
    if unknown:
        raise ValueError(f"template_rows: kinds {sorted(unknown)} are not among {KINDS}")
    fp = tokenizer_fingerprint(tokenizer)
    jobs = [(p, text, f"template:{kind}") for p in problems for kind in TEMPLATE_ORDER
            for text in env.templates(p, kind)[:counts.get(kind, 0)]]
    grades = env.grade([j[1] for j in jobs], [j[0] for j in jobs])
    rows = []
    for (p, text, src), g in zip(jobs, grades):
        s = Sample(p.id, p.mode, as_ids(prompts[p.id][1]), as_ids(encode_completion(tokenizer, text)), text,
                   None, False, False, g)
        rows.append(pool_row(s, prompts[p.id][0], fp, src))
    return rows


def sampled_rows(samples: Sequence[Sample], tokenizer, prompts: Mapping[str, tuple[str, Tensor]],
                 name: str) -> list[dict]:
    """Rows from samples of a teacher model (sample.sample_and_grade), with their behaviour log-probs."""
    fp = tokenizer_fingerprint(tokenizer)
    return [pool_row(s, prompts[s.problem_id][0], fp, f"teacher:{name}") for s in samples]


def write_pool(path: str | pathlib.Path, rows: Sequence[dict]) -> None:
    """Atomically write rows as JSONL (each row validated first)."""
    for i, row in enumerate(rows):
        _validate(row, f"{path} (row {i})")
    write_jsonl_atomic(path, list(rows))


def build_report(rows: Sequence[dict]) -> str:
    """Counts of rows, hacks (exploited) and solves per mode and source, one line each."""
    by: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        c = by.setdefault((r["mode"], r["source"]), [0, 0, 0])
        c[0] += 1
        c[1] += r["grade"]["exploited"]
        c[2] += r["grade"]["solved"]
    return "\n".join(f"{m:<14} {s:<18} rows={n:<4} exploited={h:<4} solved={g}"
                     for (m, s), (n, h, g) in sorted(by.items()))


# --- load + validate ---------------------------------------------------------------------------------

def _validate(row: object, where: str) -> Graded:
    if not isinstance(row, dict):
        raise UserError(f"{where}: a pool row must be a JSON object, got {type(row).__name__}")
    keys = set(row)
    if keys != set(POOL_KEYS):
        raise UserError(f"{where}: fields differ from the schema: missing {sorted(set(POOL_KEYS) - keys)}; "
                        f"unexpected {sorted(keys - set(POOL_KEYS))} (pools written before the grade field "
                        "existed must be rebuilt: projected-grpo build-pool)")
    for k, types in POOL_SCHEMA.items():
        v = row[k]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            want = "/".join(t.__name__ for t in types)
            raise UserError(f"{where}: field {k!r} must be {want}, got {v!r:.80}")
    for k in ("prompt_ids", "completion_ids"):
        if not row[k] or not all(isinstance(t, int) and not isinstance(t, bool) for t in row[k]):
            raise UserError(f"{where}: field {k!r} must be a non-empty list of token ids")
    lp = row["logp_behaviour"]
    if lp is not None and (len(lp) != len(row["completion_ids"]) or
                           not all(isinstance(x, (int, float)) and x <= 0 for x in lp)):
        raise UserError(f"{where}: field 'logp_behaviour' must hold one log-prob <= 0 per completion token "
                        f"({len(row['completion_ids'])}), got {len(lp)} values")
    return Graded.from_dict(row["grade"], f"{where}: field 'grade'")


@dataclass
class TeacherPool:
    """Validated pool rows (dicts with exactly POOL_KEYS) and the same rows as teacher Samples."""

    rows: list[dict]
    samples: list[Sample]
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


EMPTY_POOL = TeacherPool([], [], "(no pool)")


def load_pool(path: str | pathlib.Path, tokenizer, problems: Sequence,
              prompt_ids: Mapping[str, Tensor]) -> TeacherPool:
    """Read and validate a pool file against `problems` and the live tokenizer's prompt ids (problem id ->
    (T_p,) long, setup.prompt_table). `rows` keep the file's JSON lists; `samples` hold torch.long tensors.

    Rows of problems outside `problems` are skipped (e.g. other modes). Fails naming file, line and field
    on a schema error; on tokenisation drift (live prompt ids != stored prompt_ids, or another tokenizer
    fingerprint) fails showing both.
    """
    known = {p.id: p for p in problems}
    fp = tokenizer_fingerprint(tokenizer)
    rows, samples = [], []
    for where, row in read_jsonl(path):
        grade = _validate(row, where)
        pid = row["problem_id"]
        if pid not in known:
            continue
        if row["mode"] != known[pid].mode:
            raise UserError(f"{where}: field 'mode' is {row['mode']!r} but problem {pid!r} has mode "
                            f"{known[pid].mode!r}")
        live = as_ids(prompt_ids[pid]).tolist()  # compared as int lists: exactly, and shown as the file shows
        if row["prompt_ids"] != live:
            raise UserError(
                f"{where}: tokenization drift for problem {pid!r}: the live tokenizer encodes its prompt as "
                f"{live} but the pool stored {row['prompt_ids']}; rebuild the pool with this "
                "tokenizer (projected-grpo build-pool)")
        if row["tokenizer_fingerprint"] != fp:
            raise UserError(f"{where}: tokenization drift: the row was built with tokenizer fingerprint "
                            f"{row['tokenizer_fingerprint']}, the live one's is {fp}; rebuild the pool")
        rows.append(row)
        # JSON's doubles hold the sampler's float32 values exactly: this tensor is the one sampled
        lp = row["logp_behaviour"]
        lp = None if lp is None else torch.tensor(lp, dtype=torch.float32)
        ids = [as_ids(row[k]) for k in ("prompt_ids", "completion_ids")]
        samples.append(Sample(pid, row["mode"], *ids, row["completion"], lp, False, False, grade))
    return TeacherPool(rows=rows, samples=samples, path=str(path))


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
            raise UserError("PromptCursor: checkpointed prompt set or seed differs from this run's; "
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

    def draw(self, problem_id: str, n: int, step: int, slot: int) -> list[Sample]:
        idx = self.pool.by_problem.get(problem_id, [])
        if n and not idx:
            raise KeyError(f"teacher pool {self.pool.path} has no rows for problem {problem_id!r}")
        rng = random.Random(step_seed(self.seed, step, "pool", problem_id, slot))
        pick = rng.sample(idx, n) if len(idx) >= n else [rng.choice(idx) for _ in range(n)]
        self.draws += n
        return [self.pool.samples[i] for i in pick]

    def rows_hash(self) -> str:
        """sha256 (16 hex) of the pool's rows: a rebuilt pool of the same size is another pool."""
        return hashlib.sha256(json.dumps(self.pool.rows, sort_keys=True).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws, "n_rows": len(self.pool.rows),
                "rows_hash": self.rows_hash()}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["n_rows"] != len(self.pool.rows):
            raise UserError(f"PoolCursor: checkpoint drew from a pool of {state['n_rows']} rows with seed "
                             f"{state['seed']}; this run has {len(self.pool.rows)} rows, seed {self.seed}")
        # (checkpoints written before rows_hash existed carry none: the size check above is all they get)
        if (saved := state.get("rows_hash")) is not None and saved != (here := self.rows_hash()):
            raise UserError(f"PoolCursor: checkpoint drew from another pool than {self.pool.path} (same "
                             f"size, other rows: hash {saved} != {here}); resume with the pool file the run "
                             "started with")
        self.draws = int(state["draws"])
