"""Experiment runner (SPEC §1.8): arms × seeds sweeps over one base Config, leave-one-mode-out, `demo`.

A sweep is one run directory per (arm, seed) under the sweep directory, each written by `train.train`
exactly as `projected-grpo train` writes it. Runs go one after another: on a 2-core machine the
sandbox pool of the running job already uses both. Inputs shared by all runs are built once: the
model (the organism's cache), the teacher pool (`DIR/pool.jsonl`, template rows graded once) and
V_hack (extracted by the first run that needs it into the training loop's cache, keyed by model, pairs
and settings, so later runs and later sweeps load it). Rerunning the same command continues a sweep:
finished runs (summary.json) are skipped after checking their config, interrupted ones resume from
their last checkpoint. Aggregation, verdicts, plot and report.md live in report.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.run import metrics
from projected_grpo.study import report

# arm -> config changes (sections of config.replace). The negative controls erase with a control V
# (direction.CONTROLS) so any effect they have is the projection's, not the direction's.
ARMS: dict[str, dict[str, dict]] = {
    "none": {"proj": {"arm": "none", "control": "none"}},
    "erase": {"proj": {"arm": "erase", "control": "none"}},
    "route": {"proj": {"arm": "route", "control": "none"}},
    "random_V": {"proj": {"arm": "erase", "control": "random"}},
    "shuffled_V": {"proj": {"arm": "erase", "control": "shuffled"}},
    "nonhack_V": {"proj": {"arm": "erase", "control": "nonhack"}},
    # benchmark baseline that uses ground truth (never a projection arm's reward): an exploit costs 2.0,
    # more than the seed shape's whole 1.25 for a hack, so hacking pays less than failing honestly
    "gt_penalty": {"proj": {"arm": "none", "control": "none"}, "env": {"hack_penalty": 2.0}},
}
DEMO_ARMS: tuple[str, ...] = ("none", "erase", "route")
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


def describe_arm(arm: str) -> str:
    """'proj.arm=erase, proj.control=random' for report.md."""
    return ", ".join(f"{s}.{k}={v}" for s, kw in ARMS[arm].items() for k, v in kw.items())


def plan(base: C.Config, arms: Sequence[str], seeds: Sequence[int], out: pathlib.Path) -> list[Run]:
    """One Run per (arm, seed): `ARMS[arm]` on top of `base`, run dir `out/<arm>-s<seed>`."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"arms {list(arms)}: unknown {unknown}; known: {list(ARMS)}")
    if len(set(arms)) != len(arms) or len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"arms {list(arms)} and seeds {list(seeds)} must be non-empty and without repeats")
    controls = {ARMS[a]["proj"]["control"] for a in arms}
    if base.proj.v_path and len(controls) > 1:
        raise ValueError(f"proj.v_path={base.proj.v_path!r} is one file, but arms {list(arms)} need V_hack "
                         f"with controls {sorted(controls)}; drop --proj.v-path (cached per control)")
    runs = []
    for arm in arms:
        for seed in seeds:
            sections = {s: dict(kw) for s, kw in ARMS[arm].items()}
            sections["run"] = {"seed": seed, "dir": str(out / f"{arm}-s{seed}"), "resume": False}
            runs.append(Run(arm, seed, C.replace(base, **sections)))
    return runs


# --- shared inputs: model, teacher pool, leave-one-mode-out pairs -------------------------------------------

def prepare_model(cfg: C.Config, log: Log):
    """The tokenizer, through train.load_model: so the organism is built (or found) in its cache now, as
    a visible stage, by the same code path every run then loads it with."""
    from projected_grpo.run.train import load_model

    log(f"model: source={cfg.model.source} {cfg.model.path}".rstrip())
    return load_model(cfg.model, cfg.run.seed, tokenizer_only=True)[1]


