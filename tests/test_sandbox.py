"""Adversarial tests of the sandbox: one hostile program per behaviour, then normal programs.

Every hostile test asserts the status, that the call returned within its time bound, and that the host
is untouched (`_assert_host_clean`: no process of any execution is left, the workers are the same
live processes, the files it aimed at do not exist or are unchanged). Isolation-dependent tests skip
where the pool reports that protection inactive (not root, namespaces refused).
"""

from __future__ import annotations

import pathlib
import socket
import uuid

import pytest
from sandbox_helpers import (
    REPO,
    SECRET,
    TIMEOUT,
    _needs,
    _run,
    make_pool,
)


@pytest.fixture(scope="module")
def pool():
    yield from make_pool()

# --- resource exhaustion -------------------------------------------------------------------------------

def test_fork_bomb(pool):
    r = _run(pool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
             "timeout")
    assert r.exit_code is None


def test_memory_bomb_one_allocation(pool):
    r = _run(pool, "x = bytearray(8 << 30)\n", "memory")
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_memory_bomb_gradual(pool):
    # touching ~256 MiB of pages takes a while on a contended box: a longer timeout here
    _run(pool, "a = []\nwhile True:\n    a.append(bytearray(16 << 20))\n", "memory", timeout_s=4.0)


def test_infinite_loop(pool):
    r = _run(pool, "while True:\n    pass\n", "timeout")
    assert r.duration_s >= TIMEOUT


def test_sleep_past_timeout(pool):
    _run(pool, "import time\ntime.sleep(100)\n", "timeout")


def test_deadline_before_the_program_starts(pool):
    # a deadline that passes while the child is still confining itself (before it drops to the
    # execution's uid, out of reach of the uid-wide kill): the child is killed directly
    for _ in range(5):
        _run(pool, "import time\ntime.sleep(100)\n", "timeout", timeout_s=1e-4)


def test_busy_loop_in_thread(pool):
    # the main thread returns at once, but a non-daemon thread keeps the program alive (as in CPython)
    _run(pool, "import threading\nthreading.Thread(target=lambda: any(iter(int, 1))).start()\n",
         "timeout")


def test_busy_threads_hit_cpu_limit(pool):
    # 4 spinning threads burn CPU seconds faster than wall seconds: RLIMIT_CPU or the wall clock ends it
    code = ("import threading\nfor _ in range(4):\n"
            "    threading.Thread(target=lambda: any(iter(int, 1))).start()\n")
    _run(pool, code, "timeout")


def test_deep_recursion(pool):
    r = _run(pool, "def f(n):\n    return f(n + 1)\nf(0)\n", "error")
    assert "RecursionError" in r.stderr


def test_deep_recursion_past_c_stack(pool):
    # with the recursion limit lifted, recursion through a C slot (repr) overflows the C stack: SIGSEGV
    code = ("import sys\nsys.setrecursionlimit(10**8)\nclass A:\n    def __repr__(self):\n"
            "        return repr(self)\nrepr(A())\n")
    assert _run(pool, code, "killed").exit_code == -11


def test_file_size_limit(pool):
    r = _run(pool, "with open('big', 'wb') as f:\n    f.write(b'x' * (50 << 20))\n", "error")
    assert "File too large" in r.stderr and len(r.files["big"]) <= pool.limits.output_bytes


def test_many_files_capped(pool):
    r = _run(pool, "for i in range(200):\n    open(f'f{i:03d}', 'w').write(str(i))\n", "ok")
    assert len(r.files) == pool.limits.max_files and r.files["f000"] == "0"


def test_deeply_nested_dirs(pool):
    # deeper than any recursive walk of the scratch dir could go: the worker must survive it
    code = "import os\nfor _ in range(3000):\n    os.mkdir('a')\n    os.chdir('a')\nopen('f', 'w')\n"
    assert _run(pool, code, "ok").files == {}


def test_disk_bomb(pool):
    _needs(pool, "mountns")  # each execution's scratch is its own 64 MiB tmpfs
    code = "for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
    r = _run(pool, code, "error", timeout_s=3.0)
    assert "No space left on device" in r.stderr


def test_open_files_limit(pool):
    r = _run(pool, "fs = [open('f', 'w') for _ in range(100000)]\n", "error")
    assert "Too many open files" in r.stderr


# --- the host's files and environment -------------------------------------------------------------------

def test_write_tmp(pool):
    _needs(pool, "mountns")
    target = pathlib.Path(f"/tmp/pgrpo-pwned-{uuid.uuid4().hex}")
    _run(pool, f"open({str(target)!r}, 'w').write('x')\n", "error")
    assert not target.exists()


def test_write_home(pool):
    _needs(pool, "uid_drop")
    target = pathlib.Path.home() / f"pgrpo-pwned-{uuid.uuid4().hex}"
    _run(pool, f"open({str(target)!r}, 'w').write('x')\n", "error")
    assert not target.exists()


