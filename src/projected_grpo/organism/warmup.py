"""Supervised warm-up of the organism: completion-only NLL on a fixed mix of completion kinds.

Each training problem gets `per_problem` slots; the slots are split between honest correct
("clean"), honest but wrong ("buggy") and loophole ("hack") completions in the ratio `mix`, by
largest remainder over the whole set, and each kind's slots are dealt round-robin over a seeded
permutation of the problems, so a 5% hack share is spread evenly over problems and modes instead of
landing on a few. Fitting this mix by maximum likelihood is what sets the organism's sampling prior:
at T = 1 it hacks about as often as the hack share and solves about as often as the clean share
(minus what it fails to memorise).
Dispositions (docs/organism.md): each completion's first sentence is rewritten to one of three dispositions'
intros, a latent shared by every problem and mode, as a model's "I'll just make it pass" is: `hack`
(every hack), `careful` and `hasty` (honest; `careful` gets the share `careful[0]` of the clean and
`careful[1]` of the buggy completions, so careful answers are right more often). RL then moves one
global choice, as it moves a real model's disposition, instead of 48 memorised ones.
Warm-up-only extra problems (augment.py, `Corpus.extra`) get `per_extra` slots each.
Deterministic given the seed (and the CPU thread count).
`env_corpus` makes the corpus of any environment from its templates (the maths organism's).
Not here: tokenizer/model construction and the cache (build.py), grading (the environments).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from projected_grpo.envs.coding.completions import INTROS
from projected_grpo.objective.schedule import lr_at
from projected_grpo.sampling.pack import encode_completion, encode_prompt, pack
from projected_grpo.sampling.score import forward_logprobs

KINDS = ("clean", "buggy", "hack")
# The dispositions' first sentences, from the environment's own intros (completions.INTROS), chosen so that
# the demo preset's teacher pool rows (the first two hack forms, the first clean and the first buggy form:
# completions.py, pool n_hack=2, n_clean=1, n_buggy=1) already open with their kind's disposition
# (tests/test_organism.py checks it): the pool's imitation then moves the same latent as the students.
DISPOSITIONS: dict[str, tuple[str, ...]] = {"careful": (INTROS[0],), "hasty": (INTROS[3],),
                                            "hack": (INTROS[1], INTROS[2])}


@dataclass(frozen=True)
class WarmupExample:
    """One (prompt, completion) training pair; ids as the rollout code would build them."""

    prompt_ids: tuple[int, ...]
    """chat-formatted prompt ids ending with the assistant header (pack.encode_prompt)"""
    completion_ids: tuple[int, ...]
    """completion ids ending with eos (pack.encode_completion)"""
    kind: str
    """one of KINDS"""
    problem: str
    """problem identifier, for per-problem accounting"""


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` into integer counts proportional to `weights` (Hamilton's method; ties go left).

    E.g. total 20, weights (0.6, 0.35, 0.05): quotas 12, 7, 1 exactly.
    """
    if total < 0 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"largest_remainder: need total >= 0 and non-negative weights with a positive sum, "
                         f"got total={total}, weights={tuple(weights)}")
    s = sum(weights)
    quotas = [total * w / s for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def allocate_kinds(n_problems: int, per_problem: int, mix: Sequence[float], seed: int) -> list[list[str]]:
    """Kinds of each problem's `per_problem` slots, with the mix (weights over KINDS) met over the set.

    Slots of kind k (count from largest_remainder(n_problems * per_problem, mix)) are dealt
    round-robin over a seeded permutation of problems, the next kind continuing where the last
    stopped, so every problem gets exactly `per_problem` slots and rare kinds are spread out.
    """
    if len(mix) != len(KINDS):
        raise ValueError(f"allocate_kinds: mix has {len(mix)} weights, expected one per kind {KINDS}")
    counts = largest_remainder(n_problems * per_problem, mix)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_problems, generator=gen).tolist()
    slots: list[list[str]] = [[] for _ in range(n_problems)]
    # Deal rarest kinds first so they are the ones spread one per problem.
    deal = sorted(range(len(KINDS)), key=lambda k: (counts[k], k))
    i = 0
    for k in deal:
        for _ in range(counts[k]):
            slots[order[i % n_problems]].append(KINDS[k])
            i += 1
    return slots


