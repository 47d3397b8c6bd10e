"""Fork-server worker of the sandbox: one long-lived process per pool slot, one fresh child per execution.

Started by `sandbox.SandboxPool` as `python -s -P path/to/sandbox_worker.py CONFIG_JSON` (stdlib only, so
no package `__init__` can bloat the template). It isolates itself (a pid namespace here; network, IPC and
mount namespaces and the minimal root in sandbox_isolation.py; docs/sandbox.md is the threat model),
forks the fork template (`sandbox_template.py`: the imports programs commonly use, done once; it does
nothing but fork) and loops: read a request (length-prefixed JSON on fd `proto_in`), make a fresh
scratch dir holding the program as main.py, have the template fork a child that drops its privileges
and runs it, collect its output, kill every process the execution left and remove what it made in IPC,
reply with the result (length-prefixed JSON on fd `proto_out`). Neither process ever runs untrusted
code, so nothing a program does persists into the next execution.
"""

from __future__ import annotations

import base64
import ctypes
import importlib.util
import json
import math
import os
import select
import shutil
import signal
import stat
import struct
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV = 2, 4
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
UID_BASE = 1_900_000_000  # + worker pid: a uid no other live worker (or real user) has
MEMORY_TAG = b"M"
MAX_DEPTH = 8  # directory levels searched for returned files
SCRATCH_BYTES = 64 << 20  # size of each execution's scratch tmpfs (where mount namespaces work)
MNT_DETACH = 2


def child_env(scratch: str) -> dict[str, str]:
    """The whole environment of a program (the worker adopts it, so a child inherits it untouched)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0"}


def load_sibling(name: str):
    """A module from beside this file (this script runs with -P: its dir is not on sys.path), loaded
    before isolation hides the directory it is in."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_pg_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


iso = load_sibling("sandbox_isolation")


def _leftovers(template: int) -> list[int]:
    """Live and zombie children of this (subreaper) worker other than the template: every process an
    execution left behind (orphans reparent here when their parents die)."""
    return [int(p) for p in iso.read_proc("/proc/thread-self/children").split() if int(p) != template]


def _sweep(uid: int, child: int | None, template: int) -> None:
    """SIGKILL every process of the execution and reap them all (the template reaps `child` itself).

    `child` (the template's child, None once reaped) is killed directly, in case it has not yet dropped
    to the execution's uid. With a per-worker uid, one `kill(-1)` from a helper running as that uid
    reaches exactly the execution's processes, whatever session or group they moved to; the kernel
    holds the task list for the whole pass, so a fork bomb cannot add a process behind it. Orphans
    reparent to this subreaper worker, so reaping until only the template is left leaves nothing
    behind. Without root, the subreaper's children are killed until none is left.
    """
    if child is not None:
        for kill in (os.killpg, os.kill):  # the child is its own session and group leader (setsid)
            try:
                kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if uid:
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        while kids := _leftovers(template):  # all SIGKILLed (or the helper, exiting): each wait is short
            for pid in kids:
                os.waitpid(pid, 0)
        return
    while kids := _leftovers(template):
        for pid in kids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            os.waitpid(pid, os.WNOHANG)
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
        iso.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={SCRATCH_BYTES},nr_inodes=4096,mode=0700,uid={uid},gid={uid}")
    elif uid:
        os.chown(path, uid, uid)


