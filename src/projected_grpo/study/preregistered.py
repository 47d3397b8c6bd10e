"""The whole preregistered study in one command: every arm, control, no-pool and leave-one-mode-out fold.

`projected-grpo study --preset demo --seeds 3` plans its parts under --out: `main/`, the study as
preregistered (docs/preregistration.md; PREREGISTERED_ARMS: none, erase, route; the negative controls
random_V, shuffled_V (orientation), nonhack_V, within_V (label), energy_V (gradient energy); no_pool, pure
student GRPO, and erase_no_pool; and gt_reward, the positive control, the yardstick of "capability kept";
`--arms all` adds every other arm of arms.ARMS), one `lomo-<mode>/` per loophole mode the base trains on
(experiment.lomo_base: that mode held out of the teacher pool and of V_hack's pairs; arms --lomo-arms, default
erase beside its random-V twin), and `interventions/`, the intervention bench (bench.py,
docs/interventions.md; --interventions: every `<intervention>:<monitor>` arm, inoculation, erase_bounded, the
random-V twins of those V acts in), on main's base, borrowing every arm main trains too (`none` and
`gt_reward` by default). Every part is planned as `experiment` plans a sweep (experiment.plan_sweep), then ALL
runs go to one launch.run_all, so --jobs or --backend ray keep every core or node busy across parts. No run
known to repeat another is trained: an arm whose runs would have the config of an earlier arm's (no_pool on a
base without teacher rows is none, erase_no_pool is erase) gets that arm's runs, and a fold without teacher
rows in training borrows main's baselines `none` and `gt_reward` (holding a mode out then changes only V_hack
and its pairs, which they do not use). Finished runs are skipped: rerunning the command resumes the study.
Then each part gets its own report (report.py) and `report.md` at the top links them, with one table of every
arm and fold and the bench's table. Not here: training, aggregation.
"""

from __future__ import annotations

import pathlib
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.errors import UserError
from projected_grpo.run import metrics
from projected_grpo.study import arms as arms_table
from projected_grpo.study import bench, evasion, experiment, follow_up, launch, report, tables
from projected_grpo.study import verdict_text as VT

# the preregistration's three arms, its three negative controls and the two that can fail where they could
# not (within_V: the label, energy_V: the gradient energy; docs/preregistration.md "Controls"), no_pool and
# erase_no_pool (F5: imitation only?), and the positive control gt_reward
PREREGISTERED_ARMS: tuple[str, ...] = ("none", "erase", "route", "random_V", "shuffled_V", "nonhack_V",
                                       "within_V", "energy_V", "no_pool", "erase_no_pool", "gt_reward")
# each fold: the preregistered projection arm beside its random-V twin
LOMO_ARMS: tuple[str, ...] = ("erase", "random_V")
# what a fold's verdicts read besides its arms: H1's baseline and the yardstick (no projection, no pairs)
BASELINES: tuple[str, ...] = ("none", "gt_reward")
# the intervention bench's part (bench.py, docs/interventions.md): its default arms
INTERVENTIONS = "interventions"
MAIN = "main"
BENCH_ARMS: tuple[str, ...] = bench.bench_arms()


@dataclass(frozen=True)
class Part:
    """One sweep of the study: its directory name, the held-out mode ("" for main), the arms it trains and
    those whose runs it borrows from main (a fold's baselines, when the base has no teacher rows in
    training)."""

    name: str
    lomo: str
    arms: tuple[str, ...]
    borrowed: tuple[str, ...] = ()


def parts(base: C.Config, lomo_arms: Sequence[str], lomo_modes: Sequence[str] | None = None,
          arms: Sequence[str] = PREREGISTERED_ARMS, bench: Sequence[str] = ()) -> list[Part]:
    """main (`arms`) and one leave-one-mode-out part per mode (lomo_modes, default: every loophole mode the
    base trains on; none for an environment without loophole modes). A fold's baselines (BASELINES: H1's
    `none`, the yardstick `gt_reward`) are borrowed from main when the base has no teacher rows in training;
    with teacher rows the fold's pool differs, so it trains its own `none`. Raises before any work when a
    part cannot run."""
    out = [Part(MAIN, "", tuple(arms))]
    if lomo_modes is None:
        from projected_grpo.envs.coding.problems import MODES

        lomo_modes = (base.env.modes or MODES) if base.env.name == "coding" else ()
    # no teacher rows in training: a fold changes only V_hack and its pairs, which the baselines never read
    borrow = () if base.rollout.G_t else tuple(a for a in BASELINES if a in arms and a not in lomo_arms)
    fold_arms = tuple(lomo_arms) if "none" in (*borrow, *lomo_arms) else ("none", *lomo_arms)
    for mode in lomo_modes:
        experiment.lomo_known_modes(base, mode)
        out.append(Part(f"lomo-{mode}", mode, fold_arms, borrow))
    if bench:
        out.append(bench_part(arms, bench))
    for part in out:  # unknown arms: refused now
        if part.arms:
            experiment.plan(base, part.arms, [0], pathlib.Path("."))
    return out


