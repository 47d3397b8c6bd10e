"""Sweep results as report.md: the results tables, the verdicts, V_hack's checks, curves, per-mode tables.

Input is a mapping arm -> run directories (tables.py reads them: per-arm mean ± SEM over seeds of each run's
last-5-step means, undefined for one seed, never 0). The verdict section (verdict_text.py) gives every arm's
preregistered word with every falsifier the sweep can decide, then our lines; the check section prints the
held-out check of the V_hack the projection arms used. The per-mode table shows each loophole mode's deployed
hack and solve rate over the first and last 10 steps.
Deliberately not here: running anything (experiment.py), the verdict rules (verdicts.py, ours.py), reading
runs (tables.py), drawing the figures (plots.py).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

from projected_grpo.store import write_text_atomic
from projected_grpo.study import verdict_text as VT
from projected_grpo.study.plots import EVAL_PANELS, PANELS, plot_curves, plot_eval_curves
from projected_grpo.study.tables import (
    AGG_KEYS,
    FIRST,
    LAST,
    MODE_WINDOW,
    ROLL,
    aggregate,
    aggregate_modes,
    curves,
    read_run,
    run_modes,
    run_seed,
    tables,
)
from projected_grpo.study.verdicts import Stat, mean_sem

__all__ = ["AGG_KEYS", "EVAL_PANELS", "FIRST", "LAST", "PANELS", "Stat", "aggregate", "aggregate_modes",
           "curves", "mean_sem", "plot_curves", "plot_eval_curves", "run_modes"]
BASELINE = VT.BASELINE


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
                 notes: Sequence[str] = (), held_out: str = "",
                 eval_start: Mapping[int, Mapping[str, float]] | None = None,
                 folds: VT.Folds | None = None) -> tuple[pathlib.Path, str]:
    """Read `runs`, write `out`/curves.png and `out`/report.md; returns (report path, printed text).
    held_out: the leave-one-mode-out mode, whose rates get a table of their own (every arm side by side) and
    decide F6; folds: other leave-one-mode-out results for F6 (held-out mode -> its fold's per-mode tables).
    With `eval_start` (seed -> the starting model's eval/* rates) and runs that logged eval/*, also the
    held-out eval section and `out`/eval.png (eval_section)."""
    out = pathlib.Path(out)
    t = tables(runs)
    agg, start, agg_modes = t.end, t.start, t.modes
    plot_curves(curves(runs, roll=ROLL), out / "curves.png", title, raw=curves(runs))
    folds = {**(folds or {}), **({held_out: agg_modes} if held_out else {})}
    table, verdict = results_table(agg), VT.lines(t, folds)
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
           "## Verdicts", "", *VT.rules_text()]
    md += [f"- {v}" if not v.startswith("  ") else f"    - {v.strip()}" for v in verdict]
    md += ["", "## V_hack's held-out check (ours)", "", *VT.check_section(t)]
    md += ["## Curves", "",
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
    printed = [table, "", "Verdicts (preregistered H1 and its falsifiers, then ours):",
               *[f"  {v}" for v in verdict]]
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
