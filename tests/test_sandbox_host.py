"""Hostile programs against the host: the threat model's filesystem, IPC, socket, network and kernel items
(docs/sandbox.md names the test of each). Every test runs one program, asserts its outcome, that the call
returned in time and that the host is untouched (`_run`); one whose mechanism depends on the host skips
where the pool's `isolation` says that mechanism is inactive (no root, namespaces refused, no libseccomp).
"""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib
import random
import socket
import sys
import sysconfig
import uuid

import pytest
from sandbox_helpers import REPO, SECRET, TIMEOUT, _needs, _run, execution_uids, make_pool

from projected_grpo.envs.coding import problem_bank
from projected_grpo.envs.coding.sandbox import DENIED_SYSCALLS, PACKAGE_ROOT
from projected_grpo.envs.coding.sandbox_isolation import DEV_LINKS, DEVICES, ETC_FILES, SYSTEM_DIRS
from projected_grpo.store import cache_root

ENOENT, ENOSYS = 2, 38


@pytest.fixture(scope="module")
def pool():
    yield from make_pool()


# --- writing outside the scratch dir ---------------------------------------------------------------------

# where a program could leave something behind on a host: world-writable dirs, the caller's, ours
HOST_DIRS = sorted({"/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/etc",
                    "/usr/local", "/", str(pathlib.Path.home()), os.getcwd(), str(REPO), sys.prefix,
                    sysconfig.get_paths()["purelib"], str(PACKAGE_ROOT / "projected_grpo"),
                    str(cache_root())})
MAKE_EVERYTHING = """import os, socket
made = []
for kind, make in (("file", lambda p: open(p, "x").close()), ("dir", os.mkdir), ("fifo", os.mkfifo),
                   ("symlink", lambda p: os.symlink("/", p)),
                   ("socket", lambda p: socket.socket(socket.AF_UNIX).bind(p))):
    try:
        make({base!r} + "-" + kind)
        made.append(kind)
    except OSError:
        pass
print(made)
"""


@pytest.mark.parametrize("where", HOST_DIRS)
def test_nothing_can_be_made_outside_scratch(pool, where):
    _needs(pool, "mountns")
    base = os.path.join(where, f"pgrpo-pwned-{uuid.uuid4().hex}")
    assert _run(pool, MAKE_EVERYTHING.format(base=base), "ok").stdout == "[]\n"
    assert glob.glob(base + "*") == []


def test_every_mount_but_the_scratch_dir_is_read_only(pool):
    # the whole writable surface: every mount a program sees is read-only but /proc (per-process files),
    # /tmp (root's, mode 0711: nothing can be made there) and its own scratch dir
    _needs(pool, "mountns")
    code = ("import os\nfor line in open('/proc/self/mountinfo'):\n    f = line.split()\n"
            "    print(f[4], f[5].split(',')[0])\n"
            "print(os.access('/tmp', os.W_OK), os.access('/proc', os.W_OK))\n")
    *mounts, access = _run(pool, code, "ok").stdout.splitlines()
    assert sorted(m for m, opt in map(str.split, mounts) if opt == "rw") == ["/proc", "/tmp", "/tmp/x"]
    assert access == "False False"


def test_modify_repo_file(pool):
    _needs(pool, "uid_drop")
    target = REPO / "pyproject.toml"
    before = target.read_bytes()
    _run(pool, f"open({str(target)!r}, 'a').write('pwned')\n", "error")
    assert target.read_bytes() == before


def test_write_home_env_lands_in_scratch(pool):
    r = _run(pool, "import os\nopen(os.path.expanduser('~/h.txt'), 'w').write('x')\n", "ok")
    assert r.files == {"h.txt": "x"} and not (pathlib.Path.home() / "h.txt").exists()


def test_symlink_to_host_file_not_returned(pool):
    r = _run(pool, "import os\nos.symlink('/etc/hosts', 'leak')\nos.symlink('/usr/bin/env', 'leak2')\n", "ok")
    assert r.files == {}


