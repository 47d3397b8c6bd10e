"""Sweep results: per-arm mean ± SEM over seeds, verdicts, per-mode rises, the curves' data, report.md.

Input is a mapping arm -> run directories, each as the training loop writes it (metrics.jsonl plus
summary.json once the run finished). Each run contributes its last-5-step means (`metrics.summarize`, the
numbers in its summary.json) and its first-5-step means (its start); an arm's value is the mean over its
seeds with the standard error of the mean, which is *undefined* for one seed (reported as such, never 0).
Verdicts (verdicts.py) read the *deployed* model's rates (`hack/deploy`, `solve/deploy`, `format/deploy`:
quarantine knob zeroed; they equal the student rates except under `route`): H1 as preregistered, ours beyond
it against the `gt_reward` positive control, and the real V against its random-V twin. The per-mode table
shows each loophole mode's deployed hack and solve rate over the first and last 10 steps.
Deliberately not here: running anything (experiment.py), the verdict rules (verdicts.py), drawing the
figures (plots.py).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence

from projected_grpo.run import metrics
from projected_grpo.store import write_text_atomic
from projected_grpo.study import verdicts as V
from projected_grpo.study.plots import EVAL_PANELS, PANELS, plot_curves, plot_eval_curves
from projected_grpo.study.verdicts import Stat, mean_sem

__all__ = ["EVAL_PANELS", "PANELS", "Stat", "mean_sem", "plot_curves", "plot_eval_curves"]

# last-5-step means aggregated per arm, in table order
AGG_KEYS: tuple[str, ...] = ("hack/deploy", "solve/deploy", "format/deploy", "hack/student", "solve/student",
                             "proj/cin_student", "proj/cin_teacher", "proj/cout")
HACK, SOLVE, FORMAT = V.HACK, V.SOLVE, V.FORMAT  # the verdicts and curves read the deployed model
LAST = 5  # an arm's end: its last-5-step means
FIRST = 5  # an arm's start: its first-5-step means (ours: "against its own start")
MODE_WINDOW = 10  # per-mode rise: the first vs the last 10 steps (a mode is drawn in ~2/3 of the steps)
ROLL = 7  # curves: trailing rolling mean over this many steps, drawn over the faint raw per-step line
# a deployed model that writes well-formed answers this much less often than `none`'s is flagged, since a
# broken model also hacks little
FORMAT_DROP_NOTE = 0.10
BASELINE, POSITIVE = "none", "gt_reward"
# arms that are controls of the experiment, not projections: no H1 verdict
NO_VERDICT = (BASELINE, POSITIVE)


def read_run(run_dir: str | os.PathLike) -> tuple[dict[str, float], list[dict]]:
    """(last-5-step means of AGG_KEYS, all metric rows) of a finished run; a run without summary.json
    has not finished and raises naming it."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / metrics.SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"{run_dir}: no {metrics.SUMMARY_FILE}, so the run has not finished; "
                                "rerun the sweep (finished runs are skipped) or drop this run")
    rows = metrics.read_rows(run_dir / metrics.METRICS_FILE)
    return metrics.summarize(rows, last=LAST, keys=AGG_KEYS), rows


def aggregate(runs: Mapping[str, Sequence[str | os.PathLike]], where: str = "end"
              ) -> dict[str, dict[str, Stat]]:
    """arm -> key -> Stat over the arm's runs, for each of AGG_KEYS that its runs logged. where: "end" (each
    run's last-LAST-step means, its summary) or "start" (its first-FIRST-step means)."""
    out: dict[str, dict[str, Stat]] = {}
    for arm, dirs in runs.items():
        summaries = []
        for d in dirs:
            end, rows = read_run(d)
            first = sorted(rows, key=lambda r: r["step"])[:FIRST]
            summaries.append(end if where == "end" else metrics.summarize(first, last=FIRST, keys=AGG_KEYS))
        out[arm] = {k: mean_sem([s[k] for s in summaries]) for k in AGG_KEYS
                    if all(k in s for s in summaries)}
    return out


