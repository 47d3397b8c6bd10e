"""The starting model's held-out eval: step 0 of a sweep's eval curves, measured before any update.

Training logs `eval/*` only after every `run.eval_every` updates, so the point the curves start from (the
model before GRPO) is measured here, through the loop's own path: the run's model with its knobs wrapped and
still zero (the base model, bit for bit: zero knobs take the base path), `batches.eval_grades` (greedy,
deployed) and `row.eval_rates`. One value per seed, since an environment's eval set may depend on it; every
arm starts from the same model. Not here: training, the report (report.py).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Sequence

import torch

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.run import batches, setup
from projected_grpo.run.row import eval_rates


def start_eval(cfg: C.Config) -> dict[str, float]:
    """eval/accuracy, eval/hack, eval/format of the model a run of `cfg` starts from (knobs zero)."""
    old_threads = torch.get_num_threads()
    try:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        model, tok = setup.load_model(cfg)
        knobs = setup.wrap_knobs(cfg, model)
        with contextlib.closing(setup.make_env(cfg)) as env:
            sets = env.problem_sets()
            problems = sets.get("eval", sets["train"])
            ids = {i: p_ids for i, (_, p_ids) in setup.prompt_table(env, tok, problems).items()}
            return eval_rates(batches.eval_grades(cfg, model, knobs, tok, env, problems, ids))
    finally:
        torch.set_num_threads(old_threads)


def start_evals(base: C.Config, seeds: Sequence[int], path: pathlib.Path) -> dict[int, dict[str, float]]:
    """seed -> start_eval of `base` with that seed, cached in `path` (JSON; a rerun sweep reuses what is
    there for the same base config and computes only the seeds missing)."""
    key = store.stable_hash(C.replace(base, run={"seed": 0, "dir": "", "resume": False}).to_dict())
    done: dict[int, dict[str, float]] = {}
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("config_key") == key:
            done = {int(s): r for s, r in saved["by_seed"].items()}
    for seed in seeds:
        if seed not in done:
            done[seed] = start_eval(C.replace(base, run={"seed": seed}))
    by_seed = {str(s): r for s, r in sorted(done.items())}
    store.write_json_atomic(path, {"config_key": key, "by_seed": by_seed})
    return done
