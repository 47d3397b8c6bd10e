"""`projected-grpo build-pool`: build a teacher pool (pool.py) from the built-in templates or by
sampling a teacher model, grade it once in the sandbox, freeze and write it."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Literal

from projected_grpo.run.pool import build_report, teacher_rows, template_rows, write_pool


@dataclass(frozen=True)
class BuildPoolOpts:
    out: str
    """output JSONL path"""
    preset: str = "smoke"
    """preset whose model, tokenizer and environment settings are used (presets.PRESETS)"""
    source: Literal["templates", "teacher"] = "templates"
    """`templates`: built-in completions; `teacher`: sample the preset's model (or --teacher)"""
    teacher: str = ""
    """Hugging Face model directory to sample from (source=teacher; empty = the preset's model)"""
    n_hack: int | None = None
    """templates: hack rows per problem (default: the preset's pool.n_hack)"""
    n_clean: int | None = None
    """templates: clean rows per problem (default: the preset's pool.n_clean)"""
    n_buggy: int | None = None
    """templates: honest-but-buggy rows per problem (default: the preset's pool.n_buggy)"""
    samples: int = 4
    """teacher: completions sampled per problem"""
    max_new_tokens: int | None = None
    """teacher: generation length limit (default: the preset's rollout.max_new_tokens)"""
    temperature: float | None = None
    """teacher: sampling temperature (default: the preset's rollout.temperature, as `importance` needs)"""
    top_p: float | None = None
    """teacher: nucleus mass (default: the preset's rollout.top_p)"""
    seed: int = 0
    """teacher: sampling seed"""


def build_pool_main(argv: list[str]) -> int:
    """`projected-grpo build-pool`: build, grade once, freeze and write a teacher pool."""
    import tyro

    from projected_grpo import presets
    from projected_grpo.envs.coding.grading import Grader
    from projected_grpo.envs.coding.sandbox import SandboxPool
    from projected_grpo.run.train import load_model, load_problems

    opts = tyro.cli(BuildPoolOpts, args=argv, prog="projected-grpo build-pool")
    if opts.preset not in presets.PRESETS:
        raise SystemExit(f"build-pool: unknown preset {opts.preset!r}; known: {', '.join(presets.PRESETS)}")
    cfg = presets.PRESETS[opts.preset]
    pick = lambda given, preset: preset if given is None else given  # unset options follow the preset
    P, R = cfg.pool, cfg.rollout
    if opts.teacher:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source="hf", path=opts.teacher))
    problems = load_problems(cfg.env)
    with SandboxPool(n_workers=cfg.env.workers or None) as sandbox:
        grader = Grader(sandbox, reward_shape=cfg.env.reward_shape, timeout_s=cfg.env.timeout_s)
        if opts.source == "templates":
            tokenizer = load_model(cfg.model, seed=opts.seed, tokenizer_only=True)[1]
            rows = template_rows(problems, tokenizer, grader, n_hack=pick(opts.n_hack, P.n_hack),
                                 n_clean=pick(opts.n_clean, P.n_clean), n_buggy=pick(opts.n_buggy, P.n_buggy))
        else:
            model, tokenizer = load_model(cfg.model, seed=opts.seed)
            rows = teacher_rows(model, tokenizer, problems, grader, samples=opts.samples,
                                max_new_tokens=pick(opts.max_new_tokens, R.max_new_tokens),
                                temperature=pick(opts.temperature, R.temperature),
                                top_p=pick(opts.top_p, R.top_p),
                                seed=opts.seed, name=opts.teacher or cfg.model.source)
    pathlib.Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    write_pool(opts.out, rows)
    print(build_report(rows))
    print(f"wrote {len(rows)} rows to {opts.out}")
    return 0