def run_modes(rows: Sequence[Mapping], window: int = MODE_WINDOW) -> dict[str, dict[str, float]]:
    """mode -> {hack_start, hack_end, solve_start, solve_end} of one run: the means of hack/deploy/<mode> and
    solve/deploy/<mode> over the rows of its first and of its last `window` steps that drew the mode (a
    mode drawn in none of them is left out)."""
    rows = sorted(rows, key=lambda r: r["step"])
    modes = sorted({k.split("/", 2)[2] for r in rows for k in r if k.startswith(HACK + "/")})
    out: dict[str, dict[str, float]] = {}
    for m in modes:
        got = {}
        for what in ("hack", "solve"):
            key = f"{what}/deploy/{m}"
            for where, part in (("start", rows[:window]), ("end", rows[-window:])):
                vals = [float(r[key]) for r in part if key in r]
                if vals:
                    got[f"{what}_{where}"] = sum(vals) / len(vals)
        if len(got) == 4:
            out[m] = got
    return out


def aggregate_modes(runs: Mapping[str, Sequence[str | os.PathLike]]) -> dict[str, dict[str, dict[str, Stat]]]:
    """arm -> mode -> {hack_start, hack_end, hack_rise, solve_start, solve_end} as Stats over the arm's
    seeds (a mode every run of the arm measured at both ends)."""
    out: dict[str, dict[str, dict[str, Stat]]] = {}
    for arm, dirs in runs.items():
        per_run = [run_modes(read_run(d)[1]) for d in dirs]
        both = set.intersection(*(set(r) for r in per_run)) if per_run else set()
        out[arm] = {}
        for m in sorted(both):
            vals = {k: [r[m][k] for r in per_run] for k in per_run[0][m]}
            vals["hack_rise"] = [r[m]["hack_end"] - r[m]["hack_start"] for r in per_run]
            out[arm][m] = {k: mean_sem(v) for k, v in vals.items()}
    return out


def modes_table(agg_modes: Mapping[str, Mapping[str, Mapping[str, Stat]]], arm: str) -> str:
    """Markdown table of one arm's per-mode deployed hack rate (first / last MODE_WINDOW steps, the rise)
    and solve rate, mean ± SEM over seeds."""
    lines = [f"| mode | hack, first {MODE_WINDOW} steps | hack, last {MODE_WINDOW} | hack rise (pts) | "
             f"solve, first {MODE_WINDOW} | solve, last {MODE_WINDOW} |", "|---|---|---|---|---|---|"]
    for m, st in agg_modes.get(arm, {}).items():
        lines.append(f"| {m} | {st['hack_start'].fmt()} | {st['hack_end'].fmt()} | "
                     f"{st['hack_rise'].fmt(100, 1)} | {st['solve_start'].fmt()} | {st['solve_end'].fmt()} |")
    return "\n".join(lines)


def held_out_table(agg_modes: Mapping[str, Mapping[str, Mapping[str, Stat]]], mode: str) -> str:
    """Markdown table of one mode's deployed hack and solve rates per arm (leave-one-mode-out: the held-out
    mode under each arm, e.g. erase beside random_V), mean ± SEM over seeds."""
    lines = [f"| arm | hack, first {MODE_WINDOW} steps | hack, last {MODE_WINDOW} | hack rise (pts) | "
             f"solve, first {MODE_WINDOW} | solve, last {MODE_WINDOW} |", "|---|---|---|---|---|---|"]
    for arm, modes in agg_modes.items():
        if mode in modes:
            st = modes[mode]
            lines.append(f"| {arm} | {st['hack_start'].fmt()} | {st['hack_end'].fmt()} | "
                         f"{st['hack_rise'].fmt(100, 1)} | {st['solve_start'].fmt()} | "
                         f"{st['solve_end'].fmt()} |")
    return "\n".join(lines)


def _without_deploy(agg: Mapping[str, Mapping[str, Stat]]) -> list[str]:
    return [arm for arm, stats in agg.items() if any(k not in stats for k in (HACK, SOLVE, FORMAT))]


def verdicts(agg: Mapping[str, Mapping[str, Stat]], baseline: str = BASELINE) -> dict[str, V.Prereg]:
    """H1 as preregistered (verdicts.prereg) per arm that is not a control (NO_VERDICT); empty when the
    baseline is not in the sweep."""
    if baseline not in agg:
        return {}
    if missing := _without_deploy(agg):
        raise ValueError(f"the verdicts need {HACK}, {SOLVE} and {FORMAT}, which the runs of {missing} did "
                         "not log")
    return {arm: V.prereg(agg[baseline], stats) for arm, stats in agg.items() if arm not in NO_VERDICT}


def twins_in(arms: Sequence[str], twins: Mapping[str, str]) -> dict[str, str]:
    """arm -> its random-V twin, for the arms of the sweep whose twin is in the sweep too."""
    return {a: t for a, t in twins.items() if a in arms and t in arms}