def build_pool(cfg: C.Config, tok, problems: Sequence, path: pathlib.Path, log: Log) -> None:
    """Template teacher pool over `problems` (what train.train would build in each run dir), graded once;
    an existing file is reused (load_pool checks it against the tokenizer when each run starts)."""
    if path.exists():
        log(f"teacher pool: reusing {path}")
        return
    from projected_grpo.envs.coding.grading import Grader
    from projected_grpo.envs.coding.sandbox import SandboxPool
    from projected_grpo.run.pool import build_report, template_rows, write_pool

    with SandboxPool(n_workers=cfg.env.workers or None) as sandbox:
        grader = Grader(sandbox, reward_shape=cfg.env.reward_shape, timeout_s=cfg.env.timeout_s)
        rows = template_rows(problems, tok, grader, n_hack=cfg.pool.n_hack, n_clean=cfg.pool.n_clean,
                             n_buggy=cfg.pool.n_buggy)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_pool(path, rows)
    log(f"teacher pool: {len(rows)} rows -> {path}\n{build_report(rows)}")


def lomo_known_modes(base: C.Config, mode: str) -> tuple[str, ...]:
    """The modes V_hack may learn from when `mode` is held out; raises before any work when the
    leave-one-mode-out test cannot run."""
    from projected_grpo.envs.coding.problems import MODES

    if mode not in MODES:
        raise ValueError(f"--lomo {mode!r} is not a loophole mode; known: {list(MODES)}")
    known = tuple(m for m in (base.env.modes or MODES) if m != mode)
    if not known:
        raise ValueError(f"--lomo {mode}: env.modes={list(base.env.modes)} leaves no other mode for V_hack")
    return known


def lomo_base(base: C.Config, tok, mode: str, out: pathlib.Path, log: Log) -> tuple[C.Config, list[str]]:
    """Leave-one-mode-out: (config training on `mode` only with V_hack from pairs of the other modes,
    report notes).

    Pairs are mined from the shared template pool with the detectors of the known modes only
    (pairs.pairs_from_pool: the weak-detector rule, never the held-out mode's labels) and written to
    `out/lomo_pairs.jsonl`, which the run extracts V_hack from (ProjCfg.pairs)."""
    from projected_grpo.run.pool import load_pool
    from projected_grpo.run.train import load_problems

    known = lomo_known_modes(base, mode)
    held = load_problems(dataclasses.replace(base.env, modes=(mode,)))
    others = load_problems(dataclasses.replace(base.env, modes=known))
    pool_path = pathlib.Path(base.pool.path or out / "pool.jsonl")
    if not base.pool.path:
        build_pool(base, tok, held + others, pool_path, log)
    rows = load_pool(pool_path, tok, held + others).rows  # schema and tokenizer-drift checked
    pairs_path = out / LOMO_PAIRS_FILE
    stats = write_mined_pairs(rows, known, base.proj.pairs_per_problem, pairs_path)
    log(f"leave-one-mode-out: train on {mode} ({len(held)} problems); V_hack from {stats['n_pairs']} pairs "
        f"of {list(known)} -> {pairs_path} ({json.dumps(stats['pairs_per_mode'])})")
    cfg = C.replace(base, env={"modes": (mode,)}, proj={"pairs": str(pairs_path)},
                    pool={"path": str(pool_path)})
    notes = [f"leave-one-mode-out: trained and evaluated on `{mode}` only; V_hack extracted from "
             f"{stats['n_pairs']} pool pairs of {', '.join(known)} (their detector E), none of `{mode}`"]
    return cfg, notes


def write_mined_pairs(rows: Sequence[dict], known: Sequence[str], per_problem: int,
                      path: pathlib.Path) -> dict:
    """Mine (hack, clean) pairs from graded pool rows with the detector E of the `known` modes only and
    write them as a pairs JSONL file (pairs.load_pairs_file reads it back, stored ids kept); returns the
    mining stats of pairs.pairs_from_pool."""
    from projected_grpo.hack.pairs import pairs_from_pool

    mined, stats = pairs_from_pool(rows, known, ("E",), per_problem)
    if not mined:
        raise ValueError(f"no (hack, clean) pairs mined for modes {list(known)} ({json.dumps(stats)}); the "
                         "pool needs hack and clean rows of those modes (pool.n_hack, pool.n_clean >= 1)")
    records = [{"prompt": p.prompt, "hack": p.hack, "clean": p.clean, "prompt_ids": list(p.prompt_ids),
                "hack_ids": list(p.hack_ids), "clean_ids": list(p.clean_ids), "source": p.source}
               for p in mined]
    store.write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
    return stats


