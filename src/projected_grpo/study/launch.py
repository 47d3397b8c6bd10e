"""Running a sweep's runs: each run is `projected-grpo train --config PLAN` in a process of its own.

A run's planned config is written to `<sweep>/plans/<arm>-s<seed>.json`; the run is the CLI's `train` on
that file (with `--resume` when its run directory already holds metrics), so a sweep trains exactly what a
user would by hand, each run sets its own threads and RNG, and nothing of one run leaks into another. Runs
with a summary.json are skipped: rerunning a killed sweep finishes only the missing runs, on either backend.
BACKENDS: `local` runs `jobs` at once on this machine through a thread pool of subprocesses (stdlib
`concurrent.futures`); `ray` submits each run as a Ray task (the same command, with its CPU request) to a
running cluster or a local Ray instance. A parallel run's output goes to `<run dir>/train.log`. `jobs` 0
means what the cores allow: cores // run_cpus (default_jobs). No scheduler of our own: threads or Ray.
Before its runs, a sweep fills their V_hack cache: one `extract-direction --controls` per group of runs
whose V_hack inputs are alike (v_hack_groups: per seed), so each control is not one more extraction.
A sweep owns its runs: each starts in a process group of its own and learns the sweep's pid (PARENT_ENV: the
CLI then has the kernel SIGTERM it should the sweep die, even by SIGKILL); SIGTERM or Ctrl-C to the sweep
sends SIGTERM to every run's group, waits for them (SIGKILL after STOP_GRACE_S), starts no other run, and
raises errors.Interrupted: each stopped run keeps its last checkpoint and the same command resumes it.
Not here: planning the runs or reading their results (experiment.py, report.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from projected_grpo import store
from projected_grpo.errors import Interrupted, UserError
from projected_grpo.hack import direction
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.run import metrics

Log = Callable[[str], None]
LOG_FILE = "train.log"


class RunFailed(UserError):
    """A run's process exited non-zero; its own output already says why, so the sweep adds one line."""


def train_command(plan: pathlib.Path, resume: bool) -> list[str]:
    """The argv that trains one planned run (the CLI, so the run is exactly what a user would type)."""
    return [sys.executable, "-m", "projected_grpo.cli", "train", "--config", str(plan),
            *(["--resume"] if resume else [])]