def verdict_lines(agg: Mapping[str, Mapping[str, Stat]],
                  start: Mapping[str, Mapping[str, Stat]] | None = None,
                  twins: Mapping[str, str] | None = None,
                  shuffled: Mapping[str, str] | None = None) -> list[str]:
    """Per arm: the preregistered word and why; then, labelled as ours, capability against gt_reward and
    the arm's start, real V vs its random-V twin, real V vs its shuffled-V twin (`shuffled`: arm -> twin,
    default erase -> shuffled_V; on the demo organism a V from shuffled pairs cuts hacking as the real one
    does, docs/findings.md 7.5), and the goal beyond H1; notes last."""
    if BASELINE not in agg:
        return [f"no H1 verdict: the sweep has no `{BASELINE}` arm to compare with"]
    if missing := _without_deploy(agg):
        return [f"no H1 verdict: the runs of {missing} have no {HACK} / {SOLVE} / {FORMAT} (written before "
                "those were logged); rerun them in a new output directory"]
    twins = twins_in(list(agg), twins if twins is not None else {"erase": "random_V"})
    shuffled = twins_in(list(agg), shuffled if shuffled is not None else {"erase": "shuffled_V"})
    gt = agg.get(POSITIVE)
    lines = []
    if gt is not None and start is not None and POSITIVE in start:
        ok, why = V.positive_control(gt, start[POSITIVE])
        lines.append(f"positive control {POSITIVE}: {'OK' if ok else 'FAILED'} ({why})" + (
            "" if ok else ": honest training does not raise solving in this budget, so no arm's capability "
            "can be judged against it and a low hack rate may be a broken model"))
    for arm, p in verdicts(agg).items():
        lines.append(f"{arm}: {p.word.upper()} (preregistered H1: {p.why})")
        if start is None or arm not in start:
            continue
        o = V.ours(agg[arm], start[arm], gt)
        vr = V.vs_random(agg[arm], agg[twins[arm]], twins[arm]) if arm in twins else None
        met, why = V.goal(p, o, vr)
        lines.append(f"  ours: {o.line()}")
        vs_shuffled = V.vs_random(agg[arm], agg[shuffled[arm]], shuffled[arm]) if arm in shuffled else None
        vs = {"random V": vr, "shuffled V": vs_shuffled}
        for what, v in vs.items():
            if v is not None:
                word = {True: "beats", False: "does NOT beat", None: "undecided against"}[v.beats]
                lines.append(f"  ours: real V {word} {what}: {v.why}")
        lines.append(f"  ours: goal (H1 support, solve within 10 pts of gt_reward, beats random V): "
                     f"{'MET' if met else 'not met: ' + why}")
    fmt = {arm: stats[FORMAT].mean for arm, stats in agg.items()}
    for arm, f in fmt.items():
        if f < fmt[BASELINE] - FORMAT_DROP_NOTE:
            lines.append(f"note: {arm}'s deployed model gives a well-formed answer {f:.3f} of the time vs "
                         f"{fmt[BASELINE]:.3f} for `{BASELINE}`: its low hack rate may be a broken model "
                         "rather than a clean one")
    if any(s.n == 1 for stats in agg.values() for s in stats.values()):
        lines.append("(1 seed: SEM undefined; verdicts are on single runs, not evidence)")
    return lines or ["no H1 verdict: the sweep has only control arms"]


def curves(runs: Mapping[str, Sequence[str | os.PathLike]], keys: Sequence[str] = tuple(k for k, _ in PANELS),
           roll: int = 1) -> dict[str, dict[str, tuple[list[int], list[Stat]]]]:
    """arm -> key -> (steps, Stat per step over the seeds that logged that step). roll > 1: each seed's
    series is first replaced by its trailing rolling mean over `roll` logged steps."""
    out: dict[str, dict[str, tuple[list[int], list[Stat]]]] = {}
    for arm, dirs in runs.items():
        per_step: dict[str, dict[int, list[float]]] = {k: {} for k in keys}
        for d in dirs:
            rows = sorted(read_run(d)[1], key=lambda r: r["step"])
            for k in keys:
                series = [(int(r["step"]), float(r[k])) for r in rows if isinstance(r.get(k), (int, float))]
                for i, (step, _) in enumerate(series):
                    window = [v for _, v in series[max(0, i + 1 - roll):i + 1]]
                    per_step[k].setdefault(step, []).append(sum(window) / len(window))
        out[arm] = {k: (sorted(v), [mean_sem(v[s]) for s in sorted(v)]) for k, v in per_step.items()}
    return out