def test_hardlink_to_host_file(pool):
    r = _run(pool, "import os\nos.link('/etc/hosts', 'leak')\n", "error")
    assert r.files == {}


# --- reading the host ------------------------------------------------------------------------------------

READ_OR_LIST = """import os
p = {path!r}
try:
    print("LEAK", os.listdir(p) if os.path.isdir(p) else open(p, "rb").read(64))
except OSError as e:
    print(type(e).__name__)
"""
# the oracle's answer key (the built-in tests and reference solutions), our package and checkout, the
# cache, the caller's home, and host data a program has no business reading; those this host has
HOST_FILES = [p for p in (problem_bank.__file__, str(PACKAGE_ROOT / "projected_grpo"),
                          str(REPO / "pyproject.toml"), str(cache_root()),
                          str(pathlib.Path.home() / ".bashrc"), "/etc/shadow", "/etc/passwd", "/etc/hostname",
                          "/var/log", "/var/lib", "/opt", "/mnt", "/srv", "/home", "/boot", "/run",
                          "/sys/kernel")
              if os.path.exists(p)]


@pytest.mark.parametrize("path", HOST_FILES)
def test_host_file_unreadable(pool, path):
    _needs(pool, "mountns")
    r = _run(pool, READ_OR_LIST.format(path=path), "ok")
    assert r.stdout in ("FileNotFoundError\n", "PermissionError\n"), r.stdout


def test_data_file_elsewhere_unreadable(pool, tmp_path):
    # e.g. a LeetCode JSONL with the answers, wherever the user keeps it
    data = tmp_path / "leetcode.jsonl"
    data.write_text(f'{{"gt_answer": "{SECRET}"}}\n')
    _needs(pool, "mountns")
    r = _run(pool, READ_OR_LIST.format(path=str(data)), "ok")
    assert r.stdout == "FileNotFoundError\n"


def test_root_holds_only_what_programs_need(pool):
    _needs(pool, "mountns")
    code = "import os\nfor d in ('/', '/etc', '/dev'):\n    print(sorted(os.listdir(d)))\n"
    root, etc, dev = (eval(line) for line in _run(pool, code, "ok").stdout.splitlines())
    prefixes = {p.split("/")[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))}
    assert set(root) <= {d.strip("/") for d in SYSTEM_DIRS} | {"dev", "etc", "proc", "tmp"} | prefixes
    assert set(etc) <= set(ETC_FILES) and sorted(dev) == sorted([*DEVICES, *DEV_LINKS])


def test_this_package_is_hidden_the_standard_library_is_not(pool):
    code = ("import email.message, sqlite3\nprint('stdlib ok')\ntry:\n    import projected_grpo\n"
            "    print(projected_grpo.__path__)\nexcept ImportError as e:\n    print(type(e).__name__)\n")
    _needs(pool, "mountns")
    assert _run(pool, code, "ok").stdout == "stdlib ok\nModuleNotFoundError\n"


def test_other_executions_scratch_dirs_unreachable(pool):
    # two executions at once, on the two workers: the reader walks all it can of /tmp while the writer's
    # secret sits in the writer's scratch dir
    _needs(pool, "mountns")
    writer = f"import time\nopen('secret', 'w').write({SECRET!r})\ntime.sleep(1.0)\nprint('wrote')\n"
    reader = ("import os, time\ntime.sleep(0.3)\nfor root, dirs, files in os.walk('/tmp'):\n"
              "    for f in files:\n        print(open(os.path.join(root, f)).read())\nprint('read')\n")
    w, r = pool.map([writer, reader], 3.0)
    assert (w.status, w.stdout, r.status) == ("ok", "wrote\n", "ok")
    assert SECRET not in r.stdout and r.stdout.endswith("read\n")


def test_read_proc_1_environ(pool):
    _run(pool, "print(open('/proc/1/environ').read())\n", "error")