# --- running ------------------------------------------------------------------------------------------------

def _check_existing(runs: Sequence[Run]) -> None:
    """A run directory already there (finished or interrupted) is reused only when it was trained with
    the planned config; checked for every run before the sweep writes or trains anything."""
    for run in runs:
        if not (run.dir / "config.json").is_file():
            continue
        done = C.Config.from_json(str(run.dir / "config.json"))
        diff = C.diff(done, run.cfg, ignore=("run.resume",))
        if diff:
            state = "finished" if (run.dir / metrics.SUMMARY_FILE).exists() else "started"
            raise ValueError(f"{run.dir} {state} with another config than this sweep plans ({diff}); "
                             "use another --out or remove that run directory")


def run_all(runs: Sequence[Run], log: Log) -> dict[str, int]:
    """Train each run in turn; skip finished ones, resume interrupted ones. Returns counts by action."""
    from projected_grpo.run.train import train

    counts = {"trained": 0, "resumed": 0, "skipped": 0}
    for i, run in enumerate(runs, 1):
        head = f"[run {i}/{len(runs)}] arm {run.arm}, seed {run.seed} -> {run.dir}"
        if (run.dir / metrics.SUMMARY_FILE).exists():  # its config was checked by _check_existing
            log(f"{head}: skipped, {metrics.SUMMARY_FILE} exists (finished earlier)")
            counts["skipped"] += 1
            continue
        resume = (run.dir / metrics.METRICS_FILE).exists()
        log(f"{head}: {'resuming from its last checkpoint' if resume else 'training'}")
        train(C.replace(run.cfg, run={"resume": resume}))
        counts["resumed" if resume else "trained"] += 1
    return counts


def sweep(base: C.Config, arms: Sequence[str], seeds: Sequence[int], out: str | pathlib.Path, *, preset: str,
          command: str, lomo: str = "", title: str = "", log: Log = _stderr) -> str:
    """Run the sweep end to end and write its report; returns the printed results (table + verdicts)."""
    from projected_grpo.run.train import load_problems

    t0 = time.perf_counter()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = lambda i, what: log(f"[stage {i}/4 at {time.perf_counter() - t0:.0f} s] {what}")
    stage(1, "model")
    tok = prepare_model(base, log)
    stage(2, "teacher pool" + (f" and pairs without mode {lomo} (leave-one-mode-out)" if lomo else ""))
    user_base, notes = base, []
    if lomo:
        base, notes = lomo_base(base, tok, lomo, out, log)
    elif not base.pool.path:
        build_pool(base, tok, load_problems(base.env), out / "pool.jsonl", log)
        base = C.replace(base, pool={"path": str(out / "pool.jsonl")})
    runs = plan(base, arms, seeds, out)
    _check_existing(runs)
    store.write_json_atomic(out / "sweep.json", {"command": command, "preset": preset, "arms": list(arms),
                                                   "seeds": list(seeds), "lomo": lomo,
                                                   "base": base.to_dict()})
    stage(3, f"{len(runs)} runs ({len(arms)} arms x {len(seeds)} seeds); the first run needing a V_hack "
             "extracts it into the cache (no output until done), the others load it")
    counts = run_all(runs, log)
    stage(4, "report")
    by_arm = {a: [r.dir for r in runs if r.arm == a] for a in arms}
    notes.append(f"this invocation: {counts['trained']} runs trained, {counts['resumed']} resumed, "
                 f"{counts['skipped']} skipped as already finished")
    _, printed = report.write_report(
        out, by_arm, title=title or f"{preset}: {', '.join(arms)} x {len(seeds)} seed(s)" + (
            f", leave out {lomo}" if lomo else ""),
        config_diff=C.diff(presets.PRESETS[preset], user_base),
        arm_overrides={a: describe_arm(a) for a in arms},
        command=command, elapsed_s=time.perf_counter() - t0, notes=notes)
    return printed