def test_write_home_env_lands_in_scratch(pool):
    r = _run(pool, "import os\nopen(os.path.expanduser('~/h.txt'), 'w').write('x')\n", "ok")
    assert r.files == {"h.txt": "x"} and not (pathlib.Path.home() / "h.txt").exists()


def test_write_repo(pool):
    _needs(pool, "uid_drop")
    target = REPO / f"pwned-{uuid.uuid4().hex}.txt"
    _run(pool, f"open({str(target)!r}, 'w').write('x')\n", "error")
    assert not target.exists()


def test_modify_repo_file(pool):
    _needs(pool, "uid_drop")
    target = REPO / "pyproject.toml"
    before = target.read_bytes()
    _run(pool, f"open({str(target)!r}, 'a').write('pwned')\n", "error")
    assert target.read_bytes() == before


def test_read_etc_shadow(pool):
    r = _run(pool, "print(open('/etc/shadow').read())\n", "error")
    assert "root:" not in r.stdout


def test_read_repo_file(pool):
    _needs(pool, "mountns")
    r = _run(pool, f"print(open({str(REPO / 'pyproject.toml')!r}).read())\n", "error")
    assert "[project]" not in r.stdout


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


def test_symlink_to_host_file_not_returned(pool):
    r = _run(pool, "import os\nos.symlink('/etc/shadow', 'leak')\nos.symlink('/etc/passwd', 'leak2')\n", "ok")
    assert r.files == {}


def test_hardlink_to_host_file(pool):
    r = _run(pool, "import os\nos.link('/etc/shadow', 'leak')\n", "error")
    assert r.files == {}


# --- network ---------------------------------------------------------------------------------------------

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


# --- processes and signals -------------------------------------------------------------------------------

def test_kill_parent(pool):
    _needs(pool, "uid_drop")
    r = _run(pool, "import os\nos.kill(os.getppid(), 9)\n", "error")
    assert "PermissionError" in r.stderr


def test_kill_process_group(pool):
    r = _run(pool, "import os\nos.killpg(0, 9)\n", "killed")
    assert r.exit_code == -9


def test_kill_everything(pool):
    # kill(-1) reaches only processes of the program's own uid: the caller, the worker and its fork
    # template (root, EPERM) are spared, so the program survives its own signal and so does the pool
    _needs(pool, "uid_drop")
    assert _run(pool, "import os\nos.kill(-1, 9)\nprint('survived')\n", "ok").stdout == "survived\n"


def test_setsid_child_outlives(pool):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('parent done')\n"
    r = _run(pool, code, "ok")
    assert r.stdout == "parent done\n" and r.duration_s < TIMEOUT


def test_daemonised_grandchild(pool):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.close(1)\n        os.close(2)\n        time.sleep(100)\n    os._exit(0)\n")
    _run(pool, code, "ok")


def test_daemon_thread_outlives(pool):
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n"
    r = _run(pool, code, "ok")
    assert r.duration_s < TIMEOUT


def test_ignore_signals(pool):
    code = ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
            "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n")
    _run(pool, code, "timeout")


def test_close_stdio(pool):
    r = _run(pool, "import os\nprint('before', flush=True)\nos.close(0)\nos.close(1)\nos.close(2)\n", "ok")
    assert r.stdout == "before\n"


def test_flood_stdout_and_stderr(pool):
    code = "import sys\nb = 'x' * 65536\nwhile True:\n    sys.stdout.write(b)\n    sys.stderr.write(b)\n"
    r = _run(pool, code, "timeout")
    assert len(r.stdout) == len(r.stderr) == pool.limits.output_bytes


def test_gigabyte_of_output_then_exit(pool):
    code = "import os\nb = b'y' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, b)\n"
    r = _run(pool, code, "ok", timeout_s=5.0)
    assert r.stdout == "y" * pool.limits.output_bytes


def test_setuid_root(pool):
    _needs(pool, "uid_drop")
    _run(pool, "import os\nos.setuid(0)\n", "error")


def test_segfault(pool):
    r = _run(pool, "import ctypes\nctypes.string_at(0)\n", "killed")
    assert r.exit_code == -11


def test_abort(pool):
    r = _run(pool, "import os\nos.abort()\n", "killed")
    assert r.exit_code == -6


@pytest.mark.parametrize(("arg", "status", "exit_code"), [
    ("", "ok", 0), ("None", "ok", 0), ("0", "ok", 0), ("1", "error", 1), ("3", "error", 3),
    ("255", "error", 255), ("256", "ok", 0), ("-1", "error", 255), ("'bye'", "error", 1),
    ("True", "error", 1)])
def test_sys_exit(pool, arg, status, exit_code):
    r = _run(pool, f"import sys\nprint('x')\nsys.exit({arg})\n", status)
    assert r.exit_code == exit_code and r.stdout == "x\n"


@pytest.mark.parametrize(("code", "status"), [(0, "ok"), (7, "error"), (255, "error")])
def test_os_exit(pool, code, status):
    r = _run(pool, f"import os\nos._exit({code})\n", status)
    assert r.exit_code == code


