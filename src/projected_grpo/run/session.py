"""What a training loop does around its steps, for every loop (train.py's GRPO, run/ppo.py, run/dpo.py).

  open_run        the run directory, locked for this process (one writer: RunLocked for a second one),
                  refused when it holds a started run and run.resume is off, and the checkpoint to resume
                  from, its config checked against this one; seeding of every RNG
  open_data       the prompt cursors and teacher pool of the rollout step (batches.py), pool.missing applied
  resume          the checkpoint's knobs, V_hack, optimizer, extra tensors, cursors and RNG restored, or a
                  fresh V_hack: the one resume path of every loop
  MovementGuard   fail closed when training does not train: knobs unmoved after their first informative steps
  cursor_state / load_cursors   the cursors' checkpointed positions
  check_finite    a NaN/inf names the step, the source (student/teacher rows) and the module
  finish          summary.json (last-5-step means) and one greedy sample of the deployed model; unlocks
  cleanup_on_failure   around a command: a run directory it created and never stepped in is removed
                  when the command fails (so the same command can simply be run again); bars closed
Every loop opens and closes through these, so the run directory, its lock, resume checks and torchrun's
rank-0-writes rule (run/dist.py) are written once. Nothing here trains.
"""

from __future__ import annotations

import contextlib
import pathlib
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.errors import RunLocked, TrainingStalled, UserError
from projected_grpo.run import checkpoint, dist, metrics, setup
from projected_grpo.run.pool import PoolCursor, PromptCursor
from projected_grpo.sampling.pack import as_ids, encode_prompt
from projected_grpo.sampling.sample import concrete_dtype, sample_and_grade


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


LOCK_FILE = "writer.lock"  # in the run directory: flock'd by the process writing it (store.DirLock)
# run directory (resolved) -> (its lock, whether this process created the directory)
_HELD: dict[pathlib.Path, tuple[store.DirLock, bool]] = {}


