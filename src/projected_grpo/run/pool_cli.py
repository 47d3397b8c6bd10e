"""`projected-grpo build-pool`: build a teacher pool (pool.py) from the environment's templates or by sampling
a teacher model, grade it once, freeze and write it. The settings are the run's own config fields
(`--pool.n-hack`, `--rollout.temperature`, ...), so a pool built here equals the one `train` would build."""

from __future__ import annotations

import contextlib
import pathlib
from dataclasses import dataclass
from typing import Literal

from projected_grpo import presets
from projected_grpo.run import setup
from projected_grpo.run.pool import build_report, sampled_rows, write_pool
from projected_grpo.sampling.sample import sample_and_grade


@dataclass(frozen=True, kw_only=True)
class BuildPoolOpts(presets.Base):
    """projected-grpo build-pool: template rows use pool.n_hack / n_clean / n_buggy; teacher samples use
    rollout.max_new_tokens / temperature / top_p of the config (as loss.teacher=importance needs)."""

    out: str
    """output JSONL path"""
    source: Literal["templates", "teacher"] = "templates"
    """`templates`: the environment's hand-written completions; `teacher`: samples of the config's model"""
    samples: int = 4
    """teacher: completions sampled per problem"""
    seed: int = 0
    """teacher: sampling seed"""


def build_pool_main(argv: list[str]) -> int:
    """`projected-grpo build-pool`: build, grade once, freeze and write a teacher pool."""
    cfg, opts = presets.parse(argv, "projected-grpo build-pool", BuildPoolOpts)
    model, tok = setup.load_model(cfg, tokenizer_only=opts.source == "templates")
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()["train"]
        prompts = setup.prompt_table(env, tok, problems)
        out = pathlib.Path(opts.out)
        if opts.source == "templates":
            rows = setup.build_template_pool(cfg, env, tok, problems, prompts, out)
        else:
            ids = {i: p_ids for i, (_, p_ids) in prompts.items()}
            got = sample_and_grade(model, tok, env, problems, ids, opts.samples,
                                   max_new_tokens=cfg.rollout.max_new_tokens,
                                   temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                   seed=opts.seed)
            rows = sampled_rows(got, tok, prompts, name=cfg.model.path or cfg.model.source)
            write_pool(out, rows)
    print(build_report(rows))
    print(f"wrote {len(rows)} rows to {out}")
    return 0
