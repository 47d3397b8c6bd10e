"""A sweep's run directories read into the tables the verdicts and the report use.

Input is a mapping arm -> run directories, each as the training loop writes it (metrics.jsonl, config.json,
summary.json once finished, v_hack_check.json when it resolved a V_hack). Each run contributes its last-5-step
means (`metrics.summarize`, the numbers in its summary.json) and its first-5-step means (its start); an arm's
value is the mean over its seeds with the standard error of the mean, undefined for one seed. The verdicts
read the *deployed* model's rates (`hack/deploy`, `solve/deploy`, `format/deploy`: quarantine zeroed; they
equal the student rates except under `route`).
  aggregate        arm -> key -> Stat (end or start)
  per_seed         arm -> seed -> key -> value (end): the paired contrasts' input
  curves           arm -> key -> (steps, Stat per step), optionally each seed's rolling mean first
  aggregate_modes  arm -> mode -> first / last 10 steps' hack and solve of that loophole mode
  arm_info         arm -> what its config says (projection arm, control, gate, teacher rows)
  checks           arm -> each run's held-out check of the V_hack it used (hack/check.py)
Deliberately not here: the verdicts (verdicts.py, ours.py), formatting (report.py).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from projected_grpo import config as C
from projected_grpo.hack.resolve import CHECK_FILE
from projected_grpo.run import metrics
from projected_grpo.study.verdicts import FORMAT, HACK, SOLVE, Stat, mean_sem

# last-5-step means aggregated per arm, in table order
AGG_KEYS: tuple[str, ...] = ("hack/deploy", "solve/deploy", "format/deploy", "hack/student", "solve/student",
                             "proj/cin_student", "proj/cin_teacher", "proj/cout")
LAST = 5  # an arm's end: its last-5-step means
FIRST = 5  # an arm's start: its first-5-step means (ours: "against its own start")
MODE_WINDOW = 10  # per-mode rise: the first vs the last 10 steps (a mode is drawn in ~2/3 of the steps)
ROLL = 7  # curves: trailing rolling mean over this many steps (also the matched hack budget's curve)

Runs = Mapping[str, Sequence[str | os.PathLike]]


def read_run(run_dir: str | os.PathLike) -> tuple[dict[str, float], list[dict]]:
    """(last-5-step means of AGG_KEYS, all metric rows) of a finished run; a run without summary.json
    has not finished and raises naming it."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / metrics.SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"{run_dir}: no {metrics.SUMMARY_FILE}, so the run has not finished; "
                                "rerun the sweep (finished runs are skipped) or drop this run")
    rows = metrics.read_rows(run_dir / metrics.METRICS_FILE)
    return metrics.summarize(rows, last=LAST, keys=AGG_KEYS), rows


def run_config(run_dir: str | os.PathLike) -> C.Config:
    """The Config a run trained with (its config.json)."""
    return C.Config.from_json(str(pathlib.Path(run_dir) / "config.json"))


def run_seed(run_dir: str | os.PathLike) -> int:
    """run.seed from a run directory's config.json."""
    return int(json.loads((pathlib.Path(run_dir) / "config.json").read_text(encoding="utf-8"))["run"]["seed"])


def _start(rows: list[dict]) -> dict[str, float]:
    first = sorted(rows, key=lambda r: r["step"])[:FIRST]
    return metrics.summarize(first, last=FIRST, keys=AGG_KEYS)


def aggregate(runs: Runs, where: str = "end") -> dict[str, dict[str, Stat]]:
    """arm -> key -> Stat over the arm's runs, for each of AGG_KEYS that its runs logged. where: "end" (each
    run's last-LAST-step means, its summary) or "start" (its first-FIRST-step means)."""
    out: dict[str, dict[str, Stat]] = {}
    for arm, dirs in runs.items():
        summaries = []
        for d in dirs:
            end, rows = read_run(d)
            summaries.append(end if where == "end" else _start(rows))
        out[arm] = {k: mean_sem([s[k] for s in summaries]) for k in AGG_KEYS
                    if all(k in s for s in summaries)}
    return out