def extract_command(plan: pathlib.Path, controls: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """The argv that fills the V_hack cache of a group of runs in one extraction: `plan`'s direction and
    `controls` (the seeded ones drawn with each of `seeds`), cached where each run's `train` reads it."""
    return [sys.executable, "-m", "projected_grpo.cli", "extract-direction", "--config", str(plan),
            "--allow-no-pairs", "--controls", *controls, *(["--seeds", *map(str, seeds)] if seeds else [])]


def v_hack_groups(planned: Sequence[tuple]) -> list[tuple[pathlib.Path, list[str], list[int], int]]:
    """The extractions `planned` runs ((run, plan path) pairs) need, one per group of runs whose V_hack
    inputs are alike but for the control (hack/resolve.v_inputs: one group per seed): (one plan of the
    group, the group's controls, the random seeds of its seeded controls, its number of runs). Runs with
    their own V file need none."""
    groups: dict[str, list[tuple]] = {}
    for run, plan in planned:
        key = hack_resolve.v_inputs(run.cfg)
        if key is not None:
            groups.setdefault(key, []).append((run, plan))
    out = []
    for members in groups.values():
        controls = sorted({r.cfg.proj.control for r, _ in members})
        seeds = sorted({r.cfg.run.seed for r, _ in members if r.cfg.proj.control in direction.SEEDED})
        out.append((members[0][1], controls, seeds, len(members)))
    return out


def cores() -> int:
    """CPU cores this process may use (its affinity mask, so a container's or taskset's limit counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_cpus(runs: Sequence) -> int:
    """Cores one run keeps busy: its torch threads (run.threads; 0 = torch's default, every core). Its sandbox
    workers are not added: a run grades only while its torch threads wait for the grades (sample, grade,
    train in turn), so they use the cores its threads leave idle. The Ray backend requests this many CPUs."""
    return max(1, max((r.cfg.run.threads or cores()) for r in runs)) if runs else 1


def default_jobs(cpus: int, n_cores: int | None = None) -> int:
    """Runs at once that the cores allow: max(1, cores // cpus per run (run_cpus)), e.g. 2 on a 2-core
    laptop with the presets' run.threads = 1."""
    return max(1, (n_cores or cores()) // cpus)


# --- the sweep's runs: started in groups of their own, stopped together --------------------------------

PARENT_ENV = "PROJECTED_GRPO_PARENT_PID"  # the sweep's pid, in each run's environment (read by cli.py)
STOP_GRACE_S = 30.0  # after SIGTERM, seconds a run's group has to exit before SIGKILL


class _Stop(BaseException):
    """Raised by the signal handler in the sweep's main thread (a BaseException: no `except Exception`
    between the handler and run_all may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Runs:
    """The run processes this sweep has started and not yet reaped, and whether it is stopping."""

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.RLock()  # reentrant: the handler may run while its thread holds it
        self.signum: int | None = None
        self.since, self.stopped = 0.0, 0  # when the stop came, how many runs were running then

    def signal_all(self, sig: int) -> None:
        """`sig` to every running run's process group (the run and anything it started in its group)."""
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def reap_all(self) -> int:
        """Wait for every run started (SIGKILL to groups still there after STOP_GRACE_S); returns how many."""
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, self.since + STOP_GRACE_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            with self.lock:
                self.procs.discard(proc)
        return len(procs)


_RUNS = _Runs()


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """While the sweep runs: SIGTERM or SIGINT (Ctrl-C) stops every run (SIGTERM to each group) and raises
    _Stop in the main thread; a second signal SIGKILLs the groups at once. Old handlers are restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _RUNS.signum is not None:  # a second Ctrl-C: no more waiting
            _RUNS.signal_all(signal.SIGKILL)
            return
        _RUNS.signum, _RUNS.since = signum, time.monotonic()  # first: no new run starts (_train_one)
        _RUNS.stopped = len(_RUNS.procs)
        _RUNS.signal_all(signal.SIGTERM)
        raise _Stop(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _train_one(cmd: list[str], run_dir: pathlib.Path, to_log: bool, what: str = "",
               log_path: pathlib.Path | None = None) -> None:
    """Run one training command (or another step of the sweep, named by `what`) to its end, in a process
    group of its own, its output appended to log_path (default <run_dir>/train.log) when to_log; RunFailed
    when it fails. A sweep that is stopping starts nothing, and a run it stopped is not a failure."""
    if _RUNS.signum is not None:
        return
    log = None
    log_path = log_path or run_dir / LOG_FILE
    if to_log:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a", encoding="utf-8")  # closed below
    proc = None
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None, process_group=0,
                                env={**os.environ, PARENT_ENV: str(os.getpid())})
        with _RUNS.lock:
            _RUNS.procs.add(proc)
        if _RUNS.signum is not None:  # the stop came between the check above and the start
            _RUNS.signal_all(signal.SIGTERM)
        returncode = proc.wait()
        with _RUNS.lock:
            _RUNS.procs.discard(proc)
    except _Stop:  # in the main thread (jobs 1): maybe before the run was registered; run_all reaps it
        if proc is not None and proc.poll() is None:
            with _RUNS.lock:
                _RUNS.procs.add(proc)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        raise
    finally:
        if log is not None:
            log.close()
    if returncode and _RUNS.signum is None:
        where = f"; its output is in {log_path}" if to_log else ""
        # the run printed why (one line for a user's mistake, a traceback for a bug): say which, once
        raise RunFailed(f"{what or f'run {run_dir}'} failed (exit {returncode}){where}; fix what it printed, "
                        "then rerun the sweep's command: it resumes " + ("there" if what else
                                                                         "that run from its last checkpoint"))


def run_all(runs: Sequence, plans_dir: pathlib.Path | None, log: Log, jobs: int = 1, backend: str = "local",
            ray_address: str = "", command: str = "") -> dict[str, int]:
    """Train every run not finished yet, `jobs` at a time (0: default_jobs); returns counts of trained /
    resumed / skipped. SIGTERM or Ctrl-C stops every run started and raises errors.Interrupted.

    runs: experiment.Run objects (arm, seed, cfg with run.dir set); plans_dir: where their plans go (None:
    `plans/` beside each run's directory, for runs of several sweeps). backend: BACKENDS; ray_address: the
    cluster for `ray` (empty: a local Ray instance on this machine's cores). command: the sweep's command,
    for the line that says how to resume."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: choose one of {list(BACKENDS)}")
    counts = {"trained": 0, "resumed": 0, "skipped": 0}
    todo, planned = [], []
    for i, run in enumerate(runs, 1):
        head = f"[run {i}/{len(runs)}] arm {run.arm}, seed {run.seed} -> {run.dir}"
        if (run.dir / metrics.SUMMARY_FILE).exists():  # its config was checked against the plan
            log(f"{head}: skipped, {metrics.SUMMARY_FILE} exists (finished earlier)")
            counts["skipped"] += 1
            continue
        plan = (plans_dir or run.dir.parent / "plans") / f"{run.arm}-s{run.seed}.json"
        store.write_json_atomic(plan, run.cfg.to_dict())
        resume = (run.dir / metrics.METRICS_FILE).exists()
        counts["resumed" if resume else "trained"] += 1
        todo.append((head, train_command(plan, resume), run.dir, resume))
        planned.append((run, plan))
    if todo:
        _RUNS.signum = None
        try:
            with _stopped_by_signals():
                # every control of a seed from one extraction (the runs then load theirs), not one per run;
                # on a cluster the cache is each node's own, so the runs extract there
                if not ray_address:
                    _fill_v_hack_cache(v_hack_groups(planned), log, jobs or default_jobs(run_cpus(runs)))
                BACKENDS[backend](todo, log, jobs, run_cpus(runs), ray_address)
        except _Stop as e:
            _RUNS.reap_all()
            name = signal.Signals(e.signum).name
            again = f"`{command}`" if command else "the same command"
            raise Interrupted(e.signum, f"stopped by {name}: {_RUNS.stopped} running run(s) stopped, each "
                                        f"at its last checkpoint; run {again} again to resume the sweep"
                              ) from None
    return counts


def _fill_v_hack_cache(groups: list, log: Log, jobs: int) -> None:
    """One `extract-direction --controls` per group (v_hack_groups), `jobs` at once like the runs (so as much
    memory as the runs' own extractions took); each one's output in `<plans>/<plan>.v_hack.log` when several
    run at once. A failed extraction raises RunFailed after the others finish."""
    def one(plan: pathlib.Path, controls: list[str], seeds: list[int], n: int, to_log: bool) -> None:
        if _RUNS.signum is not None:
            return
        what = f"V_hack of {n} run(s) ({plan.stem}): controls {', '.join(controls)}"
        log(f"{what} from one extraction, cached where each run reads it (a hit when done before)"
            + (f" (output in {plan.with_suffix('.v_hack.log')})" if to_log else ""))
        _train_one(extract_command(plan, controls, seeds), plan.parent, to_log=to_log, what=what,
                   log_path=plan.with_suffix(".v_hack.log"))

    if jobs <= 1 or len(groups) <= 1:
        for group in groups:
            one(*group, to_log=False)
        return
    _in_parallel(lambda g: one(*g, to_log=True), groups, jobs)


def _in_parallel(fn: Callable, items: Sequence, jobs: int, done: Callable | None = None) -> None:
    """fn(item) for every item, `jobs` at once in threads; done(item) as each finishes. A failure raises once
    the running ones finish; stopped by a signal, the items not started yet never start."""
    ex = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = {ex.submit(fn, item): item for item in items}
        for fut in concurrent.futures.as_completed(futures):
            fut.result()
            if done is not None:
                done(futures[fut])
    finally:
        ex.shutdown(wait=True, cancel_futures=_RUNS.signum is not None)


def _local(todo: list, log: Log, jobs: int, cpus: int, ray_address: str) -> None:
    """On this machine: in the foreground one by one (jobs 1), else `jobs` subprocesses at once."""
    jobs = jobs or default_jobs(cpus)
    if jobs <= 1:
        for head, cmd, run_dir, resume in todo:
            log(f"{head}: {'resuming from its last checkpoint' if resume else 'training'}")
            _train_one(cmd, run_dir, to_log=False)
        return
    log(f"{len(todo)} runs, {jobs} at a time on this machine")
    def start(head: str, cmd: list[str], run_dir: pathlib.Path, resume: bool) -> None:
        if _RUNS.signum is not None:  # the sweep is stopping
            return
        # logged when a worker takes the run, not when it is queued (all are queued at once)
        log(f"{head}: {'resuming' if resume else 'training'} (output in {run_dir / LOG_FILE})")
        _train_one(cmd, run_dir, to_log=True)

    # a failed run raises here, naming its log; the others finish first
    _in_parallel(lambda item: start(*item), todo, jobs, done=lambda item: log(f"{item[0]}: done"))


def _ray_task(cmd: list[str], run_dir: str) -> None:
    """One run on a Ray worker: the same command, with the worker's own Python (same environment)."""
    _train_one([sys.executable, *cmd[1:]], pathlib.Path(run_dir), to_log=True)


def _ray(todo: list, log: Log, jobs: int, cpus: int, ray_address: str) -> None:
    """Each run a Ray task requesting `cpus` CPUs, on the cluster at ray_address or on a local instance
    (this machine's cores). At most `jobs` at once (0: as many as the cluster's CPUs allow). Run directories
    must be on a filesystem every node sees (the plans and run dirs are paths)."""
    try:
        import ray
    except ImportError:
        raise UserError("--backend ray needs Ray: pip install 'projected-grpo[ray]'") from None
    local = {} if ray_address else {"num_cpus": cores(), "include_dashboard": False}
    ray.init(address=ray_address or None, logging_level="ERROR", log_to_driver=False, **local)
    try:
        total = int(ray.cluster_resources().get("CPU", 1))
        jobs = jobs or default_jobs(cpus, total)
        log(f"{len(todo)} runs as Ray tasks of {cpus} CPU(s) each on {ray_address or 'a local instance'} "
            f"({total} CPUs), at most {jobs} at once")
        task = ray.remote(num_cpus=cpus, max_retries=0)(_ray_task)
        queue, pending, failed = list(todo), {}, []
        try:
            _ray_loop(ray, task, queue, pending, failed, jobs, log)
        except _Stop:  # the tasks' runs get SIGTERM as their Ray workers die (PARENT_ENV)
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        if failed:
            raise RunFailed(failed[0] + (f" (and {len(failed) - 1} more failed)" if len(failed) > 1 else ""))
    finally:
        ray.shutdown()


def _ray_loop(ray, task, queue: list, pending: dict, failed: list, jobs: int, log: Log) -> None:
    """Keep `jobs` tasks running until the queue is empty; failures are collected in `failed`."""
    while queue or pending:
        while queue and len(pending) < jobs:
            head, cmd, run_dir, resume = queue.pop(0)
            log(f"{head}: {'resuming' if resume else 'training'} (output in {run_dir / LOG_FILE})")
            pending[task.remote(cmd, str(run_dir))] = head
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        head = pending.pop(ref)
        try:
            ray.get(ref)
            log(f"{head}: done")
        except Exception as e:  # collected, raised once the others finish (as on the local backend)
            cause = getattr(e, "cause", e)  # ray.exceptions.RayTaskError wraps the task's exception
            failed.append(str(cause) if isinstance(cause, RunFailed) else f"{head}: {e!r}")


# --backend name -> how the runs not finished yet are run: (todo, log, jobs, cpus per run, ray address)
BACKENDS: dict[str, Callable[[list, Log, int, int, str], None]] = {"local": _local, "ray": _ray}
