"""Adversarial tests of the sandbox, one hostile program per behaviour: resources, processes and signals
(the threat model's process items, docs/sandbox.md; its filesystem, IPC, socket, network and kernel items
are in test_sandbox_host.py).

Every hostile test asserts the status, that the call returned within its time bound, and that the host
is untouched (`_assert_host_clean`: no process of any execution is left, the workers are the same
live processes). Isolation-dependent tests skip where the pool reports that protection inactive (not
root, namespaces refused).
"""

from __future__ import annotations

import pytest
from sandbox_helpers import TIMEOUT, _needs, _run, make_pool


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


# --- processes and signals -------------------------------------------------------------------------------

# the fork template, and the worker (pid 1 of its pid namespace)
@pytest.mark.parametrize("target", ["os.getppid()", "1"])
def test_kill_parent(pool, target):
    _needs(pool, "uid_drop")
    r = _run(pool, f"import os\nos.kill({target}, 9)\n", "error")
    assert "PermissionError" in r.stderr


def test_ptrace_or_read_memory_of_any_other_process(pool):
    # its template, its worker, and whatever else it can name: attach and /proc/<pid>/mem both refused
    _needs(pool, "uid_drop")
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ngot = []\n"
            "pids = {os.getppid(), 1} | {int(p) for p in os.listdir('/proc') if p.isdigit()}\n"
            "pids.discard(os.getpid())\n"
            "for pid in sorted(pids):\n    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH\n"
            "        got.append(('attached', pid))\n    try:\n        open(f'/proc/{pid}/mem', 'rb')\n"
            "        got.append(('mem', pid))\n    except OSError:\n        pass\nprint(got)\n")
    assert _run(pool, code, "ok").stdout == "[]\n"


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


def test_sleep_after_closing_stdout(pool):
    _run(pool, "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(100)\n", "timeout")


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


