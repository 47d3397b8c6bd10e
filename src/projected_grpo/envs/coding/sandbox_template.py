"""The sandbox's fork template: a process that does nothing but fork one child per execution.

Loaded by `sandbox_worker.py` (stdlib only, from this file's path) and run in a process of its own,
forked by the worker after isolation. Why a separate process: after every fork, each page of the
forking process is shared copy-on-write with the child, so every page the forker then writes costs a
page-fault copy (~3 us in a VM) while the child lives. The worker's bookkeeping (JSON, polling, scratch
mounts) would dirty hundreds of pages per execution; this loop dirties a handful.

Protocol, over pipes inherited from the worker: read a request (8 bytes: the timeout in seconds, a
double) on `ctl`; fork; write the child's pid (4 bytes) on `rep`; reap the child; write its wait
status (4 bytes) on `rep`. The child confines itself (session, stdio, rlimits, uid, cwd), reads
`main.py` from its scratch dir (written there by the worker) and runs it as `python main.py` would.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import io
import math
import os
import resource
import signal
import struct
import sys

# Imported once here so that forked children import nothing: what LeetCode-style setup code and
# solutions use, and what the graders' own harnesses import (ast, hashlib, json, types: hashlib alone
# costs a child ~5 ms to import, it loads OpenSSL). Never `threading` or `random` (nor `statistics`,
# which imports random): their os.register_at_fork handlers would run in every child, each copying
# ~50-130 pages that the program never needs; programs that use them import them (~1 ms), seeded
# afresh as in a new interpreter (tests/test_sandbox.py checks that a child starts without them).
PRELOAD = ("abc", "array", "ast", "binascii", "bisect", "collections", "copy", "dataclasses", "datetime",
           "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "json", "marshal",
           "operator", "re", "string", "textwrap", "types", "typing")
MEMORY_TAG = b"M"
PR_SET_PDEATHSIG = 1
# bound at import: a program that replaces them cannot change what the child does after it. The C
# excepthook is what CPython itself prints an uncaught exception with (the traceback module copies ~100
# pages more in a fresh fork).
_exit = os._exit
_print_exception = sys.__excepthook__


def _exit_code(code: object) -> int:
    """Exit status of `sys.exit(code)` as CPython computes it (None -> 0, int -> low byte, else 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(1 << 63) <= code < (1 << 63) else 255
    print(code, file=sys.stderr)
    return 1


def _confine(limits: dict, timeout_s: float, fds: tuple[int, int, int]) -> None:
    """In the forked child, before any untrusted code: own session, stdio, rlimits, uid, cwd (the env is
    already the program's: the worker set it before forking this template)."""
    out_w, err_w, tag_w = fds
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(tag_w, 3)
    os.closerange(4, 1 << 16)  # the template's protocol pipes among them
    cpu = math.ceil(timeout_s) + 1
    for res, val in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_CORE, (0, 0)),
                     (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                     (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
                     (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)):
        resource.setrlimit(res, val)
    uid = limits["uid"]
    if uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # no_new_privs is inherited from the worker. The parent-death signal is not inherited and setuid
    # clears it; in a pid namespace the worker's death kills every process in it anyway, and the first
    # ctypes call in a child copies ~70 pages, so it is set only where there is none.
    if not limits["pidns"]:
        import ctypes
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(limits["scratch"])  # os.environ is already child_env(scratch) (see sandbox_worker.main)
    sys.argv = ["main.py"]


def _read_source() -> bytes:
    """main.py, as the worker wrote it into the scratch dir (os-level: open() costs ~30 pages)."""
    fd = os.open("main.py", os.O_RDONLY)
    try:
        chunks, size = [], os.fstat(fd).st_size  # its size: no 1 MiB buffer to map and unmap each time
        while chunk := os.read(fd, max(size + 1, 1)):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _run_main(source: bytes) -> int:
    """Run `source` as `python main.py` would and return its exit status (CPython's rules)."""
    status = 0
    try:
        # bytes, as the interpreter reads a file: UTF-8 unless a PEP 263 coding line says otherwise
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py",
                                                  "__builtins__": builtins})
    except SystemExit as e:
        status = _exit_code(e.code)
    except BaseException as e:
        status = 1
        if isinstance(e, MemoryError):
            try:
                os.write(3, MEMORY_TAG)
            except OSError:  # the program closed fd 3: reported as a plain error
                pass
        try:  # as CPython prints it: without this wrapper's own frame (the C hook reads __traceback__)
            _print_exception(type(e), e, e.with_traceback(e.__traceback__.tb_next).__traceback__)
        except BaseException:  # stderr closed, or no memory left to format the traceback
            pass
    try:
        if "threading" in sys.modules:  # as at interpreter exit: wait for non-daemon threads, then atexit
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # stdio closed or broken by the program: the exit status already says what happened
        pass
    return status