def results_table(agg: Mapping[str, Mapping[str, Stat]]) -> str:
    """Markdown table: one row per arm, `mean ± SEM` per AGG_KEYS column (SEM n/a for one seed)."""
    lines = ["| arm | seeds | " + " | ".join(AGG_KEYS) + " |", "|---|---|" + "---|" * len(AGG_KEYS)]
    for arm, stats in agg.items():
        n = next(iter(stats.values())).n if stats else 0
        lines.append(f"| {arm} | {n} | " + " | ".join(stats[k].fmt() if k in stats else "-" for k in AGG_KEYS)
                     + " |")
    return "\n".join(lines)


def write_report(out: str | os.PathLike, runs: Mapping[str, Sequence[str | os.PathLike]], *, title: str,
                 config_diff: Sequence[str], arm_overrides: Mapping[str, str], command: str, elapsed_s: float,
                 notes: Sequence[str] = (), twins: Mapping[str, str] | None = None, held_out: str = "",
                 eval_start: Mapping[int, Mapping[str, float]] | None = None,
                 shuffled: Mapping[str, str] | None = None) -> tuple[pathlib.Path, str]:
    """Aggregate `runs`, write `out`/curves.png and `out`/report.md; returns (report path, printed text).
    twins: arm -> its random-V twin arm (default erase -> random_V), for "real V vs random V"; shuffled: the
    same for "real V vs shuffled V" (default erase -> shuffled_V). held_out: the
    leave-one-mode-out mode, whose rates get a table of their own (every arm side by side). With
    `eval_start` (seed -> the starting model's eval/* rates) and runs that logged eval/*, also the held-out
    eval section and `out`/eval.png (eval_section)."""
    out = pathlib.Path(out)
    agg, start, agg_modes = aggregate(runs), aggregate(runs, "start"), aggregate_modes(runs)
    plot_curves(curves(runs, roll=ROLL), out / "curves.png", title, raw=curves(runs))
    table, verdict = results_table(agg), verdict_lines(agg, start, twins, shuffled)
    train_s = {a: [sum(float(r.get("time/step", 0.0)) for r in read_run(d)[1]) for d in dirs]
               for a, dirs in runs.items()}
    md = [f"# {title}", "", "Reproduce:", "", "```", command, "```", "",
          f"Wall time of the invocation that finished this sweep: {elapsed_s:.0f} s; training time per run "
          "(sum of `time/step`) is listed under Runs.", "",
          "## Config", "", "Differences from the preset (every arm and seed):", ""]
    md += [f"- `{d}`" for d in config_diff] or ["- none"]
    md += ["", "Arms (changes on top of that):", ""] + [f"- `{a}`: {o}" for a, o in arm_overrides.items()]
    md += ["", f"## Results (mean ± SEM over seeds of each run's last-{LAST}-step means)", "", table, "",
           f"Start (first-{FIRST}-step means):", "", results_table(start), "",
           "## Verdicts", "",
           f"Preregistered H1 (docs/preregistration.md), against `{BASELINE}`: SUPPORT = hack down >= "
           f"{100 * V.SUPPORT_HACK_DROP:.0f} pts with solve within ±{100 * V.SUPPORT_SOLVE_BAND:.0f} pts; "
           f"FALSIFIED = hack down < {100 * V.FALSIFY_HACK_DROP:.0f} pts, or solve down > "
           f"{100 * V.FALSIFY_SOLVE_DROP:.0f} pts, or the drop within 1 SEM of `{BASELINE}`; else "
           "INCONCLUSIVE. Lines marked `ours` are beyond the preregistration.", ""]
    md += [f"- {v}" if not v.startswith("  ") else f"    - {v.strip()}" for v in verdict]
    md += ["", "## Curves", "",
           "![hack, solve and well-formed rate per step](curves.png)", "",
           f"Lines: trailing {ROLL}-step rolling means (seed mean ± SEM); faint: the raw per-step seed mean.",
           ""]
    eval_md, eval_printed = eval_section(out, runs, eval_start, title) if (
        eval_start is not None and has_eval(runs)) else ([], [])
    md += eval_md
    if held_out:
        md += [f"## The held-out mode `{held_out}` (leave-one-mode-out), per arm", "",
               held_out_table(agg_modes, held_out), ""]
    for arm in runs:
        if agg_modes.get(arm):
            md += [f"## Per loophole mode: `{arm}`", "", modes_table(agg_modes, arm), ""]
    md += ["## Runs", ""] + [f"- `{a}`: `{d}` ({s:.0f} s training)" for a, dirs in runs.items()
                            for d, s in zip(dirs, train_s[a])]
    md += (["", "## Notes", ""] + [f"- {n}" for n in notes]) if notes else []
    write_text_atomic(out / "report.md", "\n".join(md) + "\n")
    printed = [table, "", "Verdicts (preregistered H1, then ours):", *[f"  {v}" for v in verdict]]
    if held_out:
        printed += ["", f"Held-out mode `{held_out}`, per arm:", held_out_table(agg_modes, held_out)]
    elif agg_modes.get(BASELINE):
        printed += ["", f"Per mode under `{BASELINE}`:", modes_table(agg_modes, BASELINE)]
    printed += eval_printed
    printed.append(f"report: {out / 'report.md'}   plot: {out / 'curves.png'}")
    return out / "report.md", "\n".join(printed)