def per_seed(runs: Runs) -> dict[str, dict[int, dict[str, float]]]:
    """arm -> seed -> the run's end values (last-LAST-step means); two runs of one arm with the same seed
    raise (they could not be paired)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for arm, dirs in runs.items():
        out[arm] = {}
        for d in dirs:
            seed = run_seed(d)
            if seed in out[arm]:
                raise ValueError(f"arm {arm}: two runs with seed {seed} ({d}); a contrast pairs runs by seed")
            out[arm][seed] = read_run(d)[0]
    return out


def curves(runs: Runs, keys: Sequence[str] = (HACK, SOLVE, FORMAT), roll: int = 1
           ) -> dict[str, dict[str, tuple[list[int], list[Stat]]]]:
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


def budget_curve(runs: Runs, arm: str) -> tuple[list[int], list[float], list[float]] | None:
    """(steps, hack, solve) of `arm` for the matched hack budget (verdicts.matched_budget): per step the seed
    mean of each seed's ROLL-step rolling mean, over the steps that logged both; None without the arm."""
    if arm not in runs:
        return None
    c = curves({arm: runs[arm]}, (HACK, SOLVE), roll=ROLL)[arm]
    hack = dict(zip(c[HACK][0], c[HACK][1]))
    solve = dict(zip(c[SOLVE][0], c[SOLVE][1]))
    steps = [s for s in c[HACK][0] if s in solve]
    return steps, [hack[s].mean for s in steps], [solve[s].mean for s in steps]


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


def aggregate_modes(runs: Runs) -> dict[str, dict[str, dict[str, Stat]]]:
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


@dataclass(frozen=True)
class ArmInfo:
    """What an arm's config says, for the clauses that depend on it."""

    proj_arm: str  # none / erase / route
    control: str  # proj.control: none = the real V
    gate: str  # proj.gate
    projects_grad: bool  # the gradient itself is projected (proj.arm != none, target grad or both)
    teacher_rows: bool  # training draws teacher rows (G_t > 0)


def arm_info(runs: Runs) -> dict[str, ArmInfo]:
    """arm -> ArmInfo from its first run's config.json."""
    out = {}
    for arm, dirs in runs.items():
        cfg = run_config(dirs[0])
        projects = cfg.proj.arm != "none" and cfg.proj.target in ("grad", "both")
        out[arm] = ArmInfo(cfg.proj.arm, cfg.proj.control, cfg.proj.gate, projects, cfg.rollout.G_t > 0)
    return out


def checks(runs: Runs) -> dict[str, list[tuple[str, dict]]]:
    """arm -> (run directory name, the held-out check of the real V_hack it resolved: its CHECK_FILE) for each
    of its runs that has one; empty when none has (arm none without pairs, or runs from before the check).
    Runs of one arm may hold different checks: where the pairs are drawn with the seed (the maths problems),
    each seed has its own V."""
    files = {arm: [pathlib.Path(d) / CHECK_FILE for d in dirs] for arm, dirs in runs.items()}
    return {arm: [(f.parent.name, json.loads(f.read_text(encoding="utf-8"))) for f in fs if f.is_file()]
            for arm, fs in files.items()}


@dataclass(frozen=True)
class Tables:
    """Everything a report's verdicts read, from one sweep's runs."""

    runs: Runs
    end: dict[str, dict[str, Stat]]
    start: dict[str, dict[str, Stat]]
    seeds: dict[str, dict[int, dict[str, float]]]
    modes: dict[str, dict[str, dict[str, Stat]]]
    info: dict[str, ArmInfo]
    checks: dict[str, list[tuple[str, dict]]]


def tables(runs: Runs) -> Tables:
    """Read `runs` into Tables."""
    return Tables(runs, aggregate(runs), aggregate(runs, "start"), per_seed(runs), aggregate_modes(runs),
                  arm_info(runs), checks(runs))
