"""A sandbox worker's isolation: its namespaces, the minimal read-only root its programs see, the seccomp
filter its fork template loads, and the sweep of what an execution leaves in its IPC namespace.

docs/sandbox.md is the threat model: each threat, the mechanism here (or in sandbox_worker.py /
sandbox_template.py) that covers it, and the test that shows it. Loaded by sandbox_worker.py from this
file's path, like sandbox_template.py, and stdlib only: the fork template is a fork of the worker, so
whatever the worker imports, every child carries. Everything here runs as root in the worker (or in the
template before it serves); no program ever runs any of it.
"""

from __future__ import annotations

import ctypes
import os
import stat

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH, IPC_RMID, MSG_INFO, SHM_INFO, SEM_INFO = 2, 0, 12, 14, 19
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

# The whole root a program sees (everything else on the host is absent, not just unreadable): these
# system dirs, read-only (or the same symlinks, on a merged-/usr system); an /etc holding copies of only
# the files the standard library reads there (the dynamic loader's cache, the time zone, name lookup);
# a /dev of these devices; /proc (own processes only); /tmp, holding only the scratch dir; and the
# Python installation, read-only, less the hidden paths inside it (this package, its cache, ...).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "localtime", "nsswitch.conf", "hosts")
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
NEW_ROOT = "/tmp"  # a tmpfs mounted over /tmp in this mount namespace only: nothing is made on the host


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(_libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None), f"mount {src} on {dst}")


