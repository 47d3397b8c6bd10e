"""Fork-server worker of the sandbox: one long-lived process forks one fresh child per execution.

Started by `sandbox.SandboxPool` as `python -s -P path/to/sandbox_worker.py CONFIG_JSON` (stdlib only, so
no package `__init__` can bloat the template). It
imports the modules programs commonly use once, isolates itself (network/mount namespaces, see the
threat model in sandbox.py), then loops: read a request (length-prefixed JSON on fd `proto_in`), fork
a child from this clean template, drop the child's privileges and run the program in it, kill every
process the execution left, reply with the result (length-prefixed JSON on fd `proto_out`). The
worker itself never runs untrusted code, so nothing a program does persists into the next execution.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib
import io
import json
import math
import os
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time

# Imported once in the worker (see main) so that forked children import nothing: what LeetCode-style
# setup code and solutions use, and what the graders' own harnesses import (ast, hashlib, json, types:
# hashlib alone costs a child ~5 ms to import, it loads OpenSSL). Never `threading` or `random` (nor `statistics`, which imports random):
# their os.register_at_fork handlers would run in every child, each copying ~50-130 pages that the
# program never needs; programs that use them import them (~1 ms), seeded afresh as in a new interpreter
# (tests/test_sandbox.py checks that a child starts without them).
PRELOAD = ("abc", "array", "ast", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
           "fractions", "functools", "hashlib", "heapq", "itertools", "operator", "re", "string", "textwrap",
           "types", "typing")

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
UID_BASE = 1_900_000_000  # + worker pid: a uid no other live worker (or real user) has
SYSTEM_TOPS = {"/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev",
               "/tmp", "/var", "/run", "/"}
MEMORY_TAG = b"M"
MAX_DEPTH = 8  # directory levels searched for returned files
SCRATCH_BYTES = 64 << 20  # size of each execution's scratch tmpfs (where mount namespaces work)
MNT_DETACH = 2
# bound at import: a program that replaces them cannot change what the child does after it. The C
# excepthook is what CPython itself prints an uncaught exception with (the traceback module copies ~100
# pages more in a fresh fork).
_exit = os._exit
_print_exception = sys.__excepthook__


def child_env(scratch: str) -> dict[str, str]:
    """The whole environment of a program (the worker adopts it, so a child inherits it untouched)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0"}


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {src} on {dst}")


def _isolate(hide: list[str], keep: list[str], enabled: bool) -> dict[str, bool]:
    """Put this worker in its own network and mount namespaces (root only); report what worked.

    Network: a fresh namespace has only `lo`, and it is down, so no connection (loopback included) can
    be made. Mounts: private tmpfs over /tmp, /var/tmp, /dev/shm (the only world-writable places) and
    over each directory in `hide` (the repo's top dir, /root, /home), with the `keep` directories (the
    Python installation) bind-mounted back at their own paths; /proc remounted with hidepid=2 so that
    programs see only their own processes.
    """
    got = {"netns": False, "mountns": False, "hidepid": False, "uid_drop": enabled and os.geteuid() == 0}
    if not got["uid_drop"]:
        return got
    got["netns"] = _libc.unshare(CLONE_NEWNET) == 0
    if _libc.unshare(CLONE_NEWNS) != 0:
        return got
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    keep_fds = {k: os.open(k, os.O_RDONLY | os.O_DIRECTORY) for k in keep if os.path.isdir(k)}
    for d in hide:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for k, fd in keep_fds.items():
        if any(k == d or k.startswith(d + "/") for d in hide):
            os.makedirs(k, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
        os.close(fd)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,nr_inodes=4096,mode=0711")
    for d in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=0755")
    got["mountns"] = True
    got["hidepid"] = _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                 b"hidepid=2") == 0
    return got


def _exit_code(code: object) -> int:
    """Exit status of `sys.exit(code)` as CPython computes it (None -> 0, int -> low byte, else 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(1 << 63) <= code < (1 << 63) else 255
    print(code, file=sys.stderr)
    return 1


def _confine(scratch: str, uid: int, limits: dict, timeout_s: float, fds: tuple) -> None:
    """In the forked child, before any untrusted code: own session, stdio, rlimits, uid, cwd (the env is
    already the program's: see main)."""
    out_w, err_w, tag_w = fds
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(tag_w, 3)
    os.closerange(4, 1 << 16)  # the worker's protocol pipes among them
    cpu = math.ceil(timeout_s) + 1
    for res, val in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_CORE, (0, 0)),
                     (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                     (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)):
        resource.setrlimit(res, val)
    if uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # no_new_privs is inherited from the worker (set in main). The parent-death signal is not inherited
    # and setuid clears it; in a pid namespace the worker's death kills every process in it anyway, and
    # the first ctypes call in a child copies ~70 pages, so it is set only where there is none.
    if not limits["pidns"]:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(scratch)  # os.environ is the worker's, already set to child_env(scratch) (see main)
    sys.argv = ["main.py"]


def _run_main(code: str) -> int:
    """Run `code` as `python main.py` would and return its exit status (CPython's rules)."""
    status = 0
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py",
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