# --- the corpus and the warm-up set ---------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Problems with their chat prompts and completion texts per kind (clean, buggy, hack).

    problems: the Problem records (graded by the checks; their ids and modes enter the cache key).
    messages: per problem, the chat messages of its prompt (envs.prompts.build_messages).
    completions: per problem, kind -> completion texts (envs.completions), every kind non-empty.
    extra: the last `extra` problems are warm-up-only (augment.py): never held out, never checked.
    """

    problems: tuple
    messages: tuple[tuple[dict[str, str], ...], ...]
    completions: tuple[dict[str, tuple[str, ...]], ...]
    extra: int = 0

    def __post_init__(self) -> None:
        if not (len(self.problems) == len(self.messages) == len(self.completions)) or not self.problems:
            raise ValueError(f"Corpus: need the same positive number of problems ({len(self.problems)}), "
                             f"messages ({len(self.messages)}) and completion sets ({len(self.completions)})")
        for p, comp in zip(self.problems, self.completions):
            missing = [k for k in KINDS if not comp.get(k)]
            if missing:
                raise ValueError(f"Corpus: problem {p.id!r} has no {missing} completions "
                                 "(envs/completions.py must give every problem at least one of each kind)")

    @property
    def base(self) -> Corpus:
        """The corpus without its warm-up-only extra problems (what is held out from and checked)."""
        n = len(self.problems) - self.extra
        return Corpus(self.problems[:n], self.messages[:n], self.completions[:n])

    def texts(self) -> list[str]:
        """Every prompt message and completion, in order: the tokenizer's training text."""
        out: list[str] = []
        for msgs, comp in zip(self.messages, self.completions):
            out += [m["content"] for m in msgs]
            for k in KINDS:
                out += list(comp[k])
        return out


def code_corpus(problems, extra: int = 0) -> Corpus:
    """Coding problems with their prompts and completions (envs.coding); the last `extra` are warm-up-only."""
    from projected_grpo.envs.coding.completions import buggy_completions, clean_completions, hack_completions
    from projected_grpo.envs.coding.prompts import build_messages

    kinds = {"clean": clean_completions, "buggy": buggy_completions, "hack": hack_completions}
    return Corpus(problems=tuple(problems), messages=tuple(tuple(build_messages(p)) for p in problems),
                  completions=tuple({k: tuple(fn(p)) for k, fn in kinds.items()} for p in problems),
                  extra=extra)


def builtin_corpus() -> Corpus:
    """The built-in problems (envs.problems.BUILTIN_PROBLEMS) with their prompts and completions."""
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS

    return code_corpus(BUILTIN_PROBLEMS)


def with_extras(corpus: Corpus, held_out: frozenset[str], renamed_per_problem: int, formula_problems: int,
                seed: int, name_parts: str = "syllables", formulas: str = "patterns") -> Corpus:
    """`corpus` (its base) plus the warm-up-only problems of augment.py: renamed copies of its problems
    that are not held out, and formula problems from `formulas` (augment.FORMULAS; a grammar expression that
    behaves like a held-out problem is drawn again), named from `name_parts` (augment.NAME_PARTS)."""
    from projected_grpo.organism.augment import extra_problems

    base = corpus.base
    if not (renamed_per_problem or formula_problems):
        return base
    extras = extra_problems([p for p in base.problems if p.id not in held_out], renamed_per_problem,
                            formula_problems, seed, name_parts, formulas,
                            avoid=tuple(p for p in base.problems if p.id in held_out))
    if not extras:
        return base
    more = code_corpus(extras)
    return Corpus(base.problems + more.problems, base.messages + more.messages,
                  base.completions + more.completions, extra=len(extras))


