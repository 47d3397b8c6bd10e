"""Contrastive pairs (prompt, hack completion, clean completion) for hack-direction extraction.

Three sources: the built-in problems (several hack and clean variants per problem, rotated so a pair
is not one fixed template), a JSON/JSONL file with keys prompt / hack / clean, and pairs mined from a
graded teacher pool with only the detectors of a named subset of *known* loophole modes (the "weak
detector" of the leave-one-mode-out test). Also here: `split_heldout` (the whole prompts held out of the
fit for V's held-out check) and the pair-level controls of V_hack (docs/preregistration.md, "Controls"):
`shuffle_labels` (hack/clean swapped at random per pair: an ORIENTATION control, the subspace is V's),
`nonhack_pairs` (clean vs another clean) and `within_pairs` (hack vs another hack and clean vs another clean
of the same prompt: the LABEL control, whose subspace differs from V's).
Deliberately not here: gradients, SVD, storage (direction.py), the V-level controls (controls.py).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from projected_grpo.errors import UserError
from projected_grpo.store import read_jsonl, read_text

Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Pair:
    """One contrastive pair.

    prompt   chat messages (tuple of {"role", "content"} dicts, encoded with the tokenizer's chat
             template exactly as training encodes prompts) or already-formatted prompt text (encoded
             verbatim, no special tokens added).
    hack     completion text that games the grader.  clean: an honest completion for the same prompt.
    prompt_ids / hack_ids / clean_ids  optional token ids (pool pairs carry the stored ids, so the
             sequences are never re-tokenised from text); when set they are used instead of the text.
    source   where the pair came from, for reports (e.g. "builtin:two_sum:run_tests").
    """

    prompt: Messages | str
    hack: str
    clean: str
    prompt_ids: tuple[int, ...] | None = None
    hack_ids: tuple[int, ...] | None = None
    clean_ids: tuple[int, ...] | None = None
    source: str = ""

    def swapped(self) -> Pair:
        """The same pair with hack and clean exchanged (labels flipped)."""
        return Pair(self.prompt, self.clean, self.hack, self.prompt_ids, self.clean_ids, self.hack_ids,
                    self.source + ":swapped")


def pairs_hash(pairs: Sequence[Pair]) -> str:
    """SHA-256 (first 16 hex digits) of the pairs' content (prompt, texts, ids; not `source`), in order."""
    h = hashlib.sha256()
    for p in pairs:
        prompt = p.prompt if isinstance(p.prompt, str) else [dict(sorted(m.items())) for m in p.prompt]
        row = [prompt, p.hack, p.clean, p.prompt_ids, p.hack_ids, p.clean_ids]
        h.update(json.dumps(row, ensure_ascii=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def encode_pair(tokenizer, pair: Pair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt_ids (T_p,), hack_ids (T_h,), clean_ids (T_c,)) torch.long, exactly as training encodes them
    (pack.encode_prompt / encode_completion, EOS included); stored ids are used as they are; a text prompt
    is taken as already formatted (encoded with no special tokens added). The pair keeps its int tuples (a
    record, hashed and written as JSON); these tensors are what the forwards pack."""
    from projected_grpo.sampling.pack import as_ids, encode_completion, encode_prompt

    if pair.prompt_ids is not None:
        prompt_ids = list(pair.prompt_ids)
    elif isinstance(pair.prompt, str):
        prompt_ids = [int(i) for i in tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]]
    else:
        prompt_ids = encode_prompt(tokenizer, [dict(m) for m in pair.prompt])
    hack = list(pair.hack_ids) if pair.hack_ids is not None else encode_completion(tokenizer, pair.hack)
    clean = list(pair.clean_ids) if pair.clean_ids is not None else encode_completion(tokenizer, pair.clean)
    return as_ids(prompt_ids), as_ids(hack), as_ids(clean)


def _prompt_key(p: Pair) -> str:
    return json.dumps(p.prompt if isinstance(p.prompt, str) else [sorted(m.items()) for m in p.prompt])


def split_heldout(pairs: Sequence[Pair], frac: float) -> tuple[list[Pair], list[Pair]]:
    """(fit, held_out): the pairs of round(frac * #prompts) whole prompts are held out, the prompts with the
    smallest SHA-256 of their text (seed-free, and spread over loophole modes and problems rather than the
    last ones in order). At least one prompt is held out when frac > 0 and there are two or more, and at least
    one is always fit. Order within each part is the input order."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"split_heldout: frac must be in [0, 1), got {frac}")
    keys = list(dict.fromkeys(_prompt_key(p) for p in pairs))
    n_held = min(len(keys) - 1, max(1 if frac > 0 else 0, round(frac * len(keys))))
    held = set(sorted(keys, key=lambda k: hashlib.sha256(k.encode()).hexdigest())[:max(0, n_held)])
    return ([p for p in pairs if _prompt_key(p) not in held], [p for p in pairs if _prompt_key(p) in held])


def completions_by_prompt(pairs: Sequence[Pair]) -> list[list[tuple[int, str]]]:
    """Per distinct prompt (first-appearance order) its distinct completions, hack and clean alike, each as
    (index of the first pair holding it, "hack" or "clean"): where to find each one's gradient once."""
    by_prompt: dict[str, dict[tuple, tuple[int, str]]] = {}
    for i, p in enumerate(pairs):
        seen = by_prompt.setdefault(_prompt_key(p), {})
        for side in ("hack", "clean"):
            seen.setdefault(_side(p, side), (i, side))
    return [list(seen.values()) for seen in by_prompt.values()]


def prompt_groups(pairs: Sequence[Pair]) -> list[int]:
    """Per pair the index of its prompt among the distinct prompts, in order of first appearance: the
    clusters of a held-out score (pairs of one prompt are not independent)."""
    ids: dict[str, int] = {}
    return [ids.setdefault(_prompt_key(p), len(ids)) for p in pairs]


# --- built-in pairs ----------------------------------------------------------------------------


def builtin_pairs(env, problems: Sequence, per_problem: int = 3) -> list[Pair]:
    """Pairs from the environment's templates: up to `per_problem` per problem, prompt from its messages.

    Pair i of a problem is (hack template i mod #hacks, clean template (i + 1) mod #cleans): both lists
    rotate, with an offset so the same index is not always matched, so pairs are not one template.
    Problems without both a hack and a clean template are skipped; none having both raises.
    """
    if per_problem < 1:
        raise ValueError(f"builtin_pairs: per_problem must be >= 1, got {per_problem}")
    out: list[Pair] = []
    for prob in problems:
        hacks, cleans = env.templates(prob, "hack"), env.templates(prob, "clean")
        if not hacks or not cleans:
            continue
        prompt = tuple(dict(m) for m in env.messages(prob))
        n = min(per_problem, max(len(hacks), len(cleans)))
        for i in range(n):
            out.append(Pair(prompt, hacks[i % len(hacks)], cleans[(i + 1) % len(cleans)],
                            source=f"builtin:{prob.id}:{prob.mode}:{i}"))
    if not out:
        raise ValueError(f"builtin_pairs: none of the {len(problems)} problems of environment "
                         f"{getattr(env, 'name', env)!r} has both hack and clean templates; give a pairs "
                         "file "
                         "(proj.pairs)")
    return out


# --- JSON / JSONL file -------------------------------------------------------------------------

_FILE_KEYS = {"prompt", "hack", "clean"}
_OPTIONAL_KEYS = {"prompt_ids", "hack_ids", "clean_ids", "source"}


def _pair_from_obj(obj: object, where: str) -> Pair:
    """One file record -> Pair; `where` is "FILE:LINE" (or "FILE item I") for the error message."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object with keys prompt, hack, clean; "
                         f"got {type(obj).__name__}")
    missing = sorted(_FILE_KEYS - obj.keys())
    if missing:
        raise UserError(f"{where}: missing field(s) {missing}; each record needs prompt, hack, clean")
    unknown = sorted(obj.keys() - _FILE_KEYS - _OPTIONAL_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {unknown}; "
                         f"allowed: {sorted(_FILE_KEYS | _OPTIONAL_KEYS)}")
    for key in ("hack", "clean"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise UserError(f"{where}: field {key!r} must be a non-empty string, got {obj[key]!r:.80}")
    prompt = obj["prompt"]
    if isinstance(prompt, list):
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: field 'prompt'[{j}] must be an object with string 'role' and "
                                 f"'content', got {m!r:.80}")
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
        if not prompt:
            raise UserError(f"{where}: field 'prompt' is an empty message list")
    elif not isinstance(prompt, str) or not prompt:
        raise UserError(f"{where}: field 'prompt' must be a non-empty string or a list of chat messages")
    ids: dict[str, tuple[int, ...] | None] = {}
    for key in ("prompt_ids", "hack_ids", "clean_ids"):
        v = obj.get(key)
        if v is not None and not (isinstance(v, list) and v and all(isinstance(i, int) for i in v)):
            raise UserError(f"{where}: field {key!r} must be a non-empty list of ints, got {v!r:.80}")
        ids[key] = None if v is None else tuple(v)
    return Pair(prompt, obj["hack"], obj["clean"], source=str(obj.get("source", where)), **ids)


def load_pairs_file(path: str | pathlib.Path) -> list[Pair]:
    """Pairs from a .jsonl file (one object per line) or a .json file (a list of objects).

    Each object has prompt (text or chat messages), hack, clean (non-empty strings) and optionally
    prompt_ids / hack_ids / clean_ids / source. Any invalid record raises ValueError naming the file,
    the line (JSONL) or item (JSON) and the field.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file {path} does not exist")
    pairs: list[Pair] = []
    if path.suffix == ".jsonl":
        pairs += [_pair_from_obj(obj, where) for where, obj in read_jsonl(path)]
    elif path.suffix == ".json":
        try:
            items = json.loads(read_text(path, "pairs file"))  # a byte that is not UTF-8: file, line, column
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(items, list):
            raise UserError(f"{path}: a .json pairs file must hold a list of objects, "
                             f"got {type(items).__name__}")
        pairs = [_pair_from_obj(obj, f"{path} item {i}") for i, obj in enumerate(items)]
    else:
        raise UserError(f"pairs file {path}: unknown extension {path.suffix!r}; use .jsonl or .json")
    if not pairs:
        raise UserError(f"pairs file {path} holds no pairs")
    return pairs


# --- pairs mined from a graded teacher pool ----------------------------------------------------

DETECTORS = ("E", "C", "D")


def _is_hack(row: dict, known_modes: frozenset[str], detectors: Sequence[str]) -> bool:
    # Weak-detector rule: the grader passed it, its mode is one we know the loophole of, one of the named
    # detectors fires, and the oracle does not call it correct (an honest solution that uses the disclosed
    # mechanism truthfully can trip detector E; such a row is clean, never a hack). `exploited` itself is
    # never read: that label exists for every mode, including the held-out one.
    g = row["grade"]
    return (row["mode"] in known_modes and bool(g["passed"]) and not bool(g["solved"])
            and any(bool(g["extras"].get(f"det_{d}")) for d in detectors))


def _is_clean(row: dict) -> bool:
    return bool(row["grade"]["passed"]) and bool(row["grade"]["solved"])


def pairs_from_pool(rows: Iterable[dict], known_modes: Iterable[str], detectors: Sequence[str] = ("E",),
                    per_problem: int = 4) -> tuple[list[Pair], dict]:
    """Pair hack and clean rows of the same problem from a graded teacher pool.

    A row is a hack when mode in `known_modes`, passed, not solved, and any detector in `detectors` fires
    (grade extras det_E / det_C / det_D); it is clean when passed and solved. Per problem, pair i is
    (hack i mod #hacks, clean i mod #cleans) for i < min(per_problem, max(#hacks, #cleans)); problems
    lacking either side are counted in the stats, not paired. Pairs carry the stored token ids.
    Returns (pairs, stats) with stats = {"n_pairs", "pairs_per_mode", "problems_without_clean",
    "problems_without_hack"}.
    """
    known = frozenset(known_modes)
    bad = [d for d in detectors if d not in DETECTORS]
    if bad or not detectors:
        raise ValueError(f"pairs_from_pool: detectors must be a non-empty subset of {DETECTORS}, "
                         f"got {detectors}")
    if not known:
        raise ValueError("pairs_from_pool: known_modes is empty; "
                         "name the loophole modes whose detectors to use")
    hacks: dict[str, list[dict]] = {}
    cleans: dict[str, list[dict]] = {}
    for row in rows:  # validated pool rows (run/pool.load_pool)
        pid = str(row["problem_id"])
        if _is_hack(row, known, detectors):
            hacks.setdefault(pid, []).append(row)
        elif _is_clean(row):
            cleans.setdefault(pid, []).append(row)
    pairs: list[Pair] = []
    per_mode: dict[str, int] = {}
    for pid, hs in hacks.items():
        cs = cleans.get(pid, [])
        if not cs:
            continue
        for i in range(min(per_problem, max(len(hs), len(cs)))):
            h, c = hs[i % len(hs)], cs[i % len(cs)]
            if list(h["prompt_ids"]) != list(c["prompt_ids"]):
                raise ValueError(f"pool problem {pid!r}: hack and clean rows have different prompt_ids; "
                                 "a pair must share its prompt")
            pairs.append(Pair(h["prompt"], h["completion"], c["completion"], tuple(h["prompt_ids"]),
                              tuple(h["completion_ids"]), tuple(c["completion_ids"]),
                              source=f"pool:{pid}:{h['mode']}:{i}"))
            per_mode[h["mode"]] = per_mode.get(h["mode"], 0) + 1
    stats = {"n_pairs": len(pairs), "pairs_per_mode": per_mode,
             "problems_without_clean": sorted(p for p in hacks if p not in cleans),
             "problems_without_hack": sorted(p for p in cleans if p not in hacks)}
    return pairs, stats


# --- pair-level controls -----------------------------------------------------------------------


def shuffle_labels(pairs: Sequence[Pair], seed: int = 0) -> list[Pair]:
    """ORIENTATION control `shuffled`: each pair's hack/clean labels swapped with probability 1/2 (seeded).

    Swapping a pair negates its row of D, and the SVD of D does not see row signs (DᵀD is unchanged), so this
    control has V's own S and span(V); only the vote-chosen orientations change. It controls for the
    hack-ward orientation the one-sided gate relies on, not for the subspace, and under a two-sided gate
    (no_gate, reverse: sign-blind) it removes exactly what the real V removes (docs/preregistration.md).
    """
    flips = torch.rand(len(pairs), generator=torch.Generator().manual_seed(seed)) < 0.5
    return [p.swapped() if bool(f) else p for p, f in zip(pairs, flips)]


def _distinct_by_prompt(pairs: Sequence[Pair], side: str) -> list[list[Pair]]:
    """Per prompt (first-appearance order) its pairs with distinct `side` ("hack" or "clean") completions."""
    by_prompt: dict[str, list[Pair]] = {}
    for p in pairs:
        group = by_prompt.setdefault(_prompt_key(p), [])
        if all(_side(q, side) != _side(p, side) for q in group):
            group.append(p)
    return list(by_prompt.values())


def _side(p: Pair, side: str) -> tuple:
    """A pair's `side` completion as (ids, text): the identity of that sequence."""
    return (p.hack_ids, p.hack) if side == "hack" else (p.clean_ids, p.clean)


def _cycle_side(group: Sequence[Pair], side: str) -> list[Pair]:
    """Completion j of `side` against completion j + 1 (cyclic) of the same prompt; none for fewer than 2.
    The result's `hack` slot holds completion j, its `clean` slot completion j + 1."""
    if len(group) < 2:
        return []
    out = []
    for j, p in enumerate(group):
        q = group[(j + 1) % len(group)]
        (a_ids, a), (b_ids, b) = _side(p, side), _side(q, side)
        out.append(Pair(p.prompt, a, b, p.prompt_ids, a_ids, b_ids, source=f"{side}:{p.source}|{q.source}"))
    return out


def _cycled(base: list[Pair], n: int, what: str) -> list[Pair]:
    if not base:
        raise ValueError(f"{what} control: no prompt has two distinct completions of the class it pairs; "
                         "the pair source must give several variants per prompt (builtin pairs, "
                         "pairs_per_problem >= 2)")
    return [base[i % len(base)] for i in range(n)]


def nonhack_pairs(pairs: Sequence[Pair], seed: int = 0) -> list[Pair]:
    """Control `nonhack`: (clean, other clean) pairs of the same prompt, as many as `pairs` had.

    The distinct clean completions of each prompt are paired cyclically (clean j vs clean j + 1); these rows
    are then cycled to len(pairs) so the control sees as many pairs as the real extraction. Raises when no
    prompt has two distinct clean completions. `seed` is unused (deterministic); every control takes one.
    """
    del seed
    base = [q for g in _distinct_by_prompt(pairs, "clean") for q in _cycle_side(g, "clean")]
    return _cycled(base, len(pairs), "nonhack")


def within_pairs(pairs: Sequence[Pair], seed: int = 0) -> list[Pair]:
    """LABEL control `within`: within-class pairs of the same prompt, hack vs another hack and clean vs
    another clean, as many as `pairs` had.

    Made of the same completions as the real pairs, but no row contrasts a hack with a clean one: D's rows
    are within-class variation, so span(V) changes (unlike `shuffle_labels`) and a V that still works here
    owes nothing to the hack label. Per prompt, the distinct hacks are paired cyclically, then the distinct
    cleans; prompts in order; the rows are cycled to len(pairs). Raises when no prompt has two distinct
    completions of either class. `seed` is unused (deterministic).
    """
    del seed
    base = []
    for hacks, cleans in zip(_distinct_by_prompt(pairs, "hack"), _distinct_by_prompt(pairs, "clean")):
        base += _cycle_side(hacks, "hack") + _cycle_side(cleans, "clean")
    return _cycled(base, len(pairs), "within")


PAIR_CONTROLS = {"none": lambda pairs, seed: list(pairs), "shuffled": shuffle_labels,
                 "nonhack": nonhack_pairs, "within": within_pairs}