def started(run_dir: pathlib.Path) -> bool:
    """Whether run_dir holds a started run: a checkpoint or a logged step. A directory left by a run that
    failed or was killed before its first step holds neither and is free for a plain rerun."""
    if checkpoint.checkpoints(run_dir):
        return True
    path = run_dir / metrics.METRICS_FILE
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def _lock(run_dir: pathlib.Path) -> None:
    """Create run_dir if missing and take its lock for this process; RunLocked if another process holds it.
    This process's own lock from an earlier run in it (ended by an exception) is taken again."""
    key = run_dir.resolve()
    if key in _HELD:
        _HELD.pop(key)[0].release()
    created = not run_dir.exists()
    with store.naming(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = store.DirLock(run_dir / LOCK_FILE)
    except store.Locked as e:
        raise RunLocked(f"{run_dir} is being written by another process ({e.holder or 'unknown pid'}): a run "
                        "directory has one writer; wait for that process to end or stop it, then rerun "
                        "(with --resume to continue the run)") from None
    _HELD[key] = (lock, created)


def release(run_dir: str | pathlib.Path) -> None:
    """Unlock run_dir if this process holds it (the end of a run; exit and crashes unlock it too)."""
    held = _HELD.pop(pathlib.Path(run_dir).resolve(), None)
    if held is not None:
        held[0].release()


@contextlib.contextmanager
def cleanup_on_failure() -> Iterator[None]:
    """Around a command: when it fails, its progress bars are closed (the error line starts a line of its
    own) and every run directory it opened is unlocked, and removed when this process created it and no step
    was logged or checkpointed there (a run that failed in setup or in its first step), so the fixed command
    runs again as it is, not with --resume or a new --run-dir."""
    before = set(_HELD)
    try:
        yield
    except BaseException:
        metrics.close_bars()
        for key in [k for k in _HELD if k not in before]:
            lock, created = _HELD.pop(key)
            if created and not started(key):
                shutil.rmtree(key, ignore_errors=True)  # under the lock: no other process is in it
            lock.release()
        raise


def resolved(cfg: C.Config) -> C.Config:
    """cfg with every "auto" made concrete for this process on this machine, as config.json records it:
    rollout.seed_scope (config.resolve_auto) and rollout.sample_dtype (sampling/packed.py's choice for the
    model's device). A planned config is compared with a written one only after this."""
    cfg = C.resolve_auto(cfg)
    dtype = concrete_dtype(cfg.rollout.sample_dtype, cfg.model.device)
    return C.replace(cfg, rollout={"sample_dtype": dtype})


def open_run(cfg: C.Config, name: str) -> tuple[C.Config, checkpoint.Checkpoint | None]:
    """(the config with run.dir, rollout.seed_scope and rollout.sample_dtype resolved, the checkpoint to
    resume from or None); the run directory is created and locked (rank 0 under torchrun: only it writes),
    config.json written and every RNG seeded. name: the default directory's middle part, e.g. "ppo-none"."""
    cfg = resolved(cfg)  # config.json records which seeds the run drew and which weights it sampled from
    run_dir = pathlib.Path(cfg.run.dir or dist.from_main(f"runs/{cfg.model.source}-{name}-s{cfg.run.seed}-"
                                                         f"{time.strftime('%Y%m%d-%H%M%S')}"))
    if dist.is_main():
        _lock(run_dir)
    try:
        ck = _checked_checkpoint(cfg, run_dir)
    except BaseException:
        release(run_dir)
        raise
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = C.replace(cfg, run={"dir": str(run_dir)})
    if dist.is_main():  # under torchrun only rank 0 writes (config, metrics, checkpoints, summary)
        store.write_json_atomic(run_dir / "config.json", cfg.to_dict())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    return cfg, ck


def _checked_checkpoint(cfg: C.Config, run_dir: pathlib.Path) -> checkpoint.Checkpoint | None:
    """The checkpoint --resume continues from (None: a fresh run), refused when it was written with other
    settings or world size; a started run without --resume is refused."""
    if not cfg.run.resume:
        if started(run_dir):
            raise UserError(f"{run_dir} holds a run: pass --resume to continue it, or a new --run-dir")
        return None
    ckpt_path = checkpoint.latest_checkpoint(run_dir)
    if ckpt_path is None:
        return None
    ck = checkpoint.load_checkpoint(ckpt_path)
    # run.dir may differ: a run directory can be moved and resumed where it is now
    old = C.Config.from_dict(ck.config, where=f"{ckpt_path} config")
    if diff := C.diff(old, C.replace(cfg, run={"dir": str(run_dir)}), ("run.resume", "run.steps", "run.dir")):
        raise UserError(f"--resume: {ckpt_path} was written with another config: {diff}; resume with the "
                        "config it was written with, or start a new --run-dir")
    dist.check_world_size(ck.cursors.get("world_size", 1), ckpt_path)  # the shards depend on it
    if old.run.steps != cfg.run.steps:
        _log(f"--resume: run.steps {old.run.steps} -> {cfg.run.steps}: the cosine LR schedule now spans "
             f"{cfg.run.steps} steps, so from step {ck.step} on this is not the run the first command "
             "would have finished")
    return ck


def resume(ck: checkpoint.Checkpoint | None, knobs, opt: torch.optim.Optimizer, data: Data | None = None, *,
           fresh: Callable[[], tuple[dict, str]], extra=None) -> tuple[dict, str, int]:
    """(V_hack, the line saying where it came from, the first step), for every loop. With a checkpoint its
    state is restored in place: knobs, `extra` (an object with load_state(tensors, where), e.g. PPO's value
    head), optimizer, the data cursors (when the loop has them) and, last, every RNG; V_hack is the
    checkpoint's (a resumed run never re-extracts). Without one: fresh() gives V_hack (rank 0 first under
    torchrun, as it fills the cache the others read) and training starts at step 0."""
    if ck is None:
        with dist.main_first():
            V_hack, v_line = fresh()
        return V_hack, v_line, 0
    ck.load_knobs(knobs)
    if extra is not None:
        extra.load_state(ck.extra, where=f"checkpoint {ck.path}")
    opt.load_state_dict(ck.optimizer_state)
    if data is not None:
        load_cursors(data, ck)
    checkpoint.restore_rng(ck)  # last: nothing above may draw from the restored streams
    return ck.V_hack, f"V_hack from {ck.path}", ck.step


STALL_STEPS = 3  # informative steps after which knobs that have not moved stop the run (MovementGuard)


class MovementGuard:
    """Fail closed when training does not train. Fed every step after its update, it compares the knobs
    (main and quarantine) after the first `steps` informative steps (steps with a learning signal: not every
    group zero-variance) with their values when the guard was made; if not one value moved it raises
    TrainingStalled with the likely cause (every gradient zero: a detached graph or a loss that does not
    reach the knobs; else the optimizer did not step them: a zero learning rate, knobs outside its groups).
    One AdamW step with a non-zero gradient moves a knob by about lr, so a live run never trips it. After
    that one check it costs nothing. A resumed run is checked again from its resume step."""

    def __init__(self, knobs, steps: int = STALL_STEPS):
        if steps < 1:
            raise ValueError(f"MovementGuard: steps must be >= 1, got {steps}")
        self.params = knobs.parameters() + knobs.hack_parameters()
        self.start: list[torch.Tensor] | None = [p.detach().clone() for p in self.params]
        self.steps, self.seen, self.grad_max = steps, 0, 0.0

    def after_step(self, step: int, informative: bool = True, grad_norm: float | None = None) -> None:
        """Count `step` (after its optimizer update) when informative; check at the steps-th one."""
        if self.start is None or not informative:
            return
        self.seen += 1
        self.grad_max = max(self.grad_max, abs(float(grad_norm or 0.0)))
        if self.seen < self.steps:
            return
        moved = any(not torch.equal(p.detach(), s) for p, s in zip(self.params, self.start))
        self.start = None
        if moved:
            return
        why = ("every knob gradient was zero: no gradient reaches the knobs (a detached graph, or a loss "
               "that does not depend on them)" if self.grad_max == 0.0 else
               f"the gradients were not zero (norm up to {self.grad_max:.3g}) but the optimizer did not move "
               "the knobs (a zero learning rate, or knobs missing from its parameter groups)")
        raise TrainingStalled(f"step {step}: the knobs have not moved in {self.seen} informative steps, so "
                              f"this run does not train: {why}")


@dataclass
class Data:
    """The rollout step's inputs: problem sets, id -> problem, id -> prompt ids ((T_p,) torch.long),
    stage -> cursor, pool's.
    train_prompt_ids: the prompts the students sample and train under: `prompt_ids` itself, or under
    inoculation prompting the environment's inoculation_messages (docs/interventions.md)."""

    sets: dict[str, list]
    problems: dict[str, object]
    prompt_ids: dict[str, torch.Tensor]
    train_ids: list[str]
    cursors: dict[str, PromptCursor]
    pool_cur: PoolCursor
    train_prompt_ids: dict[str, torch.Tensor]


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
        raise UserError(f"teacher pool {pool.path}: no rows for {len(missing)} problems {missing[:8]}; "
                         "extend the pool or set --pool.missing restrict (or students)")
    if missing:
        _log(f"teacher pool {pool.path}: no rows for {len(missing)}/{len(ids['train'])} problems {missing}: "
             + ("they are left out of sampling" if cfg.pool.missing == "restrict" else
                "their groups are all student samples"))
        if cfg.pool.missing == "restrict":
            ids["train"] = [i for i in ids["train"] if i not in missing]
            if not ids["train"]:
                raise UserError(f"teacher pool {pool.path}: no rows for any of the {len(missing)} train "
                                "problems, and --pool.missing restrict leaves none to train on; give a pool "
                                "for these problems, or train without one (--rollout.mix 0) or with "
                                "--pool.missing students")
    if cfg.loss.teacher == "importance" and cfg.rollout.G_t and not pool.has_behaviour_logp():
        raise UserError(f"--loss.teacher importance needs behaviour log-probs, but {pool.path} has rows "
                         "with logp_behaviour=null (template rows); build it with --source teacher")
    prompt_ids = {i: p_ids for i, (_, p_ids) in prompts.items()}
    return Data(sets, problems, prompt_ids, ids["train"],
                {stage: PromptCursor(stage_ids, cfg.run.seed) for stage, stage_ids in ids.items()},
                PoolCursor(pool, cfg.run.seed), inoculated(cfg, env, tok, problems) or prompt_ids)


def inoculated(cfg: C.Config, env, tok, problems: dict[str, object]) -> dict[str, torch.Tensor] | None:
    """Under monitor.intervention inoculation, id -> the ids (T_p,) torch.long of the environment's
    inoculation prompt (None otherwise); an environment without one is refused."""
    if cfg.monitor.intervention != "inoculation":
        return None
    if not hasattr(env, "inoculation_messages"):
        raise UserError(f"monitor.intervention=inoculation: environment {env.name!r} has no inoculation "
                        "prompt")
    return {i: as_ids(encode_prompt(tok, env.inoculation_messages(p))) for i, p in problems.items()}


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
    release(run_dir)
    print("\n".join(f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v!r}"
                    for k, v in summary.items()))
    return summary