def bench_part(main_arms: Sequence[str], bench_arms: Sequence[str]) -> Part:
    """The intervention bench (docs/interventions.md) as a part: `bench_arms` beside the baselines `none` and
    `gt_reward`, on main's base config, so every arm main trains too is borrowed from it (not trained
    twice), the baselines included when main has them."""
    wanted = [*(a for a in BASELINES if a not in bench_arms), *bench_arms]
    borrowed = tuple(a for a in wanted if a in main_arms)
    return Part(INTERVENTIONS, "", tuple(a for a in wanted if a not in borrowed), borrowed)


def same_runs(runs: Sequence[experiment.Run]) -> dict[str, str]:
    """arm -> the earlier arm whose runs have its configs seed for seed (run.dir aside): trained once."""
    by_arm: dict[str, list] = {}
    for r in runs:
        by_arm.setdefault(r.arm, []).append(r)
    same: dict[str, str] = {}
    for i, (arm, mine) in enumerate(by_arm.items()):
        for other, theirs in list(by_arm.items())[:i]:
            if other not in same and all(not C.diff(a.cfg, b.cfg, ignore=("run.dir",))
                                         for a, b in zip(mine, theirs)):
                same[arm] = other
                break
    return same


def trained_runs(base: C.Config, todo: Sequence[Part], seeds: Sequence[int]) -> int:
    """How many runs the study trains: every part's arms x seeds, less the arms trained once (same_runs)."""
    plan = lambda p: experiment.plan(base, p.arms, seeds, pathlib.Path(p.name))
    return sum((len(p.arms) - len(same_runs(plan(p)))) * len(seeds) for p in todo if p.arms)


def study(base: C.Config, seeds: Sequence[int], out: str | pathlib.Path, *, preset: str, command: str,
          arms: Sequence[str] = PREREGISTERED_ARMS, lomo_arms: Sequence[str] = LOMO_ARMS,
          lomo_modes: Sequence[str] | None = None, bench_arms: Sequence[str] = (), jobs: int = 0,
          backend: str = "local", ray_address: str = "", report_only: bool = False,
          log=experiment._stderr) -> str:
    """Plan every part, train every run not finished yet, write each part's report and the study's;
    returns the printed summary (the table of every arm and fold, the verdicts). report_only: train
    nothing; the reports hold the runs finished so far (finished: summary.json written), each part saying
    which are missing (a study that takes days can be read while it trains)."""
    t0 = time.perf_counter()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    todo = parts(base, lomo_arms, lomo_modes, arms, bench_arms)
    tok = experiment.prepare_model(base, log)
    planned = []  # (part, runs to train, arm -> its run dirs, notes)
    main_dirs: dict[str, list[pathlib.Path]] = {}
    main_base = base
    for part in todo:
        log(f"[study] part {part.name}: {len(part.arms)} arms x {len(seeds)} seeds"
            + (f", {', '.join(part.borrowed)} borrowed from main" if part.borrowed else ""))
        # the bench plans on main's base, its teacher pool included (its arms are main's kin); a part
        # whose arms are all borrowed (`--lomo-arms ''` where `none` is main's) plans nothing
        (out / part.name).mkdir(parents=True, exist_ok=True)
        part_base, lomo = (main_base, "") if part.name == INTERVENTIONS else (base, part.lomo)
        part_base, runs, notes = (experiment.plan_sweep(part_base, tok, part.arms, seeds, out / part.name,
                                                        lomo, log) if part.arms else (part_base, [], []))
        same = same_runs(runs)
        runs = [r for r in runs if r.arm not in same]
        dirs = {a: [r.dir for r in runs if r.arm == same.get(a, a)] for a in part.arms}
        notes = [*notes, *(f"`{a}` has `{b}`'s config on this base, so its runs are `{b}`'s (not trained "
                           "twice)" for a, b in same.items())]
        if part.borrowed:
            dirs = {**{a: main_dirs[a] for a in part.borrowed}, **dirs}
            named = ", ".join(f"`{a}`" for a in part.borrowed)
            notes.append(f"{named}: main's runs (the same base config)" if not part.lomo else
                         f"{named}: main's runs. With no teacher rows in training (rollout.mix 0) holding a "
                         "mode out changes only V_hack and its pairs, which they do not use (their proj/* "
                         "diagnostics are against main's V_hack)")
        if part.name == "main":
            main_dirs, main_base = dirs, part_base
        store.write_json_atomic(out / part.name / "sweep.json", {
            "command": command, "preset": preset, "arms": list(part.arms), "borrowed": list(part.borrowed),
            "same": same, "seeds": list(seeds), "lomo": part.lomo, "base": part_base.to_dict()})
        planned.append((part, runs, dirs, notes))
    all_runs = [r for _, runs, _, _ in planned for r in runs]
    log(f"[study] {len(all_runs)} runs in {len(todo)} parts at {time.perf_counter() - t0:.0f} s")
    if report_only:
        planned, counts = finished_only(planned), {"trained": 0, "resumed": 0, "skipped": 0}
        if not planned:
            raise UserError(f"{out}: no part has a finished run of `none` and another arm yet; nothing to "
                            "report (a run is finished once its summary.json is written)")
        return write_study_report(out, planned, base, preset=preset, command=command, counts=counts,
                                  elapsed_s=time.perf_counter() - t0, partial=True)
    counts = launch.run_all(all_runs, None, log, jobs=jobs, backend=backend, ray_address=ray_address)
    return write_study_report(out, planned, base, preset=preset, command=command, counts=counts,
                              elapsed_s=time.perf_counter() - t0)