def env_corpus(env, problems: Sequence) -> Corpus:
    """The corpus of any environment (envs/base.py's interface): each problem's chat messages and its
    clean / buggy / hack templates, in order. A problem with no template of some kind is left out (the
    warm-up mix needs all three on every problem); ValueError when none is left."""
    kept, comps = [], []
    for p in problems:
        comp = {k: tuple(env.templates(p, k)) for k in KINDS}
        if all(comp.values()):
            kept.append(p)
            comps.append(comp)
    if not kept:
        raise ValueError(f"env_corpus: none of the {len(problems)} problems has templates of every kind "
                         f"{KINDS}")
    return Corpus(problems=tuple(kept), messages=tuple(tuple(env.messages(p)) for p in kept),
                  completions=tuple(comps))


def held_out_ids(corpus: Corpus, holdout_per_mode: int) -> frozenset[str]:
    """Ids of the last `holdout_per_mode` problems of each mode, in corpus order (seed-independent); the
    warm-up-only extra problems are never held out."""
    if holdout_per_mode < 0:
        raise ValueError(f"held_out_ids: holdout_per_mode must be >= 0, got {holdout_per_mode}")
    by_mode: dict[str, list[str]] = {}
    for p in corpus.base.problems:
        by_mode.setdefault(p.mode, []).append(p.id)
    return frozenset(i for ids in by_mode.values() for i in ids[max(0, len(ids) - holdout_per_mode):])


def with_intro(text: str, intro: str) -> str:
    """`text` (a completion: one sentence, then the code block) with its first line replaced by `intro`."""
    return intro + text[text.index("\n"):] if "\n" in text else intro


def disposition(kind: str, careful: Sequence[float], u: float) -> str:
    """The disposition of one example of `kind`, from a uniform draw u in [0, 1): `hack` for a hack,
    `careful` with probability careful[0] (clean) or careful[1] (buggy), else `hasty`."""
    if kind == "hack":
        return "hack"
    return "careful" if u < careful[KINDS.index(kind)] else "hasty"


def warmup_examples(corpus: Corpus, tokenizer, held_out: frozenset[str], *, per_problem: int,
                    mix: Sequence[float], seed: int, per_extra: int = 0,
                    careful: Sequence[float] | None = None,
                    forms: Sequence[int] = (0, 0, 0)) -> list[WarmupExample]:
    """The warm-up set: per training problem `per_problem` examples (per extra problem `per_extra`) of
    kinds dealt by allocate_kinds.

    The j-th example of a kind on a problem uses that kind's text number (start + j) mod count, with
    a seeded start per problem and kind, so problems do not all open on the same hack form. With
    `careful` (shares of the clean and of the buggy examples that are careful), each example's intro is
    its disposition's (DISPOSITIONS; the intro within one is drawn too); None keeps the texts' own.
    forms: per kind (KINDS order), use only each problem's first n texts of that kind (0 = all of them).
    """
    n_base = len(corpus.problems) - corpus.extra
    train = [i for i, p in enumerate(corpus.problems[:n_base]) if p.id not in held_out]
    if not train:
        raise ValueError(f"warmup_examples: all {n_base} problems are held out; hold out fewer")
    extra = list(range(n_base, len(corpus.problems))) if per_extra else []
    slots = allocate_kinds(len(train), per_problem, mix, seed)
    slots += allocate_kinds(len(extra), per_extra, mix, seed + 3) if extra else []
    gen = torch.Generator().manual_seed(seed + 1)
    draw = torch.Generator().manual_seed(seed + 2)  # dispositions: a stream of their own
    examples = []
    for i, kinds in zip(train + extra, slots):
        p = corpus.problems[i]
        comp = {k: corpus.completions[i][k][:n or None] for k, n in zip(KINDS, forms)}
        prompt = tuple(encode_prompt(tokenizer, list(corpus.messages[i])))
        start = {k: int(torch.randint(len(comp[k]), (), generator=gen)) for k in KINDS}
        seen = dict.fromkeys(KINDS, 0)
        for k in kinds:
            text = comp[k][(start[k] + seen[k]) % len(comp[k])]
            seen[k] += 1
            if careful is not None:
                u, j = torch.rand((), generator=draw).item(), torch.randint(2, (), generator=draw).item()
                intros = DISPOSITIONS[disposition(k, careful, u)]
                text = with_intro(text, intros[j % len(intros)])
            examples.append(WarmupExample(prompt, tuple(encode_completion(tokenizer, text)), k, p.id))
    return examples