def _child(code: str, scratch: str, uid: int, limits: dict, timeout_s: float, fds: tuple) -> None:
    """The forked child: confine, run, exit. Never returns into the worker's loop, whatever happens."""
    status = 120  # confinement failed: reported as an error, with the traceback on stderr
    try:
        _confine(scratch, uid, limits, timeout_s, fds)
        # for tracebacks and programs that read their own source; os-level: open() costs ~30 pages
        fd = os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        view = memoryview(code.encode("utf-8", "surrogateescape"))
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)  # after main.py: any size
        status = _run_main(code)
    except BaseException:
        try:
            _print_exception(*sys.exc_info())
        except BaseException:  # stderr unusable
            pass
    finally:
        _exit(status)  # bound at import: a program that replaces os._exit cannot make this return


def _children() -> list[int]:
    """Live and zombie children of this (subreaper) worker: every leftover process of an execution."""
    fd = os.open("/proc/thread-self/children", os.O_RDONLY)  # not open(): far fewer pages touched
    try:
        data, chunk = b"", b"-"
        while chunk:
            chunk = os.read(fd, 1 << 16)
            data += chunk
    finally:
        os.close(fd)
    return [int(p) for p in data.split()]


def _sweep(uid: int) -> None:
    """SIGKILL every process of the execution and reap them all.

    With a per-worker uid, one `kill(-1)` from a helper running as that uid reaches exactly the
    execution's processes, whatever session or group they moved to; the kernel holds the task list
    for the whole pass, so a fork bomb cannot add a process behind it. Orphans reparent to this
    subreaper worker, so reaping until ECHILD leaves nothing behind. Without root, the subreaper's
    children are killed until none is left (processes reparent to us as their parents die).
    """
    if uid:
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    while kids := _children():
        for pid in kids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.001)


