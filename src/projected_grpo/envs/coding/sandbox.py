"""Sandboxed execution of untrusted, model-written Python programs, on a pool of fork-server workers.

Each worker (`sandbox_worker.py`) isolates itself (`sandbox_isolation.py`) and keeps a fork template
(`sandbox_template.py`: heavy imports done once, a loop that does nothing but fork); each execution is a
fresh fork of that template that runs the program as `python main.py` would, and returns an
`ExecutionResult`. The threat model, item by item with its mechanism and its test, is docs/sandbox.md.
In short, as root (our container, CI): each program runs under a uid of its own, in its worker's pid,
network, IPC and mount namespaces, sees a minimal read-only root (system dirs, the Python installation
less this package, its own scratch dir), under rlimits and a seccomp filter, and nothing it started or
made outlives its execution. `SandboxPool.isolation` says which protections are active on this host;
without root only the rlimits, the seccomp filter and the scratch dir are (docs/sandbox.md says what
that leaves open).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import errno
import functools
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
import tempfile
import threading
import time
import weakref

import tyro

from projected_grpo.envs.coding import sandbox_worker
from projected_grpo.envs.coding.sandbox_worker import UID_BASE
from projected_grpo.store import cache_root

STATUSES = ("ok", "error", "timeout", "memory", "killed")
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[3]  # the dir holding `projected_grpo`
REPLY_GRACE_S = 10.0  # a worker that has not answered timeout_s + this later is killed and replaced
# Denied to programs by the seccomp filter: they fail with ENOSYS, as on a kernel built without them.
# Keyrings, because a uid's keyring outlives its processes (the kernel keeps it until reboot, and the
# next execution under that uid finds it); the rest, because they are kernel attack surface that no
# program needs: new namespaces (unshare, setns, clone3, and clone with a new-namespace flag; clone3's
# flags are out of a filter's reach, and on ENOSYS libc falls back to clone), BPF, perf events,
# userfaultfd, io_uring.
DENIED_SYSCALLS = ("keyctl", "add_key", "request_key", "unshare", "setns", "clone3", "bpf", "perf_event_open",
                   "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register")
NEW_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


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
        bpf = seccomp_program() if isolate else None
        cfg = json.dumps({**dataclasses.asdict(limits), "hide": hide, "isolate": isolate,
                          "seccomp": base64.b64encode(bpf).decode() if bpf else None})
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


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes | None:
    """The seccomp filter of every program (BPF, for this machine's architecture): DENIED_SYSCALLS, and
    clone with a new-namespace flag, fail with ENOSYS; everything else is allowed. Built here by
    libseccomp (pyseccomp), so that the workers and their fork templates never import it; None where
    pyseccomp or libseccomp is missing (the pool's isolation then says seccomp False)."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError):  # RuntimeError: pyseccomp found no libseccomp.so on this host
        return None
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), name)
    for flag in NEW_NAMESPACE_FLAGS:  # clone's flags: its first argument (x86-64, arm64)
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def hidden_paths() -> list[str]:
    """Paths no program may read even where they lie inside the Python installation, which programs
    see: this package (the built-in problems' tests and reference solutions are in it), its source
    checkout, the cache (models, organisms, pools) and the caller's working directory."""
    package = PACKAGE_ROOT / "projected_grpo"
    checkout = [PACKAGE_ROOT.parent] if (PACKAGE_ROOT.parent / "pyproject.toml").is_file() else []
    return sorted({str(p) for p in [package, *checkout, cache_root(), pathlib.Path.cwd()]})


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
        self._hide = hidden_paths()
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