def isolate(hide: list[str], keep: list[str], enabled: bool) -> tuple[dict[str, bool], int | None]:
    """Put this worker in its own network, IPC and mount namespaces (root only), and make the minimal
    root its own; return what worked, and a directory descriptor of this IPC namespace's POSIX message
    queues for `sweep_ipc` (None where there is none).

    Network: a fresh namespace has only `lo`, and it is down: no connection (loopback included), and
    its own abstract unix socket names. IPC: System V objects and POSIX message queues made here are
    invisible to the host and die with the worker; `sweep_ipc` removes them after each execution.
    """
    got = {"uid_drop": enabled and os.geteuid() == 0, "netns": False, "ipcns": False, "mountns": False,
           "hidepid": False}
    if not got["uid_drop"]:
        return got, None
    got["netns"] = _libc.unshare(CLONE_NEWNET) == 0
    got["ipcns"] = _libc.unshare(CLONE_NEWIPC) == 0
    if _libc.unshare(CLONE_NEWNS) != 0:
        return got, None
    got["hidepid"] = enter_root(hide, keep)
    got["mountns"] = True
    return got, _mqueue_dir() if got["ipcns"] else None


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _bind_ro(src: str, dst: str) -> None:
    """Bind `src` at `dst` read-only (not recursively: a mount below `src` shows its empty mount point)."""
    mount(src, dst, None, MS_BIND)
    mount("none", dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_root(hide: list[str], keep: list[str]) -> bool:
    """Make a fresh tmpfs the root of this mount namespace, holding only SYSTEM_DIRS, ETC_FILES, DEVICES,
    /proc, /tmp and the `keep` dirs (the Python installation), all read-only but /tmp; the `hide` paths
    that fall inside them are covered by empty read-only tmpfs, except one holding a `keep` dir or the
    standard library (it cannot be hidden from the interpreter that needs it). pivot_root then drops the
    host's tree from this namespace altogether. Returns whether /proc has hidepid=2.

    The new root is built on a tmpfs over /tmp, which covers whatever the host keeps there (a checkout
    and its venv may well be in /tmp): everything about the host is read first, and each bind's source
    is held open and bound through /proc/self/fd.
    """
    real_keep = sorted({os.path.realpath(k) for k in keep if os.path.isdir(k)}, key=len)
    binds = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    binds += [k for k in real_keep if not any(_within(k, b) for b in binds)]  # shallowest first
    # merged-/usr symlinks (/bin -> usr/bin), and a prefix reached through a symlink: the same link
    links = {d: os.readlink(d) for d in SYSTEM_DIRS if os.path.islink(d)}
    links |= {k: os.path.realpath(k) for k in keep if os.path.isdir(k) and os.path.realpath(k) != k}
    needed = real_keep + [os.path.dirname(os.path.realpath(os.__file__))]
    hidden = [h for h in sorted({os.path.realpath(h) for h in hide if os.path.isdir(h)})
              if any(_within(h, b) for b in binds) and not any(_within(n, h) for n in needed)]
    etc = {}
    for name in ETC_FILES:
        src = f"/etc/{name}"
        if os.path.islink(src):
            etc[name] = os.readlink(src)
        elif os.path.isfile(src):
            with open(src, "rb") as f:
                etc[name] = f.read()
    sources = {b: os.open(b, os.O_RDONLY | os.O_DIRECTORY) for b in binds}

    mount("none", "/", None, MS_REC | MS_PRIVATE)
    new = NEW_ROOT
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.mkdir(new + "/tmp")  # first: a bind below /tmp (a venv there) must lie on it, not under it
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=64,mode=0711")
    for b, fd in sources.items():
        os.makedirs(new + b, exist_ok=True)
        _bind_ro(f"/proc/self/fd/{fd}", new + b)
        os.close(fd)
    for path, target in links.items():
        if not os.path.lexists(new + path):  # not already visible through a bind
            os.makedirs(os.path.dirname(new + path), exist_ok=True)
            os.symlink(target, new + path)
    for h in hidden:
        mount("tmpfs", new + h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    os.mkdir(new + "/etc")
    for name, content in etc.items():
        if isinstance(content, str):
            os.symlink(content, f"{new}/etc/{name}")
        else:
            with open(f"{new}/etc/{name}", "wb") as f:
                f.write(content)
            os.chmod(f"{new}/etc/{name}", 0o644)
    os.mkdir(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"{new}/dev/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(f"{new}/dev/{name}", 0o666)  # mknod's mode is masked by the umask
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{new}/dev/{name}")
    mount("none", new + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(new + "/proc")
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    hidepid = _libc.mount(b"proc", f"{new}/proc".encode(), b"proc", flags, b"hidepid=2") == 0
    if not hidepid:  # a kernel without the option: still only this pid namespace's processes
        mount("proc", new + "/proc", "proc", flags)
    os.chdir(new)
    check(_libc.pivot_root(b".", b"."), "pivot_root")  # the old root now lies over the new one ...
    check(_libc.umount2(b".", MNT_DETACH), "umount the host's root")  # ... and leaves this namespace
    os.chdir("/")
    mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return hidepid


def _mqueue_dir() -> int | None:
    """A descriptor of this IPC namespace's message-queue directory, mounted only long enough to open it
    (programs never see it); None where the kernel has no POSIX message queues."""
    path = "/tmp/.mqueue"
    os.mkdir(path, 0o700)
    try:
        if _libc.mount(b"mqueue", path.encode(), b"mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        check(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
        return fd
    finally:
        os.rmdir(path)


def sweep_ipc(mq_dir: int | None) -> None:
    """Remove every System V object and POSIX message queue in this worker's IPC namespace. All of them
    are the last execution's (the namespace is the worker's own), and the next one must not find them.
    Each kind is listed only when a count says it is there: ~10 us per execution instead of ~60."""
    for kind in _sysv_kinds_in_use():
        for ident in _sysv_ids(kind):
            ret = _libc.semctl(ident, 0, IPC_RMID) if kind == "sem" else getattr(_libc, f"{kind}ctl")(
                ident, IPC_RMID, None)
            check(ret, f"{kind}ctl({ident}, IPC_RMID)")
    if mq_dir is not None and os.fstat(mq_dir).st_size:  # the mqueue fs counts its queues in the size
        for name in os.listdir(mq_dir):
            os.unlink(name, dir_fd=mq_dir)


_INFO = (ctypes.c_int * 32)()  # room for struct shm_info, msginfo or seminfo


def _sysv_kinds_in_use() -> list[str]:
    """The System V kinds (shm, msg, sem) this IPC namespace holds objects of. A *_INFO call fills a
    struct whose field used_ids (shm_info's first int), msgpool (msginfo's first) or semusz (seminfo's
    eighth) counts them."""
    kinds = []
    for kind, call, field in (("shm", lambda: _libc.shmctl(0, SHM_INFO, _INFO), 0),
                              ("msg", lambda: _libc.msgctl(0, MSG_INFO, _INFO), 0),
                              ("sem", lambda: _libc.semctl(0, 0, SEM_INFO, _INFO), 7)):
        if call() < 0:
            check(-1, f"{kind}ctl(*_INFO)")
        if _INFO[field]:
            kinds.append(kind)
    return kinds


def read_proc(path: str) -> bytes:
    """The whole of a /proc file, read with os.open/os.read rather than open(): far fewer pages touched in a
    forked worker (docs/benchmarks.md, "Sandbox throughput")."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data, chunk = b"", b"-"
        while chunk:
            chunk = os.read(fd, 1 << 16)
            data += chunk
    finally:
        os.close(fd)
    return data


def _sysv_ids(kind: str) -> list[int]:
    """Ids of this IPC namespace's System V objects of `kind` (shm, msg, sem): /proc/sysvipc shows the
    reader's own namespace."""
    return [int(row.split()[1]) for row in read_proc(f"/proc/sysvipc/{kind}").splitlines()[1:]]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(bpf: bytes) -> None:
    """Load a seccomp BPF program (built by the pool: sandbox.seccomp_program) into this process; every
    process it forks inherits it, and no process can remove it. no_new_privs is already set."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")
