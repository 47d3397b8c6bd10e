"""Running a sweep's runs: each run is `projected-grpo train --config PLAN` in a process of its own.

A run's planned config is written to `<sweep>/plans/<arm>-s<seed>.json`; the run is the CLI's `train` on
that file (with `--resume` when its run directory already holds metrics), so a sweep trains exactly what a
user would by hand, each run sets its own threads and RNG, and nothing of one run leaks into another. Runs
with a summary.json are skipped: rerunning a killed sweep finishes only the missing runs. `jobs` runs go at
once through a thread pool of subprocesses (stdlib `concurrent.futures`; a parallel run's output goes to
`<run dir>/train.log`). Not here: planning the runs or reading their results (experiment.py, report.py).
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import subprocess
import sys
from collections.abc import Callable, Sequence

from projected_grpo import store
from projected_grpo.errors import UserError
from projected_grpo.run import metrics

Log = Callable[[str], None]
LOG_FILE = "train.log"


class RunFailed(UserError):
    """A run's process exited non-zero; its own output already says why, so the sweep adds one line."""


def train_command(plan: pathlib.Path, resume: bool) -> list[str]:
    """The argv that trains one planned run (the CLI, so the run is exactly what a user would type)."""
    return [sys.executable, "-m", "projected_grpo.cli", "train", "--config", str(plan),
            *(["--resume"] if resume else [])]


def _train_one(cmd: list[str], run_dir: pathlib.Path, to_log: bool) -> None:
    if to_log:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / LOG_FILE, "a", encoding="utf-8") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    else:
        done = subprocess.run(cmd, check=False)
    if done.returncode:
        where = f"; its output is in {run_dir / LOG_FILE}" if to_log else ""
        # the run printed why (one line for a user's mistake, a traceback for a bug): say which, once
        raise RunFailed(f"run {run_dir} failed (exit {done.returncode}){where}; fix what it printed, then "
                        "rerun the sweep's command: it resumes that run from its last checkpoint")


def run_all(runs: Sequence, plans_dir: pathlib.Path, log: Log, jobs: int = 1) -> dict[str, int]:
    """Train every run not finished yet, `jobs` at a time; returns counts of trained / resumed / skipped.

    runs: experiment.Run objects (arm, seed, cfg with run.dir set)."""
    counts = {"trained": 0, "resumed": 0, "skipped": 0}
    todo = []
    for i, run in enumerate(runs, 1):
        head = f"[run {i}/{len(runs)}] arm {run.arm}, seed {run.seed} -> {run.dir}"
        if (run.dir / metrics.SUMMARY_FILE).exists():  # its config was checked against the plan
            log(f"{head}: skipped, {metrics.SUMMARY_FILE} exists (finished earlier)")
            counts["skipped"] += 1
            continue
        plan = plans_dir / f"{run.arm}-s{run.seed}.json"
        store.write_json_atomic(plan, run.cfg.to_dict())
        resume = (run.dir / metrics.METRICS_FILE).exists()
        counts["resumed" if resume else "trained"] += 1
        todo.append((head, train_command(plan, resume), run.dir, resume))
    if jobs <= 1:
        for head, cmd, run_dir, resume in todo:
            log(f"{head}: {'resuming from its last checkpoint' if resume else 'training'}")
            _train_one(cmd, run_dir, to_log=False)
        return counts
    with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
        futures = {}
        for head, cmd, run_dir, resume in todo:
            log(f"{head}: {'resuming' if resume else 'training'} (output in {run_dir / LOG_FILE})")
            futures[ex.submit(_train_one, cmd, run_dir, True)] = head
        for fut in concurrent.futures.as_completed(futures):
            fut.result()  # a failed run raises here, naming its log; the others finish first
            log(f"{futures[fut]}: done")
    return counts