def finished_only(planned: list) -> list:
    """`planned` with each arm's run dirs cut to the finished ones (summary.json written), the arms with none
    dropped, a note naming what is missing, and the parts left without `none` and one other arm dropped."""
    out = []
    for part, runs, dirs, notes in planned:
        finished = lambda d: (pathlib.Path(d) / metrics.SUMMARY_FILE).is_file()
        done = {a: [d for d in ds if finished(d)] for a, ds in dirs.items()}
        missing = [f"{a} (missing {len(ds) - len(done[a])} of {len(ds)})" for a, ds in dirs.items()
                   if len(done[a]) < len(ds)]
        done = {a: ds for a, ds in done.items() if ds}
        if "none" not in done or len(done) < 2:
            continue
        note = (f"PARTIAL: written with `--report-only` while runs were still missing: {', '.join(missing)}; "
                "rerun the study's command to train them" if missing else "every planned run has finished")
        out.append((part, runs, done, [note, *notes]))
    return out


def _follow_up(main: tables.Runs, bench_runs: tables.Runs, command: str) -> list[str]:
    """follow_up's section of the bench report. The choice reads the main part's arms and the bench's on the
    seeds every arm ran (as the rule was written: on the first seeds, before any arm got more) and adds each
    chosen arm's random-V twin; the goal reads every seed. Each arm's contrasts against its controls are its
    own report's (main: every control twin, Holm over the main report's family; bench: the random-V twin,
    Holm over the bench's). `command`: the study's, made into the one that trains the chosen seeds."""
    arms = [a for a in bench_runs if a not in BASELINES]

    def read(keep=lambda d: True):
        """(end rates, bench verdicts, arm -> contrasts against its controls, arm -> its random-V twin)."""
        m = tables.tables({a: [d for d in ds if keep(d)] for a, ds in main.items()}) if main else None
        b = tables.tables({a: [d for d in ds if keep(d)] for a, ds in bench_runs.items()})
        controls: dict[str, list] = {}
        twin: dict[str, str] = {}
        if m is not None:  # a main arm's random-V twin: its proj.control=random twin (erase's is random_V)
            fam = VT.family(m)
            for arm, by_kind in VT.twins(m).items():
                controls[arm] = [fam[(arm, t)] for t in by_kind.values() if (arm, t) in fam]
                if "random" in by_kind:
                    twin[arm] = by_kind["random"]
        for arm, c in bench.twin_contrasts(b, arms).items():
            controls.setdefault(arm, []).append(c)
            twin[arm] = c.other
        return {**(m.end if m else {}), **b.end}, bench.verdicts(b, arms), controls, twin

    seeds = [{tables.run_seed(d) for d in ds} for ds in (*main.values(), *bench_runs.values())]
    common = sorted(set.intersection(*seeds))
    if not common:
        return ["- No seed that every arm has finished: nothing to choose on yet."]
    end, verdicts, controls, twin = read(lambda d: tables.run_seed(d) in common)
    choice = follow_up.choose(end, verdicts, twin)
    if any(s != set(common) for s in seeds):  # some arms ran more seeds: the goal reads all of them
        end, _, controls, _ = read()
    g = None if choice.best is None else follow_up.goal(choice.best, end, controls.get(choice.best, ()))
    return follow_up.lines(choice, g, common, follow_up.command(command, choice, main))