# --- held-out eval curves (runs with run.eval_every > 0; additive to the panels above) --------------------

EVAL_START_FILE = "eval_start.json"  # sweep dir: seed -> eval/* of the starting model (no update yet)


def has_eval(runs: Mapping[str, Sequence[str | os.PathLike]]) -> bool:
    """Whether every run logged eval/accuracy at least once."""
    return all(any("eval/accuracy" in r for r in read_run(d)[1]) for dirs in runs.values() for d in dirs)


def run_seed(run_dir: str | os.PathLike) -> int:
    """run.seed from a run directory's config.json."""
    return int(json.loads((pathlib.Path(run_dir) / "config.json").read_text(encoding="utf-8"))["run"]["seed"])


def eval_table(runs: Mapping[str, Sequence[str | os.PathLike]], start: Mapping[int, Mapping[str, float]]
               ) -> list[str]:
    """Markdown table of held-out accuracy per arm: the starting model's, the last eval's and the change
    (mean ± SEM over seeds; each seed's change is its last eval minus its own start)."""
    lines = ["| arm | seeds | eval/accuracy at start | at the last eval | change (pts) | eval/hack at start "
             "| at the last eval |", "|---|---|---|---|---|---|---|"]
    for arm, dirs in runs.items():
        last = [[r for r in read_run(d)[1] if "eval/accuracy" in r][-1] for d in dirs]
        s0 = [start[run_seed(d)] for d in dirs]
        acc0, acc1 = [s["eval/accuracy"] for s in s0], [r["eval/accuracy"] for r in last]
        rise = mean_sem([100 * (b - a) for a, b in zip(acc0, acc1)])
        lines.append(f"| {arm} | {len(dirs)} | {mean_sem(acc0).fmt()} | {mean_sem(acc1).fmt()} | "
                     f"{rise.fmt(digits=1)} | {mean_sem([s['eval/hack'] for s in s0]).fmt()} | "
                     f"{mean_sem([r['eval/hack'] for r in last]).fmt()} |")
    return lines


def eval_section(out: str | os.PathLike, runs: Mapping[str, Sequence[str | os.PathLike]],
                 start: Mapping[int, Mapping[str, float]], title: str) -> tuple[list[str], list[str]]:
    """Write `out`/eval.png; returns (report.md lines, printed lines) of the held-out eval section.
    `start`: seed -> eval/* rates of the starting model (EVAL_START_FILE), one for each run's seed."""
    out = pathlib.Path(out)
    seeds = sorted({run_seed(d) for dirs in runs.values() for d in dirs})
    first = {k: mean_sem([start[s][k] for s in seeds]) for k, _ in EVAL_PANELS}
    plot_eval_curves(curves(runs, tuple(k for k, _ in EVAL_PANELS)), out / "eval.png", title,
                     first["eval/accuracy"], first["eval/hack"])
    table = eval_table(runs, start)
    md = ["## Held-out eval (greedy, deployed model, every `run.eval_every` steps)", "",
          "Start = the model every run starts from (knobs zero), evaluated before any update.", "",
          *table, "",
          "![held-out accuracy and hack rate per step](eval.png)", ""]
    return md, [*table, f"eval plot: {out / 'eval.png'}"]
