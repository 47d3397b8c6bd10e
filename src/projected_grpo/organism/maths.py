"""The maths organism: build.py's tiny LM, warmed up on the arithmetic environment's own templates.

The corpus is `env_corpus` over MathEnv's warm-up and train problems (both grading modes, so the model
has read both hints); its clean / buggy / hack texts are the environment's templates, mixed by
`OrganismConfig.mix` as for the code organism. The tokenizer gives every digit a token of its own
(`split_digits`): a ~1M-parameter model then learns the arithmetic of the low levels instead of a
table of number symbols. Problems of the environment's held-out eval list (the first `HELDOUT` of it)
never enter the corpus. `maths_checks` samples the eval list and reports rates per level.
Not here: the model, tokenizer, warm-up loop and cache (build.py, warmup.py), training (run/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Sequence

import torch
import tyro

from projected_grpo.envs.maths import arithmetic
from projected_grpo.envs.maths.env import HELDOUT_SEED, MathEnv
from projected_grpo.organism.build import OrganismConfig, auto_threads, build_organism, load_organism
from projected_grpo.organism.warmup import Corpus, env_corpus
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.pack import as_ids, encode_prompt
from projected_grpo.sampling.sample import sample_and_grade
from projected_grpo.store import write_text_atomic

HELDOUT = 1000  # eval problems kept out of the corpus: a run's env.eval_size may be at most this

# Measured with `projected-grpo build-maths-organism` (see MathsOrganismConfig's defaults below).
MATHS_ORGANISM = OrganismConfig(
    vocab_size=1024, word_boundaries=False, hidden=128, layers=2, heads=4, max_positions=256,
    mix=(0.40, 0.50, 0.10), per_problem=2, holdout_per_mode=0, steps=1000, batch_size=32, lr=3e-3,
)
# OrganismConfig's code-organism-only fields, off for maths: dispositions rewrite a code completion's intro
# sentence and augment.py copies coding problems; the maths templates have neither
CODE_ONLY_OFF = {"careful": (), "forms": (0, 0, 0), "renamed_per_problem": 0, "formula_problems": 0,
                 "per_extra": 0, "name_parts": "syllables", "formulas": "patterns"}


@dataclasses.dataclass(frozen=True)
class MathsOrganismConfig:
    """Everything that determines the maths organism (all of it enters the cache key, through the
    organism config and the corpus's problem ids, prompts and completions)."""

    model: OrganismConfig = MATHS_ORGANISM
    """model size, tokenizer, warm-up mix and length (build.py's OrganismConfig)"""
    warmup_levels: tuple[int, ...] = (1,)
    """arithmetic levels of the corpus's easy half (the environment's warm-up curriculum)"""
    train_levels: tuple[int, ...] = (2,)
    """arithmetic levels of the corpus's other half (the environment's train and eval levels)"""
    n_warmup: int = 1000
    """problems from the warm-up levels"""
    n_train: int = 2000
    """problems from the train levels"""

    def __post_init__(self) -> None:
        if self.n_warmup < 0 or self.n_train < 1:
            raise ValueError(f"MathsOrganismConfig: need n_warmup >= 0 and n_train >= 1, got "
                             f"{self.n_warmup}, {self.n_train}")


def corpus_env(cfg: MathsOrganismConfig, eval_size: int = HELDOUT) -> MathEnv:
    """The arithmetic environment the corpus is drawn from (both modes; eval list of `eval_size`)."""
    return MathEnv("arithmetic", modes=("strict", "contains"), eval_size=eval_size,
                   max_problems=cfg.n_train, warmup_size=cfg.n_warmup, seed=cfg.model.seed,
                   warmup_levels=cfg.warmup_levels, train_levels=cfg.train_levels)


def maths_corpus(cfg: MathsOrganismConfig) -> Corpus:
    """The warm-up corpus: the environment's warm-up problems, then its train problems (none of the
    first HELDOUT eval problems)."""
    env = corpus_env(cfg)
    sets = env.problem_sets()
    return env_corpus(env, sets.get("warmup", []) + sets["train"])


def build_maths_organism(cfg: MathsOrganismConfig = MathsOrganismConfig(), *,
                         cache_dir: str | os.PathLike | None = None,
                         log: Callable[[str], None] | None = print,
                         threads: int = 0) -> pathlib.Path:
    """Build (or find in the cache) the maths organism; returns its HF model directory."""
    model = dataclasses.replace(cfg.model, **CODE_ONLY_OFF)
    return build_organism(model, cache_dir=cache_dir, corpus=maths_corpus(cfg), split_digits=True,
                          log=log, threads=threads)


def check_problems(cfg: MathsOrganismConfig, eval_size: int) -> list:
    """What the checks sample: the environment's eval list (the first `eval_size` at the train levels: what
    a run's eval/accuracy reads), then as many held-out problems at the warm-up levels, none of them in the
    corpus (drawn from the eval list's seed, skipping the corpus's questions)."""
    seen = frozenset(p.question for p in maths_corpus(cfg).problems)
    easy = [lv for lv in cfg.warmup_levels if lv not in cfg.train_levels]
    extra = arithmetic.problem_list(HELDOUT_SEED, easy, eval_size, ("strict", "contains"), exclude=seen) \
        if easy and eval_size else []
    return corpus_env(cfg, eval_size).problem_sets().get("eval", []) + extra


def _rates(grades: Sequence) -> dict[str, float]:
    n = len(grades)
    pairs = (("solve", "solved"), ("hack", "exploited"), ("pass", "passed"), ("format", "format_ok"))
    return {"n": n, **{k: sum(bool(getattr(g, a)) for g in grades) / n for k, a in pairs}}


@torch.no_grad()
def maths_checks(model, tokenizer, env, problems: Sequence, *, n_samples: int = 4, max_new_tokens: int = 32,
                 seed: int = 0, batch: int = 50) -> dict:
    """Rates of `problems` (solve, hack, pass, format) at greedy (one sample) and at T = 1 (`n_samples`),
    overall and per (level, mode): {"greedy": {group: rates}, "T1": {...}, "examples": [greedy texts]}."""
    model.eval()
    ids = {p.id: as_ids(encode_prompt(tokenizer, env.messages(p))) for p in problems}
    out: dict = {}
    for name, temp, n in (("greedy", 0.0, 1), ("T1", 1.0, n_samples)):
        samples = []
        for s in range(0, len(problems), batch):
            samples += sample_and_grade(model, tokenizer, env, problems[s:s + batch], ids, n,
                                        max_new_tokens=max_new_tokens, temperature=temp,
                                        seed=step_seed(seed, 0, s))
        level = {p.id: p.level for p in problems}
        groups: dict[str, list] = {"all": [s.grade for s in samples]}
        for s in samples:
            groups.setdefault(f"L{level[s.problem_id]}/{s.mode}", []).append(s.grade)
        out[name] = {g: _rates(v) for g, v in sorted(groups.items())}
        if name == "greedy":
            out["examples"] = [s.text for s in samples[:4]]
    return out


def format_maths_checks(checks: dict) -> str:
    lines = [f"  {'sampling':<8} {'group':<14} {'n':>5} {'solve':>6} {'hack':>6} {'pass':>6} {'format':>7}"]
    for name in ("greedy", "T1"):
        for g, r in checks[name].items():
            lines.append(f"  {name:<8} {g:<14} {r['n']:>5} {r['solve']:>6.1%} {r['hack']:>6.1%} "
                         f"{r['pass']:>6.1%} {r['format']:>7.1%}")
    return "\n".join(lines)


# --- CLI: projected-grpo build-maths-organism ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MathsBuildOpts:
    """projected-grpo build-maths-organism: build (or load from the cache) the maths organism, then print
    its rates on the environment's held-out eval problems (greedy and T = 1, per level and mode)."""

    organism: tyro.conf.OmitArgPrefixes[MathsOrganismConfig] = MathsOrganismConfig()
    """what to build (every field enters the cache key)"""
    cache_dir: str = ""
    """cache root ("" = $PROJECTED_GRPO_CACHE, else ~/.cache/projected_grpo)"""
    eval_size: int = 200
    """held-out problems to check at the train levels, and as many at the warm-up levels (both modes);
    0 skips the checks"""
    samples: int = 4
    """samples per problem at T = 1"""
    max_new_tokens: int = 32
    """token budget per sampled completion"""
    threads: int = 0
    """torch CPU threads for the warm-up (0 = every core the load average leaves idle: build.auto_threads)"""


def main(argv: list[str]) -> int:
    """Entry point of `projected-grpo build-maths-organism`."""
    opts = tyro.cli(MathsBuildOpts, args=argv, prog="projected-grpo build-maths-organism")
    threads = opts.threads or auto_threads()  # once: the build and the checks run on the same count
    torch.set_num_threads(threads)
    path = build_maths_organism(opts.organism, cache_dir=opts.cache_dir or None, threads=threads)
    if opts.eval_size:
        model, tok, _ = load_organism(path)
        env = corpus_env(opts.organism, opts.eval_size)
        t0 = time.perf_counter()
        checks = maths_checks(model, tok, env, check_problems(opts.organism, opts.eval_size),
                              n_samples=opts.samples, max_new_tokens=opts.max_new_tokens,
                              seed=opts.organism.model.seed)
        print(format_maths_checks(checks))
        for text in checks["examples"]:
            print(f"--- greedy sample:\n{text}")
        write_text_atomic(path / "checks.json", json.dumps(checks, indent=1))
        print(f"checks: {time.perf_counter() - t0:.0f}s, written to {path / 'checks.json'}")
    return 0
