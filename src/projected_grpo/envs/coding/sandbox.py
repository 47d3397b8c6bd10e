"""Sandboxed execution of untrusted, model-written Python programs, on a pool of fork-server workers.

Each worker (`sandbox_worker.py`) keeps a fork template (`sandbox_template.py`: heavy imports done once,
a loop that does nothing but fork); each execution is a fresh fork of that template that runs the
program as `python main.py` would, and returns an `ExecutionResult`. Threat model, after nanochat's
execution.py:

What is covered:
- a separate process per execution, in its own session, in a fresh scratch cwd removed afterwards;
- rlimits: CPU seconds (timeout + 1), address space (MemoryError -> "memory"), processes, file size,
  open files, no core dumps; a wall-clock timeout, after which every process of the execution is
  SIGKILLed: the worker is a child subreaper, so setsid'd and double-forked daemons reparent to it,
  and a helper running as the execution's uid sends kill(-1, SIGKILL), which the kernel applies over
  the whole task list at once (a fork bomb cannot outrun it); the worker then reaps until ECHILD.
  When the program exits, whatever it left running (threads, children) is killed the same way;
- as root (our container): the program runs under a uid no other process has (base + worker pid),
  so it cannot signal the workers, their fork templates, the caller or other executions, nor read
  any other process's /proc/<pid>/environ; no_new_privs is set; parent-death signal on the worker;
- as root: each worker is pid 1 of its own pid namespace, so if it dies (even SIGKILLed with the
  caller) the kernel kills every process left in it; programs see only their own processes;
- as root: each worker has its own network namespace (only `lo`, down: no connection to any address,
  loopback included) and mount namespace (private tmpfs over /tmp, /var/tmp, /dev/shm; each
  execution's scratch dir is its own 64 MiB tmpfs, unmounted at once afterwards; the
  repo's top-level directory, /root and /home hidden behind empty tmpfs, with only the Python
  installation bind-mounted back; /proc with hidepid=2: only its own processes are visible);
- a scrubbed environment (PATH, HOME=TMPDIR=scratch, LANG, PYTHONHASHSEED=0), stdin = /dev/null;
  stdout/stderr capped (excess read and discarded, so the program never blocks on a full pipe);
  files returned only if regular and owned by the program (no symlink/hardlink leaks), capped.

What is not covered:
- without root (or with isolate=False): no uid drop, no namespaces, no RLIMIT_NPROC (it would count
  all the caller's processes): the program can read/write what the caller can, use the network, read
  the caller's environ and kill its worker or fork template (replaced; the execution reports "killed", and
  what it had forked may survive). `SandboxPool.isolation` says which protections are active;
- memory is capped per process, not per execution (worst case processes x memory_bytes): no cgroup
  is used, as the container's cgroup tree belongs to the host's runner; CPU and disk bandwidth are
  shared; world-readable system files (/etc, /usr, the Python installation) stay readable;
- the kernel is shared (no seccomp): a kernel exploit escapes; a program may create a user namespace
  where the kernel allows it, but gains nothing outside it and keeps its uid, so it is still killed;
- Python-level tricks inside the program (monkeypatching, `__eq__` overrides, forged exit codes or
  output): the graders, not the sandbox, must be robust to those.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref

import tyro

from projected_grpo.envs.coding import sandbox_worker
from projected_grpo.envs.coding.sandbox_worker import UID_BASE

STATUSES = ("ok", "error", "timeout", "memory", "killed")
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[3]  # the dir holding `projected_grpo`
REPLY_GRACE_S = 10.0  # a worker that has not answered timeout_s + this later is killed and replaced


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one execution.

    status: "ok" (exit 0), "error" (non-zero exit, uncaught exception, syntax error), "timeout" (wall
    clock or CPU limit), "memory" (uncaught MemoryError, e.g. the address-space limit), "killed" (died
    of a signal, e.g. a segfault). exit_code: the exit status, -signal if killed, None on timeout.
    files: path relative to the scratch dir -> text (utf-8, undecodable bytes replaced).
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    files: dict[str, str]
    duration_s: float

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"ExecutionResult.status={self.status!r}; expected one of {STATUSES}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-execution resource caps (the CPU-seconds limit is derived from each call's timeout_s)."""

    memory_bytes: int = 1 << 30
    """RLIMIT_AS: address space of each process."""
    file_bytes: int = 1 << 20
    """RLIMIT_FSIZE: largest file a program may write."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    processes: int = 16
    """RLIMIT_NPROC: processes and threads of one execution (its own uid; root only)."""
    output_bytes: int = 64 * 1024
    """Cap on stdout and stderr each, and on each returned file."""
    max_files: int = 16
    """Cap on the number of returned files."""


class _Worker:
    """Parent side of one fork-server worker process."""

    def __init__(self, limits: Limits, hide: list[str], isolate: bool):
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        self.isolation: dict[str, bool] = {}
        self._host_scratch: str | None = None
        cfg = json.dumps({**dataclasses.asdict(limits), "hide": hide, "isolate": isolate})
        self.proc = subprocess.Popen([sys.executable, "-s", "-P", sandbox_worker.__file__, cfg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True, cwd="/")
        hello = self._recv(timeout_s=60.0)
        if hello is None or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"sandbox worker failed to start (exit {self.proc.poll()}); "
                               f"run `{sys.executable} {sandbox_worker.__file__} '{cfg}'` to see why")
        self.isolation = hello["isolation"]
        # where the worker makes scratch dirs; in the host's /tmp unless it has its own mount namespace
        self._host_scratch = None if self.isolation["mountns"] else hello["scratch_root"]

    def _recv(self, timeout_s: float) -> dict | None:
        fd, deadline, buf = self.proc.stdout.fileno(), time.monotonic() + timeout_s, bytearray()
        need = 4
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                return None
            buf += chunk
            if need == 4 and len(buf) == 4:
                need += struct.unpack("<I", buf)[0]
        return json.loads(buf[4:])

    def run(self, code: str, timeout_s: float) -> dict | None:
        data = json.dumps({"code": code, "timeout_s": timeout_s}).encode()
        try:
            self.proc.stdin.write(struct.pack("<I", len(data)) + data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self._recv(timeout_s + REPLY_GRACE_S)

    def kill(self) -> None:
        """SIGKILL the worker, then whatever its execution left (it can no longer sweep them itself)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.isolation.get("uid_drop"):
            _kill_uid(UID_BASE + self.proc.pid)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._host_scratch:  # a killed worker could not remove it itself
            shutil.rmtree(self._host_scratch, ignore_errors=True)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the worker finishes and exits
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._remove_scratch()