def write_study_report(out: pathlib.Path, planned: list, base: C.Config, *, preset: str, command: str,
                       counts: dict[str, int], elapsed_s: float, partial: bool = False) -> str:
    """Each part's report.md (report.write_report), then out/report.md: links to the parts, one table of every
    arm and fold, the verdicts per part (each against its own `none`). The main part's F6 (capability lost on
    the held-out mode) reads every fold; a fold's reads its own mode. Returns the printed summary."""
    diff = C.diff(presets.PRESETS[preset], base)
    rows: dict[str, list] = {}
    verdicts = []
    folds = {part.lomo: tables.aggregate_modes(by_arm) for part, _, by_arm, _ in planned if part.lomo}
    for part, _, by_arm, notes in planned:
        n_seeds = max(len(d) for d in by_arm.values())
        title = (f"{preset} study, part {part.name}: {', '.join(part.arms)} x {n_seeds} seed(s)"
                 + (" (partial)" if partial else ""))
        part_folds = folds if not part.lomo else {}
        report.write_report(out / part.name, by_arm, title=title, config_diff=diff,
                            arm_overrides={a: arms_table.describe_arm(a) for a in by_arm}, command=command,
                            elapsed_s=elapsed_s, notes=notes, held_out=part.lomo, folds=part_folds)
        label = (lambda a: a) if not part.lomo else (lambda a, m=part.lomo: f"{a} (without {m})")
        rows |= {label(a): dirs for a, dirs in by_arm.items() if a not in part.borrowed}
        verdicts += [f"### {part.name}", ""]
        t = tables.tables(by_arm)
        lines = VT.lines(t, part_folds if not part.lomo else {part.lomo: t.modes})
        verdicts += [f"- {v}" if not v.startswith("  ") else f"    - {v.strip()}" for v in lines]
        verdicts.append("")
    bench_md = []
    main = next((by_arm for part, _, by_arm, _ in planned if part.name == MAIN), {})
    for part, _, by_arm, _ in planned:
        if part.name == INTERVENTIONS:
            order = [*(a for a in BASELINES if a in by_arm), *(a for a in by_arm if a not in BASELINES)]
            t, arms = tables.tables(by_arm), [a for a in by_arm if a not in BASELINES]
            bench_md = ["## The intervention bench (docs/interventions.md; the verdict is ours, written down "
                        "before the runs)", "", bench.table(t, arms), "",
                        "## Is the monitor evaded? (docs/interventions.md; descriptive, no verdict)", "",
                        evasion.table({a: [tables.read_run(d)[1] for d in by_arm[a]] for a in order}), "",
                        "## More seeds, and the goal (docs/interventions.md; a rule written before the runs)",
                        "", *_follow_up(main, by_arm, command), ""]
            store.write_text_atomic(out / part.name / "bench.md", "\n".join(bench_md) + "\n")
    table = report.results_table(tables.aggregate(rows))
    n_runs = sum(len(runs) for _, runs, _, _ in planned)
    ran = (f"{n_runs} runs; this invocation trained {counts['trained']}, resumed {counts['resumed']}, "
           f"skipped {counts['skipped']} as finished, in {elapsed_s:.0f} s wall time.")
    if partial:
        ran = ("**Partial** (`--report-only`): the runs finished so far; each part's report names the "
               "missing ones. Rerun the command without `--report-only` to train them.")
    md = [f"# The preregistered study on the `{preset}` preset", "", "Reproduce (rerun to resume):", "",
          "```", command, "```", "", ran, "", "## Parts", ""]
    held = lambda p: f"`{p.lomo}` held out of the teacher pool and of V_hack's pairs; " if p.lomo else ""
    borrowed = lambda p: f" (borrowed from main: {', '.join(p.borrowed)})" if p.borrowed else ""
    md += [f"- [{p.name}]({p.name}/report.md): {held(p)}arms {', '.join(p.arms)}{borrowed(p)}"
           for p, _, _, _ in planned]
    md += ["", f"## Every arm and fold (mean ± SEM over seeds of each run's last-{tables.LAST}-step means)",
           "", table, "", "A fold's row `arm (without MODE)` trains on every mode with MODE held out of the "
           "teacher pool and V_hack's pairs; its curves, the held-out mode's own rates and notes are in that "
           "part's report.", "", *bench_md, "## Verdicts, per part against the part's own `none`", "",
           *VT.rules_text(), *verdicts]
    store.write_text_atomic(out / "report.md", "\n".join(md) + "\n")
    return "\n".join([table, "", *bench_md, *[v for v in verdicts if v], f"report: {out / 'report.md'}"])