def _remove_scratch(path: str, tmpfs: bool) -> None:
    """Remove a scratch dir whatever the program left in it (a lazy unmount drops a tmpfs at once)."""
    if tmpfs:
        iso.check(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
        os.rmdir(path)
        return
    try:
        shutil.rmtree(path)
    except RecursionError:  # nested deeper than shutil can recurse
        import subprocess
        subprocess.run(["rm", "-rf", "--one-file-system", path], check=True)


class Template:
    """This worker's side of the fork template: its pid and the pipes to it and to its children."""

    def __init__(self, module, limits: dict, proto_fds: tuple[int, int], seccomp: bytes | None):
        """Fork the template process running `module` (sandbox_template, loaded before isolation hid
        its file); after isolation, so that it inherits the namespaces and the environment. It loads the
        `seccomp` filter (a BPF program) first, so that every child inherits it."""
        (self.out, out_w), (self.err, err_w), (self.tag, tag_w) = os.pipe(), os.pipe(), os.pipe()
        ctl_r, self.ctl = os.pipe()
        self.rep, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                for fd in (*proto_fds, self.out, self.err, self.tag, self.ctl, self.rep):
                    os.close(fd)  # so that each side sees EOF when the other dies
                if not limits["pidns"]:  # in a pid namespace the worker's death kills us anyway
                    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if seccomp is not None:
                    iso.load_seccomp(seccomp)
                module.serve(limits, ctl_r, rep_w, (out_w, err_w, tag_w))
            except BaseException:
                sys.excepthook(*sys.exc_info())  # on the worker's stderr, then exit: the worker raises
            finally:
                os._exit(1)
        for fd in (out_w, err_w, tag_w, ctl_r, rep_w):
            os.close(fd)
        for fd in (self.out, self.err, self.tag):  # the template keeps their write ends: never EOF
            os.set_blocking(fd, False)
        if self.recv() != b"R":
            raise RuntimeError("sandbox template died while starting (its traceback is on stderr)")

    def recv(self, n: int = 1) -> bytes:
        if (data := _read_exact(self.rep, n)) is None:
            raise RuntimeError("sandbox template died")
        return data


def run_one(code: str, timeout_s: float, limits: dict, tpl: Template) -> dict:
    """Run one program in a fresh child with a fresh scratch dir; return the result fields."""
    scratch, uid, cap = limits["scratch"], limits["uid"], limits["output_bytes"]
    _make_scratch(scratch, uid, limits["scratch_tmpfs"])
    fd = os.open(os.path.join(scratch, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    view = memoryview(code.encode("utf-8", "surrogateescape"))
    while view:
        view = view[os.write(fd, view):]
    os.close(fd)
    t0 = time.monotonic()
    os.write(tpl.ctl, struct.pack("<d", timeout_s))
    child: int | None = struct.unpack("<i", tpl.recv(4))[0]
    bufs = {tpl.out: bytearray(), tpl.err: bytearray(), tpl.tag: bytearray()}

    def drain(fd: int) -> None:
        """Read what is there now (beyond the cap: read and discard, so the writer never blocks)."""
        try:
            while data := os.read(fd, 1 << 16):
                if len(bufs[fd]) < cap:
                    bufs[fd] += data[: cap - len(bufs[fd])]
        except BlockingIOError:
            pass

    # select.poll rather than selectors: fewer objects and pages touched per execution
    poller = select.poll()
    for fd in (*bufs, tpl.rep):
        poller.register(fd, select.POLLIN)
    deadline, wait_status, timed_out = t0 + timeout_s, None, False
    while wait_status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(math.ceil(left * 1000)):  # ms, rounded up: never wakes early forever
            if fd == tpl.rep:
                wait_status, child = struct.unpack("<i", tpl.recv(4))[0], None
            else:
                drain(fd)
    duration = time.monotonic() - t0
    if timed_out or _leftovers(tpl.pid):
        _sweep(uid, child, tpl.pid)
        if wait_status is None:  # the template reaps its child, dead now
            wait_status = struct.unpack("<i", tpl.recv(4))[0]
            _sweep(uid, None, tpl.pid)  # again: the child's own children reparented here as it died
    for fd in bufs:  # every writer is dead now, so all they wrote is in the pipes
        drain(fd)
    if limits["ipcns"]:  # every process of the execution is gone: what it made in IPC goes too
        iso.sweep_ipc(limits["mq_dir"])
    files = _read_files(scratch, uid, limits)
    _remove_scratch(scratch, limits["scratch_tmpfs"])
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
    exit_code = -sig if sig else os.WEXITSTATUS(wait_status)
    if timed_out or sig == signal.SIGXCPU:  # SIGXCPU: RLIMIT_CPU, reached early by busy threads
        status = "timeout"
    elif bufs[tpl.tag] == MEMORY_TAG:
        status = "memory"
    elif sig:
        status = "killed"
    else:
        status = "ok" if exit_code == 0 else "error"
    return {"status": status, "exit_code": None if timed_out else exit_code,
            "stdout": bufs[tpl.out].decode("utf-8", "replace"),
            "stderr": bufs[tpl.err].decode("utf-8", "replace"), "files": files, "duration_s": duration}


def _read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from fd, or None at EOF (the other side closed or died)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
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
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


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
    iso.check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    keep = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable))]
    module = load_sibling("sandbox_template")  # before isolation, which hides the directory it is in
    got, limits["mq_dir"] = iso.isolate(limits["hide"], keep, limits["isolate"])
    seccomp = base64.b64decode(limits["seccomp"]) if limits["seccomp"] else None
    isolation = {**got, "pidns": pidns, "seccomp": seccomp is not None}
    limits["ipcns"] = isolation["ipcns"]
    limits["uid"] = UID_BASE + outer_pid if isolation["uid_drop"] else 0
    limits["scratch_root"] = "/tmp" if isolation["mountns"] else _make_root()
    limits["scratch_tmpfs"], limits["pidns"] = isolation["mountns"], pidns
    # the same path for every execution (each gets a fresh dir there), so no result depends on the order
    limits["scratch"] = os.path.join(limits["scratch_root"], "x")
    os.chmod(limits["scratch_root"], 0o711)  # the program's uid may enter its own dir, not list others
    os.environ.clear()  # here, so that the template and every child inherit it untouched
    os.environ.update(child_env(limits["scratch"]))
    # inherited by the template and every child, and irreversible; nothing here execs anything setuid
    iso.check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    try:
        tpl = Template(module, limits, (proto_in, proto_out), seccomp)
        write_msg(proto_out, {"ready": True, "isolation": isolation, "scratch_root": limits["scratch_root"]})
        while (req := _read_msg(proto_in)) is not None:
            write_msg(proto_out, run_one(req["code"], req["timeout_s"], limits, tpl))
        os.close(tpl.ctl)  # EOF: the template exits; reaped here, so its CPU time is accounted
        os.waitpid(tpl.pid, 0)
    finally:
        if not isolation["mountns"]:
            _remove_scratch(limits["scratch_root"], False)


if __name__ == "__main__":
    main()