# --- CLI: projected-grpo experiment / demo ------------------------------------------------------------------

@dataclass(frozen=True)
class ExperimentOpts:
    """Sweep arms x seeds over a preset; further `--section.field VALUE` options change the base config
    (as for `projected-grpo train`). Rerun the printed command to continue an interrupted sweep."""

    preset: str = "smoke"
    """base preset (presets.PRESETS)"""
    arms: str = "none,erase,route"
    """comma-separated arms (experiment.ARMS): none, erase, route, random_V, shuffled_V, nonhack_V,
    gt_penalty"""
    seeds: int = 1
    """seeds 0 .. N-1 per arm"""
    out: str = ""
    """sweep directory (empty = runs/exp-<preset>-<time>)"""
    lomo: str = ""
    """leave-one-mode-out: train on this loophole mode with V_hack from the other modes' pairs"""


@dataclass(frozen=True)
class DemoOpts:
    """The embedded demo: organism, teacher pool, V_hack, then arms none, erase, route with the `demo`
    preset; prints the results table and writes report.md and curves.png under --out."""

    out: str = ""
    """sweep directory (empty = runs/demo-<time>)"""
    seeds: int = 1
    """seeds 0 .. N-1 per arm"""


# set per run by the sweep (--arms, --seeds, --out), so refused as base-config options
_FORBIDDEN = ("--arm", "--run-dir", "--resume", "--proj.arm", "--proj.control", "--run.dir", "--run.seed",
              "--run.resume")


def main(argv: list[str]) -> int:
    """`projected-grpo experiment`: see ExperimentOpts. Exit 2 on a bad option."""
    import tyro

    opts, rest = tyro.cli(ExperimentOpts, args=argv, prog="projected-grpo experiment",
                          return_unknown_args=True)
    bad = [a for a in rest if a.partition("=")[0] in _FORBIDDEN]
    try:
        if bad:
            raise ValueError(f"{bad}: the sweep sets arm, control, seed, run dir and resume itself "
                             "(use --arms, --seeds, --out)")
        if opts.seeds < 1:
            raise ValueError(f"--seeds {opts.seeds}: need at least 1")
        if opts.preset not in presets.PRESETS:
            raise ValueError(f"--preset {opts.preset!r} is not one of {list(presets.PRESETS)}")
        base = presets.from_argv(["--preset", opts.preset, *rest])
        arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
        plan(base, arms, range(opts.seeds), pathlib.Path("."))  # validate arms before any work
        if opts.lomo:
            lomo_known_modes(base, opts.lomo)
    except ValueError as e:
        print(f"projected-grpo experiment: {e}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = opts.out or f"runs/exp-{opts.preset}{'-lomo-' + opts.lomo if opts.lomo else ''}-{stamp}"
    lomo = ["--lomo", opts.lomo] if opts.lomo else []
    command = shlex.join(["projected-grpo", "experiment", "--preset", opts.preset, "--arms", ",".join(arms),
                          "--seeds", str(opts.seeds), "--out", out, *lomo, *rest])
    print(sweep(base, arms, list(range(opts.seeds)), out, preset=opts.preset, command=command,
                lomo=opts.lomo))
    return 0


def demo_main(argv: list[str]) -> int:
    """`projected-grpo demo` (what `make demo` runs): see DemoOpts."""
    import tyro

    opts = tyro.cli(DemoOpts, args=argv, prog="projected-grpo demo")
    if opts.seeds < 1:
        print(f"projected-grpo demo: --seeds {opts.seeds}: need at least 1", file=sys.stderr)
        return 2
    out = opts.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    command = shlex.join(["projected-grpo", "demo", "--out", out, "--seeds", str(opts.seeds)])
    print(sweep(presets.PRESETS["demo"], DEMO_ARMS, list(range(opts.seeds)), out, preset="demo",
                command=command, title=f"demo preset: {', '.join(DEMO_ARMS)} x {opts.seeds} seed(s)"))
    return 0