# --- CLI: projected-grpo study ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class StudyOpts(presets.Base):
    """The whole preregistered study (every arm and control, no_pool, every leave-one-mode-out fold) over a
    preset, then one report; further `--section.field VALUE` options change the base config. Rerun the
    printed command to resume it."""

    seeds: int = 8
    """seeds 0 .. N-1 per arm and fold: 8, what a 15-point contrast needs at the spread seen so far
    (docs/preregistration.md, "Statistics"); each report prints what every contrast needs"""
    out: str = ""
    """study directory (empty = runs/study-<preset>-<time>)"""
    arms: str = ",".join(PREREGISTERED_ARMS)
    """comma-separated arms of the main part (`all`: every arm of arms.ARMS)"""
    lomo_arms: str = ",".join(LOMO_ARMS)
    """comma-separated arms of each leave-one-mode-out fold (`none` is added, or borrowed from main)"""
    lomo_modes: str = ""
    """comma-separated held-out modes (empty = every loophole mode the preset trains on; `none`: no
    leave-one-mode-out part)"""
    interventions: str = "all"
    """comma-separated arms of the intervention bench part (docs/interventions.md; `all`: every
    `<intervention>:<monitor>` arm, inoculation, erase_bounded and the random-V twins of those V acts in;
    empty: no bench part)"""
    jobs: int = 0
    """runs trained at once (0 = what the cores allow: cores // run.threads, or the Ray cluster's CPUs)"""
    backend: str = "local"
    """`local` (this machine) or `ray` (each run a Ray task; pip install 'projected-grpo[ray]')"""
    ray_address: str = ""
    """--backend ray: the cluster (`auto`, or ray://HOST:10001); empty = a local Ray instance"""
    report_only: bool = False
    """train nothing: write the reports from the runs finished so far, naming the missing ones (read a study
    while it trains, from another shell)"""


def main(argv: list[str]) -> int:
    """`projected-grpo study`: see StudyOpts."""
    base, opts = presets.parse(argv, "projected-grpo study", StudyOpts, forbid=experiment._FORBIDDEN)
    if opts.seeds < 1 or opts.jobs < 0 or opts.backend not in launch.BACKENDS:
        raise UserError(f"--seeds {opts.seeds}, --jobs {opts.jobs}, --backend {opts.backend!r}: need seeds "
                        f">= 1, jobs >= 0 and a backend among {list(launch.BACKENDS)}")
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    arms = list(arms_table.ARMS) if opts.arms.strip() == "all" else split(opts.arms)
    lomo_arms = split(opts.lomo_arms)
    modes = [] if opts.lomo_modes.strip() == follow_up.NO_FOLDS else (split(opts.lomo_modes) or None)
    bench_arms = list(BENCH_ARMS) if opts.interventions.strip() == "all" else split(opts.interventions)
    parts(base, lomo_arms, modes, arms, bench_arms)  # refuse bad arms / modes before any work
    out = opts.out or f"runs/study-{opts.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    resume = [a for a in argv if a not in ("--report-only", "--report-only=True")]
    command = shlex.join(["projected-grpo", "study", *resume, *([] if opts.out else ["--out", out])])
    print(study(base, list(range(opts.seeds)), out, preset=opts.preset, command=command, arms=arms,
                lomo_arms=lomo_arms, lomo_modes=modes, bench_arms=bench_arms, jobs=opts.jobs,
                backend=opts.backend, ray_address=opts.ray_address, report_only=opts.report_only))
    return 0