def test_read_parent_environ(pool):
    _needs(pool, "uid_drop")
    _run(pool, "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())\n", "error")


def test_no_secret_in_any_environ(pool):
    _needs(pool, "uid_drop")
    code = ("import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):\n    try:\n"
            "        print(open(f'/proc/{p}/environ').read())\n    except OSError:\n        pass\n")
    r = _run(pool, code, "ok")
    assert SECRET not in r.stdout and "PGRPO_TEST_SECRET" not in r.stdout


def test_sees_only_its_own_processes(pool):
    _needs(pool, "hidepid")
    code = ("import os\nuids = set()\nfor p in filter(str.isdigit, os.listdir('/proc')):\n"
            "    uids.add(os.stat(f'/proc/{p}').st_uid)\nprint(uids == {os.getuid()}, os.getpid() > 1)\n")
    assert _run(pool, code, "ok").stdout == "True True\n"


# --- IPC: System V, POSIX message queues and shared memory, keyrings -------------------------------------

SYSV_GET = {"shm": "shmget({key}, 4096, {flags})", "sem": "semget({key}, 1, {flags})",
            "msg": "msgget({key}, {flags})"}
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def _host_sysv_keys(kind: str) -> set[int]:
    return {int(row.split()[0]) for row in pathlib.Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]}


@pytest.mark.parametrize("kind", sorted(SYSV_GET))
def test_sysv_ipc_does_not_outlive_the_execution(pool, kind):
    # made with 0666 by one execution: not on the host, and gone before the next execution of any worker
    _needs(pool, "ipcns")
    key = random.randrange(1 << 20, 1 << 30)
    get = SYSV_GET[kind]
    made = _run(pool, LIBC + f"print(libc.{get.format(key=key, flags=0o1666)})\n", "ok")
    assert int(made.stdout) >= 0 and key not in _host_sysv_keys(kind)
    for _ in range(2 * pool.n_workers):  # idle workers are taken in turn: each worker runs it twice
        found = _run(pool, LIBC + f"print(libc.{get.format(key=key, flags=0)}, ctypes.get_errno())\n", "ok")
        assert found.stdout == f"-1 {ENOENT}\n"


def test_posix_message_queue_does_not_outlive_the_execution(pool):
    _needs(pool, "ipcns")
    name = f"/pgrpo-{uuid.uuid4().hex}".encode()
    rt = "import ctypes, os\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
    made = _run(pool, rt + f"print(rt.mq_open({name!r}, os.O_CREAT | os.O_RDWR, 0o666, None) >= 0)\n", "ok")
    assert made.stdout == "True\n"
    host_rt = ctypes.CDLL("librt.so.1", use_errno=True)
    assert host_rt.mq_open(name, os.O_RDONLY) == -1 and ctypes.get_errno() == ENOENT
    for _ in range(2 * pool.n_workers):
        found = _run(pool, rt + f"print(rt.mq_open({name!r}, os.O_RDWR), ctypes.get_errno())\n", "ok")
        assert found.stdout == f"-1 {ENOENT}\n"


def test_posix_shared_memory_unavailable(pool):
    _needs(pool, "mountns")
    name = f"pgrpo-{uuid.uuid4().hex}"
    code = ("from multiprocessing import shared_memory\n"
            f"shared_memory.SharedMemory({name!r}, create=True, size=16)\n")
    r = _run(pool, code, "error")
    assert "FileNotFoundError" in r.stderr and not os.path.exists(f"/dev/shm/{name}")


def _syscall_numbers(names) -> dict[str, int]:
    pyseccomp = pytest.importorskip("pyseccomp")
    return {n: pyseccomp.resolve_syscall(pyseccomp.system_arch(), n) for n in names}


