"""What a training loop does around its steps, for the loops beside train.py's GRPO (run/ppo.py, run/dpo.py).

  open_run        the run directory (refused when it holds a run and run.resume is off) and the checkpoint to
                  resume from, its config checked against this one; seeding of every RNG
  open_data       the prompt cursors and teacher pool of the rollout step (batches.py), pool.missing applied
  cursor_state / load_cursors   their checkpointed positions
  check_finite    a NaN/inf names the step, the source (student/teacher rows) and the module
  finish          summary.json (last-5-step means) and one greedy sample of the deployed model
Every loop (train.py's GRPO, ppo.py, dpo.py) opens and closes through these, so the run directory, resume
checks and torchrun's rank-0-writes rule (run/dist.py) are written once. Nothing here trains.
"""

from __future__ import annotations

import pathlib
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.errors import UserError
from projected_grpo.run import checkpoint, dist, metrics, setup
from projected_grpo.run.pool import PoolCursor, PromptCursor
from projected_grpo.sampling.pack import encode_prompt
from projected_grpo.sampling.sample import sample_and_grade


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def open_run(cfg: C.Config, name: str) -> tuple[C.Config, checkpoint.Checkpoint | None]:
    """(the config with run.dir resolved, the checkpoint to resume from or None); the run directory is
    created, config.json written and every RNG seeded. name: the default directory's middle part, e.g.
    "ppo-none"."""
    run_dir = pathlib.Path(cfg.run.dir or dist.from_main(f"runs/{cfg.model.source}-{name}-s{cfg.run.seed}-"
                                                         f"{time.strftime('%Y%m%d-%H%M%S')}"))
    if (run_dir / metrics.METRICS_FILE).exists() and not cfg.run.resume:
        raise FileExistsError(f"{run_dir} holds a run: pass --resume to continue it or a new --run-dir")
    cfg = C.replace(cfg, run={"dir": str(run_dir)})
    ckpt_path = checkpoint.latest_checkpoint(run_dir) if cfg.run.resume else None
    ck = checkpoint.load_checkpoint(ckpt_path) if ckpt_path else None
    if ck is not None:  # run.dir may differ: a run directory can be moved and resumed where it is now
        old = C.Config.from_dict(ck.config, where=f"{ckpt_path} config")
        if diff := C.diff(old, cfg, ("run.resume", "run.steps", "run.dir")):
            raise ValueError(f"--resume: {ckpt_path} was written with another config: {diff}")
        dist.check_world_size(ck.cursors.get("world_size", 1), ckpt_path)  # the shards depend on it
        if old.run.steps != cfg.run.steps:
            _log(f"--resume: run.steps {old.run.steps} -> {cfg.run.steps}: the cosine LR schedule now spans "
                 f"{cfg.run.steps} steps, so from step {ck.step} on this is not the run the first command "
                 "would have finished")
    run_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_main():  # under torchrun only rank 0 writes (config, metrics, checkpoints, summary)
        store.write_json_atomic(run_dir / "config.json", cfg.to_dict())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    return cfg, ck


@dataclass
class Data:
    """The rollout step's inputs: problem sets, id -> problem, id -> prompt ids, stage -> cursor, pool's.
    train_prompt_ids: the prompts the students sample and train under: `prompt_ids` itself, or under
    inoculation prompting the environment's inoculation_messages (docs/interventions.md)."""

    sets: dict[str, list]
    problems: dict[str, object]
    prompt_ids: dict[str, list[int]]
    train_ids: list[str]
    cursors: dict[str, PromptCursor]
    pool_cur: PoolCursor
    train_prompt_ids: dict[str, list[int]]