def _read_files(scratch: str, uid: int, limits: dict) -> dict[str, str]:
    """Regular files the program left in its scratch dir (not main.py), capped in count and size.

    Opened with O_NOFOLLOW and checked to be owned by the program's uid, so a symlink or hard link to a
    host file cannot make this (root) worker read it. Only MAX_DEPTH levels are visited: a program can
    nest directories thousands deep, past the recursion limit of os.walk.
    """
    if os.listdir(scratch) == ["main.py"]:  # the usual case, without os.walk's cost
        return {}
    found = []
    for root, dirs, names in os.walk(scratch):
        rel_root = os.path.relpath(root, scratch)
        dirs[:] = sorted(dirs) if rel_root.count(os.sep) < MAX_DEPTH else []
        found += sorted(os.path.normpath(os.path.join(rel_root, n)) for n in names)
    files = {}
    for rel in [r for r in found if r != "main.py"][: limits["max_files"]]:
        try:
            fd = os.open(os.path.join(scratch, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and (not uid or st.st_uid == uid):
                files[rel] = f.read(limits["output_bytes"]).decode("utf-8", "replace")
    return files


def _make_scratch(path: str, uid: int, tmpfs: bool) -> None:
    """A fresh scratch dir owned by the program's uid; its own size-capped tmpfs where we can mount."""
    os.mkdir(path, 0o700)
    if tmpfs:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={SCRATCH_BYTES},nr_inodes=4096,mode=0700,uid={uid},gid={uid}")
    elif uid:
        os.chown(path, uid, uid)


def _remove_scratch(path: str, tmpfs: bool) -> None:
    """Remove a scratch dir whatever the program left in it (a lazy unmount drops a tmpfs at once)."""
    if tmpfs:
        _check(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
        os.rmdir(path)
        return
    try:
        shutil.rmtree(path)
    except RecursionError:  # nested deeper than shutil can recurse
        import subprocess
        subprocess.run(["rm", "-rf", "--one-file-system", path], check=True)


def run_one(code: str, timeout_s: float, uid: int, limits: dict) -> dict:
    """Run one program in a fresh child with a fresh scratch dir; return the result fields."""
    scratch = limits["scratch"]
    _make_scratch(scratch, uid, limits["scratch_tmpfs"])
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    tag_r, tag_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(code, scratch, uid, limits, timeout_s, (out_w, err_w, tag_w))
    for fd in (out_w, err_w, tag_w):
        os.close(fd)
    cap = limits["output_bytes"]
    bufs = {out_r: bytearray(), err_r: bytearray(), tag_r: bytearray()}
    pidfd = os.pidfd_open(pid)
    # select.poll rather than selectors: every page the worker writes after a fork is a copy-on-write
    # fault, and the selectors machinery alone touches ~80 of them per execution
    poller, is_open = select.poll(), dict.fromkeys((*bufs, pidfd), True)
    for fd in is_open:
        poller.register(fd, select.POLLIN)

    def drain(fd: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            poller.unregister(fd)
            is_open[fd] = False
        elif len(bufs[fd]) < cap:  # beyond the cap: keep reading so the writer never blocks, discard
            bufs[fd] += data[: cap - len(bufs[fd])]

    deadline, wait_status, timed_out = t0 + timeout_s, None, False
    while wait_status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(math.ceil(left * 1000)):  # ms, rounded up: never wakes early forever
            if fd == pidfd:
                wait_status = os.waitpid(pid, 0)[1]
            else:
                drain(fd)
    duration = time.monotonic() - t0
    poller.unregister(pidfd)
    is_open[pidfd] = False
    if timed_out or _children():
        _sweep(uid)
        if wait_status is None:
            wait_status = 9  # the sweep reaped it: it was still running at the deadline
    while any(is_open.values()):  # every writer is dead now, so this reaches EOF on each pipe
        for fd, _ in poller.poll():
            drain(fd)
    for fd in (*bufs, pidfd):
        os.close(fd)
    files = _read_files(scratch, uid, limits)
    _remove_scratch(scratch, limits["scratch_tmpfs"])
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
    exit_code = -sig if sig else os.WEXITSTATUS(wait_status)
    if timed_out or sig == signal.SIGXCPU:  # SIGXCPU: RLIMIT_CPU, reached early by busy threads
        status = "timeout"
    elif bufs[tag_r] == MEMORY_TAG:
        status = "memory"
    elif sig:
        status = "killed"
    else:
        status = "ok" if exit_code == 0 else "error"
    return {"status": status, "exit_code": None if timed_out else exit_code,
            "stdout": bufs[out_r].decode("utf-8", "replace"),
            "stderr": bufs[err_r].decode("utf-8", "replace"), "files": files, "duration_s": duration}


WARMUP = """
from typing import *
from collections import *
class Solution:
    def f(self, nums: List[int]) -> int:
        return sum(x * x for x in nums if x % 2) + len([c for c in f"{nums!r}"]) + max(nums, key=abs)
assert Solution().f([1, 2, 3]) == 22, "message"
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
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None  # EOF: the pool closed us
        buf += chunk
    return bytes(buf)


def _read_msg(fd: int) -> dict | None:
    """One length-prefixed JSON request from the pool, or None at EOF."""
    head = _read_exact(fd, 4)
    body = None if head is None else _read_exact(fd, struct.unpack("<I", head)[0])
    return None if body is None else json.loads(body)


def write_msg(fd: int, msg: dict) -> None:
    data = json.dumps(msg).encode()
    view = memoryview(struct.pack("<I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _enter_pid_namespace(proto_fds: tuple[int, int]) -> bool:
    """Become pid 1 of a new pid namespace (root only): when the worker dies, however it dies, the
    kernel SIGKILLs every process left in the namespace, so no execution can outlive its worker.

    unshare(CLONE_NEWPID) moves only future children, so this process forks the server (pid 1) and
    stays behind as its waiting parent, the process the pool holds; each dies with the other.
    """
    if _libc.unshare(CLONE_NEWPID) != 0:
        return False
    server = os.fork()
    if server == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return True
    for fd in proto_fds:  # so the pool sees EOF as soon as the server dies
        os.close(fd)
    status = os.waitpid(server, 0)[1]
    _exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _make_root() -> str:
    """A fresh 0700 dir in the host's /tmp for scratch dirs (no mount namespace); tempfile would import
    random (see PRELOAD)."""
    path = f"/tmp/pgrpo-sandbox-{os.getpid()}-{os.urandom(8).hex()}"
    os.mkdir(path, 0o700)
    return path


def main() -> None:
    limits = json.loads(sys.argv[1])
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    outer_pid = os.getpid()  # the uid is derived from the pid the pool sees
    pidns = limits["isolate"] and os.geteuid() == 0 and _enter_pid_namespace((proto_in, proto_out))
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    keep = sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))})
    hide = sorted({"/root", "/home"} | {"/" + p.split("/")[1] for p in limits["hide"]} - SYSTEM_TOPS)
    _warm_up()
    isolation = {**_isolate(hide, keep, limits["isolate"]), "pidns": pidns}
    uid = UID_BASE + outer_pid if isolation["uid_drop"] else 0
    limits["scratch_root"] = "/tmp" if isolation["mountns"] else _make_root()
    limits["scratch_tmpfs"], limits["pidns"] = isolation["mountns"], pidns
    # the same path for every execution (each gets a fresh dir there), so no result depends on the order
    limits["scratch"] = os.path.join(limits["scratch_root"], "x")
    os.chmod(limits["scratch_root"], 0o711)  # the program's uid may enter its own dir, not list others
    os.environ.clear()  # once here rather than in each child (~130 pages copied per fork)
    os.environ.update(child_env(limits["scratch"]))
    # inherited by every child, and irreversible; the worker itself never execs anything setuid
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    write_msg(proto_out, {"ready": True, "isolation": isolation, "scratch_root": limits["scratch_root"]})
    try:
        while (req := _read_msg(proto_in)) is not None:
            write_msg(proto_out, run_one(req["code"], req["timeout_s"], uid, limits))
    finally:
        if not isolation["mountns"]:
            _remove_scratch(limits["scratch_root"], False)


if __name__ == "__main__":
    main()
