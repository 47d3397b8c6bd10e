"""Experiment runner: arms × seeds sweeps over one base Config, leave-one-mode-out, `demo`.

A sweep is one run directory per (arm, seed) under the sweep directory (docs/architecture.md), each
trained by `projected-grpo train --config <plan>` in its own process (launch.py), `--jobs` at a time.
Inputs shared by all runs are built once: the model (the organism's cache), the teacher pool
(`DIR/pool.jsonl`, template rows graded once) and V_hack (extracted by the first run that needs it into
the cache, keyed by model, pairs and settings, so later runs and later sweeps load it). Rerunning the
same command continues a sweep: finished runs (summary.json) are skipped after checking their config,
interrupted ones resume from their last checkpoint. Aggregation, verdicts, plot and report.md live in
report.py.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.errors import UserError
from projected_grpo.hack import direction
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.run import metrics, session, setup
from projected_grpo.run import pool as P
from projected_grpo.study import launch, report, start_eval, summary, tables
from projected_grpo.study.arms import ARMS, RANDOM_TWIN, arm_sections, describe_arm

# the demo by default: the baseline, the method, its random-V control and the positive control, 4 runs at
# one seed, about 10 minutes on 2 cores: a demonstration (the results with seeds are docs/results.md)
DEMO_ARMS: tuple[str, ...] = ("none", "erase", "random_V", "gt_reward")
# `demo --arms all`: the preregistered arms, the controls that can fail (random, orientation, label,
# energy-matched; docs/preregistration.md "Controls"), the positive control
DEMO_ARMS_ALL: tuple[str, ...] = ("none", "erase", "route", "random_V", "shuffled_V", "within_V", "energy_V",
                                  "gt_reward")
# demo --task -> (preset, {--arms: arms}): math trains honestly (strict verifier), so one arm, no projection
DEMO_TASKS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "code": ("demo", {"quick": DEMO_ARMS, "all": DEMO_ARMS_ALL}),
    "math": ("math-demo", {"quick": ("none",), "all": ("none",)})}
LOMO_PAIRS_FILE = "lomo_pairs.jsonl"
Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Run:
    """One (arm, seed) of a sweep and the full Config it trains with (run.dir set)."""

    arm: str
    seed: int
    cfg: C.Config

    @property
    def dir(self) -> pathlib.Path:
        return pathlib.Path(self.cfg.run.dir)


def plan(base: C.Config, arms: Sequence[str], seeds: Sequence[int], out: pathlib.Path) -> list[Run]:
    """One Run per (arm, seed): the arm's changes (arm_sections) on top of `base`, run dir
    `out/<arm>-s<seed>`."""
    unknown = [a for a in arms if arm_sections(a) is None]
    if unknown or not arms:
        raise UserError(f"arms {list(arms)}: unknown {unknown}; known: {list(ARMS)}, or `<arm>{RANDOM_TWIN}` "
                        "for a projection arm (its random-V twin)")
    if len(set(arms)) != len(arms) or len(set(seeds)) != len(seeds) or not seeds:
        raise UserError(f"arms {list(arms)} and seeds {list(seeds)} must be non-empty and without repeats")
    controls = {arm_sections(a)["proj"]["control"] for a in arms}
    if base.proj.v_path and len(controls) > 1:
        raise UserError(f"proj.v_path={base.proj.v_path!r} is one file, but arms {list(arms)} need V_hack "
                         f"with controls {sorted(controls)}; drop --proj.v-path (cached per control)")
    runs = []
    for arm in arms:
        for seed in seeds:
            sections = arm_sections(arm)
            sections["run"] = {"seed": seed, "dir": str(out / f"{arm}-s{seed}"), "resume": False}
            runs.append(Run(arm, seed, C.replace(base, **sections)))
    return runs


# --- shared inputs: model, teacher pool, leave-one-mode-out pairs -------------------------------------------

def prepare_model(cfg: C.Config, log: Log):
    """The tokenizer, through setup.load_model: so the organism is built (or found) in its cache now, as a
    visible stage, by the same code path every run then loads it with."""
    log(f"model: source={cfg.model.source} {cfg.model.path}".rstrip())
    return setup.load_model(cfg, tokenizer_only=True)[1]


def build_pool(cfg: C.Config, tok, path: pathlib.Path, log: Log, modes: Sequence[str] = ()) -> None:
    """Template teacher pool over the environment's train problems (of `modes` only, when given): what
    train.train would build in each run dir, graded once; an existing file is reused (load_pool checks it
    against the tokenizer when each run starts)."""
    if path.exists():
        log(f"teacher pool: reusing {path}")
        return

    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = [p for p in env.problem_sets()["train"] if not modes or p.mode in modes]
        prompts = setup.prompt_table(env, tok, problems)
        rows = setup.build_template_pool(cfg, env, tok, problems, prompts, path)
    log(f"teacher pool: {len(rows)} rows -> {path}\n{P.build_report(rows)}")


def lomo_known_modes(base: C.Config, mode: str) -> tuple[str, ...]:
    """The modes V_hack and the teacher pool may draw on when `mode` is held out; raises before any work
    when the leave-one-mode-out test cannot run."""
    from projected_grpo.envs.coding.problems import MODES

    if base.env.name != "coding":
        raise UserError(f"--lomo needs the coding environment's modes, not env.name={base.env.name!r}")
    if mode not in MODES:
        raise UserError(f"--lomo {mode!r} is not a loophole mode; known: {list(MODES)}")
    if base.env.modes and mode not in base.env.modes:
        raise UserError(f"--lomo {mode}: env.modes={list(base.env.modes)} does not train on it")
    known = tuple(m for m in (base.env.modes or MODES) if m != mode)
    if not known:
        raise UserError(f"--lomo {mode}: env.modes={list(base.env.modes)} leaves no other mode for V_hack")
    return known


def lomo_base(base: C.Config, tok, mode: str, out: pathlib.Path, log: Log) -> tuple[C.Config, list[str]]:
    """Leave-one-mode-out as the study means it: (config, report notes). The run trains on every mode of
    the base config, but the held-out `mode` appears neither in the teacher pool (built over the other
    modes only; its prompts get all-student groups, pool.missing = "students") nor in V_hack's pairs
    (mined from that pool with the other modes' detector E: the weak-detector rule, pairs.pairs_from_pool)."""
    known = lomo_known_modes(base, mode)
    pool_path = pathlib.Path(base.pool.path or out / f"pool-without-{mode}.jsonl")
    if base.pool.path:
        log(f"leave-one-mode-out: the given pool {pool_path} must hold no row of `{mode}` (checked)")
    else:
        build_pool(base, tok, pool_path, log, modes=known)
    with contextlib.closing(setup.make_env(base)) as env:
        problems = env.problem_sets()["train"]
        ids = {i: p_ids for i, (_, p_ids) in setup.prompt_table(env, tok, problems).items()}
        rows = P.load_pool(pool_path, tok, problems, ids).rows  # schema and tokenizer-drift checked
        if held := sorted({r["problem_id"] for r in rows if r["mode"] == mode}):
            raise UserError(f"{pool_path}: holds rows of the held-out mode {mode} ({held[:4]}...)")
        mined, stats = setup.mined_pairs(str(pool_path), tok, problems, ids, known, ("E",),
                                   base.proj.pairs_per_problem)
    pairs_path = out / LOMO_PAIRS_FILE
    write_pairs(mined, stats, known, pairs_path)
    log(f"leave-one-mode-out: hold out {mode}; teacher pool and V_hack's {stats['n_pairs']} pairs from "
        f"{list(known)} -> {pairs_path} ({json.dumps(stats['pairs_per_mode'])})")
    cfg = C.replace(base, proj={"pairs": str(pairs_path)},
                    pool={"path": str(pool_path), "missing": "students"})
    notes = [f"leave-one-mode-out: `{mode}` held out of the teacher pool and of V_hack's {stats['n_pairs']} "
             f"pairs (mined with the detector E of {', '.join(known)}); its prompts were trained with "
             f"all-student groups. Its own rates are the `/{mode}` columns."]
    return cfg, notes


def write_pairs(mined: Sequence, stats: dict, known: Sequence[str], path: pathlib.Path) -> None:
    """Write mined pairs as a pairs JSONL file (pairs.load_pairs_file reads it back, stored ids kept)."""
    if not mined:
        raise UserError(f"no (hack, clean) pairs mined for modes {list(known)} ({json.dumps(stats)}); the "
                        "pool needs hack and clean rows of those modes (pool.n_hack, pool.n_clean >= 1)")
    records = [{"prompt": p.prompt, "hack": p.hack, "clean": p.clean, "prompt_ids": list(p.prompt_ids),
                "hack_ids": list(p.hack_ids), "clean_ids": list(p.clean_ids), "source": p.source}
               for p in mined]
    store.write_jsonl_atomic(path, records)


# --- running ------------------------------------------------------------------------------------------------

def _check_existing(runs: Sequence[Run]) -> None:
    """A run directory already there (finished or interrupted) is reused only when it was trained with
    the planned config; checked for every run before the sweep writes or trains anything."""
    for run in runs:
        if not (run.dir / "config.json").is_file():
            continue
        done = C.Config.from_json(str(run.dir / "config.json"))
        # a planned "auto" against what the run resolved it to on this machine
        diff = C.diff(done, session.resolved(run.cfg), ignore=("run.resume",))
        if diff:
            state = "finished" if (run.dir / metrics.SUMMARY_FILE).exists() else "started"
            raise UserError(f"{run.dir} {state} with another config than this sweep plans ({diff}); "
                             "use another --out or remove that run directory")


def plan_sweep(base: C.Config, tok, arms: Sequence[str], seeds: Sequence[int], out: pathlib.Path, lomo: str,
               log: Log) -> tuple[C.Config, list[Run], list[str]]:
    """A sweep's shared inputs (the teacher pool, or leave-one-mode-out's pool and pairs) and its runs,
    checked against run directories already there: (the base the runs share, runs, report notes)."""
    notes: list[str] = []
    if lomo:
        base, notes = lomo_base(base, tok, lomo, out, log)
    elif not base.pool.path and base.rollout.G_t:
        build_pool(base, tok, out / "pool.jsonl", log)
        base = C.replace(base, pool={"path": str(out / "pool.jsonl")})
    runs = plan(base, arms, seeds, out)
    _check_existing(runs)
    _check_controls(base, runs)
    return base, runs, notes


def _check_controls(base: C.Config, runs: Sequence[Run]) -> None:
    """Every planned run's V_hack control can be built from the sweep's pairs (arms change the control, not
    the pairs): refused now, naming the arms and the fix, not at each of their runs' start hours later."""
    needed = {r.cfg.proj.control for r in runs} - {"none", "random"}
    if not needed or base.proj.v_path:
        return
    with contextlib.closing(setup.make_env(base)) as env:
        pair_list = hack_resolve.v_pairs(base, env, env.problem_sets()["train"])
    if not pair_list:  # no pairs at all: each run says so itself (resolve_v_hack)
        return
    why = direction.unavailable_controls(pair_list, base.proj.heldout_frac)
    blocked = sorted({r.arm for r in runs if r.cfg.proj.control in why})
    if blocked:
        reasons = "; ".join(f"{c}: {why[c]}" for c in sorted(needed & set(why)))
        raise UserError(f"arms {blocked} need V_hack controls that cannot be built from these "
                        f"{len(pair_list)} pairs ({reasons}). Pass --proj.pairs-per-problem 2 (or more), or "
                        "leave those arms out of --arms")


def sweep(base: C.Config, arms: Sequence[str], seeds: Sequence[int], out: str | pathlib.Path, *, preset: str,
          command: str, lomo: str = "", title: str = "", jobs: int = 1, log: Log = _stderr,
          backend: str = "local", ray_address: str = "") -> str:
    """Run the sweep end to end and write its report; returns the printed results (table + verdicts).
    jobs, backend, ray_address: how the runs are run (launch.run_all)."""
    t0 = time.perf_counter()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = lambda i, what: log(f"[stage {i}/4 at {time.perf_counter() - t0:.0f} s] {what}")
    stage(1, "model")
    tok = prepare_model(base, log)
    stage(2, "teacher pool" + (f" and pairs without mode {lomo} (leave-one-mode-out)" if lomo else ""))
    user_base = base
    base, runs, notes = plan_sweep(base, tok, arms, seeds, out, lomo, log)
    store.write_json_atomic(out / "sweep.json", {"command": command, "preset": preset, "arms": list(arms),
                                                   "seeds": list(seeds), "lomo": lomo,
                                                   "base": base.to_dict()})
    stage(3, f"{len(runs)} runs ({len(arms)} arms x {len(seeds)} seeds); first one extraction per seed "
             "fills the V_hack cache of every control of the runs not finished, then the runs load theirs")
    counts = launch.run_all(runs, out / "plans", log, jobs=jobs, backend=backend, ray_address=ray_address,
                            command=command)  # SIGTERM / Ctrl-C: every run stopped, then this command resumes
    stage(4, "report")
    eval_start = None
    if base.run.eval_every:  # step 0 of the eval curves (training logs eval/* only after updates); cached
        eval_start = start_eval.start_evals(base, seeds, out / report.EVAL_START_FILE)
        log(f"held-out eval of the starting model (knobs zero): {json.dumps(eval_start)}")
    by_arm = {a: [r.dir for r in runs if r.arm == a] for a in arms}
    notes.append(f"this invocation: {counts['trained']} runs trained, {counts['resumed']} resumed, "
                 f"{counts['skipped']} skipped as already finished")
    _, printed = report.write_report(
        out, by_arm, title=title or f"{preset}: {', '.join(arms)} x {len(seeds)} seed(s)" + (
            f", leave out {lomo}" if lomo else ""),
        config_diff=C.diff(presets.PRESETS[preset], user_base),
        arm_overrides={a: describe_arm(a) for a in arms},
        command=command, elapsed_s=time.perf_counter() - t0, notes=notes, eval_start=eval_start,
        held_out=lomo)
    return printed


# --- CLI: projected-grpo experiment / demo ------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ExperimentOpts(presets.Base):
    """Sweep arms x seeds over a preset; further `--section.field VALUE` options change the base config
    (as for `projected-grpo train`). Rerun the printed command to continue an interrupted sweep."""

    arms: str = "none,erase,route"
    """comma-separated arms (`projected-grpo arms` prints the table); `<arm>@random` is a projection arm with
    a random V (`@shuffled`, `@nonhack`, `@within`, `@energy`: with those controls' V)"""
    seeds: int = 1
    """seeds 0 .. N-1 per arm"""
    out: str = ""
    """sweep directory (empty = runs/exp-<preset>-<time>)"""
    lomo: str = ""
    """leave-one-mode-out: hold this loophole mode out of the teacher pool and of V_hack's pairs"""
    jobs: int = 0
    """runs trained at once, each in its own process (0 = what the cores allow: cores // run.threads, or
    the Ray cluster's CPUs // run.threads)"""
    backend: str = "local"
    """where runs go: `local` (this machine, --jobs at once) or `ray` (each run a Ray task; pip install
    'projected-grpo[ray]')"""
    ray_address: str = ""
    """--backend ray: the cluster (`auto`, or ray://HOST:10001); empty = a local Ray instance"""


@dataclass(frozen=True)
class DemoOpts:
    """The embedded demo: organism, V_hack, then arms none, erase, random_V (erase with a random V) and
    gt_reward (the positive control) at one seed with the `demo` preset, about 10 minutes on 2 cores; ends
    with the deployed model's rates per arm, one verdict line and the paths of report.md and curves.png.
    `--arms all --seeds 3`: the preregistered demo (adds route and the controls shuffled_V, within_V,
    energy_V). `--task math`: the maths organism trained honestly (strict verifier, arithmetic curriculum)
    with the `math-demo` preset, arm none; report.md adds held-out accuracy against step (eval.png)."""

    task: Literal["code", "math"] = "code"
    """code: the loophole demo; math: honest GRPO on arithmetic, held-out accuracy against step"""
    arms: Literal["quick", "all"] = "quick"
    """quick: none, erase, random_V, gt_reward (DEMO_ARMS); all: the preregistered demo's 8 arms
    (DEMO_ARMS_ALL: adds route, shuffled_V, within_V, energy_V)"""
    seeds: int = 1
    """seeds 0 .. N-1 per arm: 1 is a demonstration, not evidence; 3 is the fewest whose paired t-interval is
    of use (docs/preregistration.md, "Statistics")"""
    out: str = ""
    """sweep directory (empty = runs/demo-<time>)"""
    jobs: int = 2
    """runs trained at once (each in its own process, one torch thread each: 2 fills a 2-core machine)"""


# set per run by the sweep (--arms, --seeds, --out), so refused as base-config options
_FORBIDDEN = ("--proj.arm", "--proj.control", "--monitor.kind", "--monitor.intervention", "--run.dir",
              "--run.seed", "--run.resume")


def main(argv: list[str]) -> int:
    """`projected-grpo experiment`: see ExperimentOpts."""
    base, opts = presets.parse(argv, "projected-grpo experiment", ExperimentOpts, forbid=_FORBIDDEN)
    if opts.seeds < 1 or opts.jobs < 0:
        raise UserError(f"--seeds {opts.seeds}, --jobs {opts.jobs}: need seeds >= 1 and jobs >= 0")
    if opts.backend not in launch.BACKENDS:
        raise UserError(f"--backend {opts.backend!r}: choose one of {list(launch.BACKENDS)}")
    arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
    plan(base, arms, range(opts.seeds), pathlib.Path("."))  # validate arms before any work
    if opts.lomo:
        lomo_known_modes(base, opts.lomo)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = opts.out or f"runs/exp-{opts.preset}{'-lomo-' + opts.lomo if opts.lomo else ''}-{stamp}"
    command = shlex.join(["projected-grpo", "experiment", *argv, *([] if opts.out else ["--out", out])])
    print(sweep(base, arms, list(range(opts.seeds)), out, preset=opts.preset, command=command,
                lomo=opts.lomo, jobs=opts.jobs, backend=opts.backend, ray_address=opts.ray_address))
    return 0


def demo_main(argv: list[str]) -> int:
    """`projected-grpo demo` (what `make demo` runs): see DemoOpts. The code demo prints summary.text (the
    deployed rates, one verdict line, the paths); report.md holds every verdict in full."""
    import tyro

    opts = tyro.cli(DemoOpts, args=argv, prog="projected-grpo demo")
    if opts.seeds < 1 or opts.jobs < 1:
        raise UserError(f"--seeds {opts.seeds}, --jobs {opts.jobs}: need at least 1 each")
    preset, arm_sets = DEMO_TASKS[opts.task]
    arms, seeds = arm_sets[opts.arms], list(range(opts.seeds))
    out = opts.out or f"runs/demo-{'' if opts.task == 'code' else 'math-'}{time.strftime('%Y%m%d-%H%M%S')}"
    command = shlex.join(["projected-grpo", "demo", *(["--task", opts.task] if opts.task != "code" else []),
                          "--arms", opts.arms, "--seeds", str(opts.seeds), "--jobs", str(opts.jobs),
                          "--out", out])
    printed = sweep(presets.PRESETS[preset], arms, seeds, out, preset=preset, command=command,
                    title=f"{preset} preset: {', '.join(arms)} x {opts.seeds} seed(s)", jobs=opts.jobs)
    if opts.task != "code":
        print(printed)
        return 0
    out = pathlib.Path(out)
    runs = {a: [r.dir for r in plan(presets.PRESETS[preset], [a], seeds, out)] for a in arms}
    print(summary.text(tables.tables(runs), out / "report.md", out / "curves.png"))
    return 0