def open_data(cfg: C.Config, env, tok, run_dir: pathlib.Path) -> Data:
    """Prompts, teacher pool and cursors as train.train opens them (pool.missing: restrict / error / students;
    `importance` refused on a pool without behaviour log-probs)."""
    sets = env.problem_sets()
    problems = {p.id: p for ps in sets.values() for p in ps}
    prompts = setup.prompt_table(env, tok, problems.values())
    with dist.main_first():  # rank 0 builds a template pool first; the others read it
        pool = setup.open_pool(cfg, env, tok, sets["train"], prompts, run_dir)
    ids = {stage: [p.id for p in ps] for stage, ps in sets.items() if stage != "eval"}
    missing = pool.missing(ids["train"]) if cfg.rollout.G_t else []
    if missing and cfg.pool.missing == "error":
        raise ValueError(f"teacher pool {pool.path}: no rows for {len(missing)} problems {missing[:8]}; "
                         "extend the pool or set --pool.missing restrict (or students)")
    if missing:
        _log(f"teacher pool {pool.path}: no rows for {len(missing)}/{len(ids['train'])} problems {missing}: "
             + ("they are left out of sampling" if cfg.pool.missing == "restrict" else
                "their groups are all student samples"))
        if cfg.pool.missing == "restrict":
            ids["train"] = [i for i in ids["train"] if i not in missing]
    if cfg.loss.teacher == "importance" and cfg.rollout.G_t and not pool.has_behaviour_logp():
        raise ValueError(f"--loss.teacher importance needs behaviour log-probs, but {pool.path} has rows "
                         "with logp_behaviour=null (template rows); build it with --source teacher")
    prompt_ids = {i: p_ids for i, (_, p_ids) in prompts.items()}
    return Data(sets, problems, prompt_ids, ids["train"],
                {stage: PromptCursor(stage_ids, cfg.run.seed) for stage, stage_ids in ids.items()},
                PoolCursor(pool, cfg.run.seed), inoculated(cfg, env, tok, problems) or prompt_ids)


def inoculated(cfg: C.Config, env, tok, problems: dict[str, object]) -> dict[str, list[int]] | None:
    """Under monitor.intervention inoculation, id -> the ids of the environment's inoculation prompt (None
    otherwise); an environment without one is refused."""
    if cfg.monitor.intervention != "inoculation":
        return None
    if not hasattr(env, "inoculation_messages"):
        raise UserError(f"monitor.intervention=inoculation: environment {env.name!r} has no inoculation "
                        "prompt")
    return {i: encode_prompt(tok, env.inoculation_messages(p)) for i, p in problems.items()}


def cursor_state(data: Data) -> dict:
    return {"prompts": {s: c.state_dict() for s, c in data.cursors.items()},
            "pool": data.pool_cur.state_dict(), "world_size": dist.world_size()}


def load_cursors(data: Data, ck: checkpoint.Checkpoint) -> None:
    for stage, state in ck.cursors["prompts"].items():
        data.cursors[stage].load_state_dict(state)
    data.pool_cur.load_state_dict(ck.cursors["pool"])


def check_finite(step: int, what: str, by_source: dict[str, dict[str, torch.Tensor]]) -> None:
    """Fail fast on NaN/inf, naming the step, the source(s) and the module (or tensor): by_source is
    source -> {name: values}, as split.Capture keeps each source's gradient apart."""
    for name in next(iter(by_source.values())):
        bad = [src for src, named in by_source.items() if not torch.isfinite(named[name]).all()]
        if bad:
            raise FloatingPointError(f"step {step}: non-finite {what} from the {' and '.join(bad)} rows "
                                     f"in {name}")


def finish(cfg: C.Config, model, knobs, tok, env, data: Data, **extra) -> dict:
    """summary.json: last-5-step means of metrics.jsonl, `extra`, and one greedy sample of the deployed model
    (quarantine zeroed) on the first train problem; printed and returned."""
    run_dir = pathlib.Path(cfg.run.dir)
    first = data.problems[data.train_ids[0]]
    with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
        sample = sample_and_grade(model, tok, env, [first], data.prompt_ids, 1,
                                  max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, seed=0)[0]
    summary = metrics.summarize(metrics.read_rows(run_dir / metrics.METRICS_FILE))
    summary |= {"run_dir": str(run_dir), **extra, "sample_problem": first.id, "sample": sample.text}
    store.write_json_atomic(run_dir / metrics.SUMMARY_FILE, summary)
    print("\n".join(f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v!r}"
                    for k, v in summary.items()))
    return summary