def test_keyrings_denied(pool):
    # a uid's keyring outlives every process of that uid: the kernel keeps it, and the next execution of
    # the worker (same uid) would find what the last one stored
    _needs(pool, "seccomp")
    nr = _syscall_numbers(["add_key", "keyctl"])
    code = LIBC + (f"print(libc.syscall({nr['add_key']}, b'user', b'pgrpo', b'{SECRET}', {len(SECRET)}, -4),"
                   " ctypes.get_errno())\n"
                   f"print(libc.syscall({nr['keyctl']}, 0, -4, 1), ctypes.get_errno())\n")  # get @u, create
    assert _run(pool, code, "ok").stdout == f"-1 {ENOSYS}\n-1 {ENOSYS}\n"
    users = pathlib.Path("/proc/key-users").read_text() if os.path.exists("/proc/key-users") else ""
    assert not {int(line.split(":")[0]) for line in users.splitlines()} & set(execution_uids(pool))


# --- sockets and the network -----------------------------------------------------------------------------

def test_abstract_unix_socket_to_host(pool):
    # abstract socket names belong to the network namespace: the host's are out of reach
    _needs(pool, "netns")
    name = f"\0pgrpo-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen()
        listener.setblocking(False)
        r = _run(pool, f"import socket\nsocket.socket(socket.AF_UNIX).connect({name!r})\n", "error")
        assert "ConnectionRefusedError" in r.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@pytest.mark.parametrize("where", [d for d in ("/tmp", "/dev/shm", "/run", "/var/tmp") if os.path.isdir(d)])
def test_filesystem_unix_socket_to_host(pool, where):
    # a host listener any uid may connect to (mode 0777), in a dir any uid can reach
    _needs(pool, "mountns")
    path = f"{where}/pgrpo-{uuid.uuid4().hex}.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        try:
            os.chmod(path, 0o777)
            listener.listen()
            listener.setblocking(False)
            r = _run(pool, f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\n", "error")
            assert "FileNotFoundError" in r.stderr
            with pytest.raises(BlockingIOError):
                listener.accept()
        finally:
            os.unlink(path)


def test_connect_loopback(pool):
    _needs(pool, "netns")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        _run(pool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n", "error")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_connect_external(pool):
    _needs(pool, "netns")
    r = _run(pool, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)\n", "error")
    assert "unreachable" in r.stderr


# --- the kernel ------------------------------------------------------------------------------------------

# first arguments that succeed (or fail otherwise than ENOSYS) where the syscall is allowed
FIRST_ARG = {"unshare": 0, "keyctl": 0, "clone": 0x10000000 | 17}  # clone: CLONE_NEWUSER | SIGCHLD


@pytest.mark.parametrize("name", [*DENIED_SYSCALLS, "clone"])
def test_denied_syscalls(pool, name):
    _needs(pool, "seccomp")
    nr = _syscall_numbers([name])[name]
    code = LIBC + (f"r = libc.syscall({nr}, {FIRST_ARG.get(name, 0)}, 0, 0, 0, 0)\n"
                   f"if r == 0 and {name == 'clone'}:  # the clone child, had it been allowed\n"
                   "    os._exit(0)\nprint(r, ctypes.get_errno())\n")
    assert _run(pool, code, "ok").stdout == f"-1 {ENOSYS}\n"


def test_threads_and_forks_still_work_under_seccomp(pool):
    # clone3 is denied: libc must fall back to clone for threads, and fork's clone has no namespace flag
    code = ("import os, threading\n"
            "t = threading.Thread(target=print, args=('thread',), kwargs={'flush': True})\nt.start()\n"
            "t.join()\npid = os.fork()\nif pid == 0:\n    print('child', flush=True)\n    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print([l.split()[1] for l in open('/proc/self/status') if 'Seccomp:' in l])\n")
    out = _run(pool, code, "ok", timeout_s=TIMEOUT * 2).stdout
    mode = "2" if pool.isolation["seccomp"] else "0"  # 2: a filter is loaded
    assert out == f"thread\nchild\n['{mode}']\n"