def _kill_uid(uid: int, passes: int = 100) -> None:
    """SIGKILL every process running as `uid` until none is left (a fork bomb is capped by RLIMIT_NPROC)."""
    for _ in range(passes):
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/status") as f:
                    if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
                        pids.append(int(pid))
            except (OSError, ValueError):
                continue  # exited meanwhile
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    raise RuntimeError(f"processes of sandbox uid {uid} survived {passes} rounds of SIGKILL")


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.close()


class SandboxPool:
    """`n_workers` warm fork-server workers (default: one per core); thread-safe.

    Results never depend on the worker: each execution is a fresh fork of an identical template
    (same preloaded modules, PYTHONHASHSEED=0, `random` reseeded from urandom as a new interpreter is).
    """

    def __init__(self, n_workers: int | None = None, limits: Limits = Limits(), isolate: bool = True):
        """isolate=False skips namespaces and the uid drop even as root: only to test that fallback."""
        self.n_workers = n_workers or os.cpu_count() or 1
        self.limits, self._isolate = limits, isolate
        self._hide = sorted({str(PACKAGE_ROOT.parent), os.getcwd()})
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _close_all, self._workers)
        for _ in range(self.n_workers):
            try:
                self._workers.append(_Worker(limits, self._hide, isolate))
            except BaseException:
                self._finalizer()
                raise
        self.isolation = self._workers[0].isolation
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._workers:
            self._idle.put(w)
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(self.n_workers)

    def run(self, code: str, timeout_s: float = 5.0) -> ExecutionResult:
        """Run `code` as `python main.py` in a fresh sandboxed process; block until it ends."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}; expected a positive number of seconds")
        worker = self._idle.get()
        t0 = time.monotonic()
        reply = worker.run(code, timeout_s)
        if reply is None:  # the worker died or hung: replace it, and report this execution as failed
            worker.kill()
            with self._lock:
                self._workers.remove(worker)
                worker = _Worker(self.limits, self._hide, self._isolate)
                self._workers.append(worker)
            reply = {"status": "killed", "exit_code": None, "stdout": "", "files": {},
                     "stderr": "sandbox worker died or stopped answering; it was replaced",
                     "duration_s": time.monotonic() - t0}
        self._idle.put(worker)
        return ExecutionResult(**reply)

    def execution_uids(self) -> list[int]:
        """The uids programs run as, one per live worker (empty where there is no uid drop)."""
        with self._lock:
            return [UID_BASE + w.proc.pid for w in self._workers] if self.isolation["uid_drop"] else []

    def map(self, codes: list[str], timeout_s: float = 5.0) -> list[ExecutionResult]:
        """Run each program (concurrently over the workers); results in the order of `codes`."""
        return list(self._executor.map(lambda c: self.run(c, timeout_s), codes))

    def close(self) -> None:
        self._executor.shutdown()
        self._finalizer()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_program(code: str, timeout_s: float = 5.0) -> ExecutionResult:
    """One-shot: run `code` on a fresh single-worker pool (starts an interpreter; batch via SandboxPool)."""
    with SandboxPool(1) as pool:
        return pool.run(code, timeout_s)


@dataclasses.dataclass(frozen=True)
class RunOpts:
    """Run a Python file in the sandbox and print its ExecutionResult as JSON."""

    file: tyro.conf.Positional[pathlib.Path]
    """The program to run (as `python FILE`)."""
    timeout: float = 5.0
    """Wall-clock limit in seconds."""


def sandbox_run_cli(argv: list[str]) -> int:
    opts = tyro.cli(RunOpts, args=argv, prog="projected-grpo sandbox-run")
    if not opts.file.is_file():
        print(f"sandbox-run: {opts.file} is not a file", file=sys.stderr)
        return 2
    code = opts.file.read_bytes().decode("utf-8", "surrogateescape")
    print(json.dumps(dataclasses.asdict(run_program(code, opts.timeout)), indent=1))
    return 0
