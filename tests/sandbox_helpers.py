"""Shared pieces of the sandbox tests (test_sandbox.py, test_sandbox_programs.py): the pool fixture and
the checks every hostile test makes (its status, its time bound, and that the host is untouched)."""


from __future__ import annotations

import os
import pathlib
import time
import uuid

import pytest

from projected_grpo.envs.coding.sandbox import ExecutionResult, Limits, SandboxPool
from projected_grpo.envs.coding.sandbox_worker import UID_BASE

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 1.0
SLACK = 2.0  # a contended 2-core box: the call may return this long after its timeout
SECRET = f"pgrpo-secret-{uuid.uuid4().hex}"
os.environ["PGRPO_TEST_SECRET"] = SECRET  # set before the pool starts: must never reach a program


def make_pool():
    """The tests' pool (yielded, for a module fixture): 2 workers and a 256 MiB address space, so the gradual
    memory bomb touches 4x fewer pages than with the 1 GiB default."""
    with SandboxPool(2, Limits(memory_bytes=256 << 20)) as p:
        p.worker_pids_at_start = [w.proc.pid for w in p._workers]
        yield p


def _processes_of(uids: list[int]) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # exited meanwhile
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid in uids:
            found.append(status.splitlines()[0] + f" pid={pid}")
    return found


def execution_uids(pool: SandboxPool) -> list[int]:
    """The uids programs run as, one per live worker (empty where there is no uid drop)."""
    return [UID_BASE + w.proc.pid for w in pool._workers] if pool.isolation["uid_drop"] else []


def _assert_host_clean(pool: SandboxPool) -> None:
    assert _processes_of(execution_uids(pool)) == []
    assert [w.proc.pid for w in pool._workers] == pool.worker_pids_at_start  # no worker died
    assert all(w.proc.poll() is None for w in pool._workers)


def _run(pool: SandboxPool, code: str, status: str, timeout_s: float = TIMEOUT) -> ExecutionResult:
    t0 = time.monotonic()
    r = pool.run(code, timeout_s)
    wall = time.monotonic() - t0
    assert r.status == status, r
    assert wall < timeout_s + SLACK, f"took {wall:.2f}s with timeout {timeout_s}s"
    assert r.duration_s <= wall
    _assert_host_clean(pool)
    return r


def _needs(pool: SandboxPool, feature: str) -> None:
    if not pool.isolation[feature]:
        pytest.skip(f"isolation {feature!r} unavailable here (needs root / namespaces)")