def _child(limits: dict, timeout_s: float, fds: tuple[int, int, int]) -> None:
    """The forked child: confine, run, exit. Never returns into the template's loop, whatever happens."""
    status = 120  # confinement failed: reported as an error, with the traceback on stderr
    try:
        _confine(limits, timeout_s, fds)
        status = _run_main(_read_source())
    except BaseException:
        try:
            _print_exception(*sys.exc_info())
        except BaseException:  # stderr unusable
            pass
    finally:
        _exit(status)  # bound at import: a program that replaces os._exit cannot make this return


# What the graders' programs and typical solutions do first; each first use initialises something lazily
# (a dlopen, an OpenSSL digest fetch, an encoder, a typing cache) that would otherwise cost every child.
WARMUP = """
import ast, binascii, hashlib, json, marshal, os
from typing import *
from collections import *
class Solution:
    def f(self, nums: List[int]) -> Dict[str, Optional[int]]:
        return {"a": sum(x * x for x in nums if x % 2) + len([c for c in f"{nums!r} {2.5:.2f}"]) + max(nums)}
assert Solution().f([1, 2, 3]) == {"a": 27}, "message"
code = marshal.loads(binascii.a2b_base64(binascii.b2a_base64(marshal.dumps(compile("x = 1", "m", "exec")))))
exec(compile(ast.Module(ast.parse("y = 2").body, []), "m", "exec"), {})
digest = hashlib.sha256(repr(json.loads(json.dumps({"k": [1, "x", None]}))).encode()).hexdigest()[:32]
def g():
    raise ValueError("warm")
"""


def _warm_up() -> None:
    """Do once here what every child would otherwise do first, at a cost of ~10 ms per fork: imports,
    the first compile() (lazy parser setup) and the first traceback (linecache, formatting)."""
    for name in PRELOAD:
        importlib.import_module(name)
    ns: dict = {"__name__": "__warmup__"}
    exec(compile(WARMUP, "<warmup>", "exec"), ns)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        ns["g"]()
    except ValueError as e:
        _print_exception(type(e), e, e.__traceback__)
    finally:
        sys.stderr = stderr
    gc.freeze()  # the template's objects are never scanned by a child's GC, so never copied-on-write


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve(limits: dict, ctl_r: int, rep_w: int, fds: tuple[int, int, int]) -> None:
    """The template's loop (never returns): one fork per request until the worker closes `ctl_r`.

    limits: the child's caps plus uid, pidns and scratch (see sandbox_worker.main). fds: the write
    ends of the stdout, stderr and memory-tag pipes, which each child takes as its fds 1, 2 and 3.
    """
    if min(fds) <= 3:  # the child dup2()s them onto 1, 2, 3: a lower one would be clobbered first
        raise ValueError(f"template pipe fds {fds} overlap the child's stdio")
    _warm_up()
    os.write(rep_w, b"R")  # ready
    while (req := _read_exact(ctl_r, 8)) is not None:
        pid = os.fork()
        if pid == 0:
            _child(limits, struct.unpack("<d", req)[0], fds)
        os.write(rep_w, struct.pack("<i", pid))
        os.write(rep_w, struct.pack("<i", os.waitpid(pid, 0)[1]))
    _exit(0)