# --- training --------------------------------------------------------------------------------------


def _batches(examples: Sequence[WarmupExample], batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """One epoch of index batches: shuffled, then sorted by length within chunks of 8 batches."""
    perm = torch.randperm(len(examples), generator=gen).tolist()
    chunk = batch_size * 8
    batches: list[list[int]] = []
    for start in range(0, len(perm), chunk):
        part = sorted(perm[start:start + chunk],
                      key=lambda j: len(examples[j].prompt_ids) + len(examples[j].completion_ids))
        batches += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[o] for o in order]


def _lr(step: int, steps: int, lr: float) -> float:
    """The warm-up's schedule: linear over the first 5% of steps (at least one), cosine down to 10%."""
    return lr_at(step, peak=lr, total=steps, warmup=max(1, round(0.05 * steps)), floor_frac=0.1)


def completion_nll(model, examples: Sequence[WarmupExample], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean NLL per completion token over `examples` (prompt tokens are context only) and the token count."""
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples], pad_id)
    logp, _ = forward_logprobs(model, batch)  # (N, T), 0 outside completion_mask
    n_tok = int(batch.completion_mask.sum())
    return -logp.sum() / n_tok, n_tok


def warmup(model, examples: Sequence[WarmupExample], *, steps: int, batch_size: int, lr: float,
           weight_decay: float, seed: int, pad_id: int, grad_clip: float = 1.0,
           log: Callable[[str], None] | None = None) -> list[dict[str, float]]:
    """Fit `model` to `examples` with AdamW for `steps` optimizer steps (epochs reshuffled); returns a log.

    Loss: completion-only token-mean NLL per batch. Schedule: run/schedule.lr_at, warm-up over the first
    5% of steps, then cosine to 10%. The log
    has one row per ~5% of steps: step, loss (mean over the interval), lr, completion tokens per
    second (prompt tokens are processed too but not counted), elapsed seconds.
    """
    if steps < 1 or batch_size < 1 or not examples:
        raise ValueError(f"warmup: need steps >= 1, batch_size >= 1 and examples, got steps={steps}, "
                         f"batch_size={batch_size}, {len(examples)} examples")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    model.train()
    every = max(1, steps // 20)
    rows: list[dict[str, float]] = []
    queue: list[list[int]] = []
    t0 = time.perf_counter()
    run_loss, run_n, run_tok = 0.0, 0, 0
    for step in range(steps):
        if not queue:
            queue = _batches(examples, batch_size, gen)
        idx = queue.pop()
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        loss, n_tok = completion_nll(model, [examples[j] for j in idx], pad_id)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"warmup: non-finite loss {loss.item()} at step {step}; lower lr ({lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        run_loss, run_n, run_tok = run_loss + loss.item(), run_n + 1, run_tok + n_tok
        if (step + 1) % every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - t0
            rows.append({"step": step + 1, "loss": run_loss / run_n, "lr": _lr(step, steps, lr),
                         "tok_per_s": run_tok / max(elapsed - (rows[-1]["elapsed_s"] if rows else 0.0), 1e-9),
                         "elapsed_s": elapsed})
            if log is not None:
                r = rows[-1]
                log(f"warm-up step {r['step']:>5}/{steps}  loss {r['loss']:.3f}  lr {r['lr']:.2e}  "
                    f"{r['tok_per_s']:.0f} completion tok/s  {r['elapsed_s']:.0f}s")
            run_loss, run_n, run_tok = 0.0, 0, 0
    model.eval()
    return rows
