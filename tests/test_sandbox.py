"""Adversarial tests of the sandbox: one hostile program per behaviour, then normal programs.

Every hostile test asserts the status, that the call returned within its time bound, and that the host
is untouched (`_assert_host_clean`: no process of any execution is left, the workers are the same
live processes, the files it aimed at do not exist or are unchanged). Isolation-dependent tests skip
where the pool reports that protection inactive (not root, namespaces refused).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.envs.coding.sandbox import ExecutionResult, Limits, SandboxPool, _Worker, run_program
from projected_grpo.envs.coding.sandbox_worker import UID_BASE

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 1.0
SLACK = 2.0  # a contended 2-core box: the call may return this long after its timeout
SECRET = f"pgrpo-secret-{uuid.uuid4().hex}"
os.environ["PGRPO_TEST_SECRET"] = SECRET  # set before the pool starts: must never reach a program


@pytest.fixture(scope="module")
def pool():
    # a 256 MiB address space: the gradual memory bomb then touches 4x fewer pages than the 1 GiB default
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


def _assert_host_clean(pool: SandboxPool) -> None:
    assert _processes_of(pool.execution_uids()) == []
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


# --- normal programs ------------------------------------------------------------------------------------

def test_stdout_stderr_exit_code(pool):
    r = _run(pool, "import sys\nprint('héllo')\nprint('warn', file=sys.stderr)\n", "ok")
    assert (r.stdout, r.stderr, r.exit_code) == ("héllo\n", "warn\n", 0)


def test_exception_is_error(pool):
    r = _run(pool, "def f():\n    raise ValueError('boom')\nf()\n", "error")
    assert r.exit_code == 1 and 'File "main.py", line 2' in r.stderr and "ValueError: boom" in r.stderr
    assert "sandbox_worker" not in r.stderr


def test_syntax_error(pool):
    r = _run(pool, "def f(:\n", "error")
    assert "SyntaxError" in r.stderr


def test_stdin_is_empty(pool):
    r = _run(pool, "input()\n", "error")
    assert "EOFError" in r.stderr


def test_files_returned(pool):
    code = "import os\nos.mkdir('d')\nopen('d/b.txt', 'w').write('B')\nopen('a.txt', 'w').write('A')\n"
    r = _run(pool, code, "ok")
    assert r.files == {"a.txt": "A", "d/b.txt": "B"}


def test_leetcode_style_solution(pool):
    code = ("from typing import *\nfrom collections import *\nclass Solution:\n"
            "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n"
            "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n"
            "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]\nprint('PASS')\n")
    assert _run(pool, code, "ok").stdout == "PASS\n"


def test_next_execution_starts_clean(pool):
    first = ("import os, sys, builtins\nopen('state', 'w').write('1')\nos.environ['LEAK'] = '1'\n"
             "builtins.LEAK = 1\nsys.modules['json'] = None\n")
    _run(pool, first, "ok")
    for _ in range(pool.n_workers * 2):  # whichever worker runs it
        r = _run(pool, "import os, builtins, json\nprint(os.listdir('.'), 'LEAK' in os.environ, "
                 "hasattr(builtins, 'LEAK'))\n", "ok")
        assert r.stdout == "['main.py'] False False\n"


def test_results_do_not_depend_on_worker(pool):
    code = "print(list({'apple', 'banana', 'cherry', 'date', 'elderberry'}), hash('x'))\n"
    outs = {r.stdout for r in pool.map([code] * 8, TIMEOUT)}
    assert len(outs) == 1


def test_cwd_and_environment_do_not_depend_on_order(pool):
    # every execution sees the same scratch path and the same whole environment, whichever worker or
    # position in the sequence ran it (the worker adopts the program's environment once, at start)
    code = ("import os\nprint(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'], os.getcwd(), "
            "sorted(os.environ.items()), os.listdir('.'))\n")
    outs = {r.stdout for r in pool.map([code] * (4 * pool.n_workers), TIMEOUT)}
    assert len(outs) == 1 and outs.pop().startswith("True ")
    _assert_host_clean(pool)


def test_fresh_interpreter_state(pool):
    # modules with fork handlers stay out of the template (threading, random: see PRELOAD), so `random`
    # is seeded afresh in each execution as in a new interpreter; no_new_privs is inherited from the worker
    code = ("import sys\nprint('threading' in sys.modules, 'random' in sys.modules)\nimport random\n"
            "print(random.random())\nprint([l for l in open('/proc/self/status') if 'NoNewPrivs' in l])\n")
    rs = pool.map([code] * 4, TIMEOUT)
    assert all(r.stdout.splitlines()[0] == "False False" for r in rs), rs[0]
    assert len({r.stdout.splitlines()[1] for r in rs}) == 4  # 4 distinct draws: a collision is ~2^-50
    assert all(r.stdout.splitlines()[2] == "['NoNewPrivs:\\t1\\n']" for r in rs), rs[0]


def test_program_reads_its_own_source(pool):
    code = "import sys\nsys.stdout.write(open('main.py', encoding='utf-8').read())  # é ☃\n"
    assert _run(pool, code, "ok").stdout == code


def test_map_preserves_order(pool):
    rs = pool.map([f"print({i})" for i in range(20)], TIMEOUT)
    assert [r.stdout for r in rs] == [f"{i}\n" for i in range(20)]
    _assert_host_clean(pool)


@settings(max_examples=15, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200))
def test_stdout_roundtrip(pool, text):
    r = pool.run(f"import sys\nsys.stdout.write({text!r})\n", TIMEOUT)
    assert (r.status, r.stdout) == ("ok", text)


def test_invalid_timeout_rejected(pool):
    with pytest.raises(ValueError, match="timeout_s"):
        pool.run("print(1)", 0)


def test_concurrent_execution_untouched(pool):
    # one execution tries to kill every process it can see while another runs on the other worker
    victim = "import time\ntime.sleep(0.5)\nprint('alive')\n"
    killer = ("import os, signal\nfor p in os.listdir('/proc'):\n"
              "    if p.isdigit() and int(p) != os.getpid():\n        try:\n"
              "            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass\n"
              "print('done')\n")
    _needs(pool, "uid_drop")
    rs = pool.map([victim, killer], TIMEOUT)
    assert [(r.status, r.stdout) for r in rs] == [("ok", "alive\n"), ("ok", "done\n")]
    _assert_host_clean(pool)


def test_large_program(pool):
    r = _run(pool, "#" * (2 << 20) + "\nprint('big')\n", "ok")
    assert r.stdout == "big\n"


def test_nul_byte_program(pool):
    r = _run(pool, "print(1)\x00\n", "error")
    assert "null bytes" in r.stderr


def test_after_hostile_suite(pool):
    # defined after every test that shares `pool` (pytest runs a module in file order): the pool still
    # works, its workers are the original ones, the caller is alive, nothing is left
    assert _run(pool, "print(6 * 7)\n", "ok").stdout == "42\n"
    assert os.getppid() > 1


def test_run_program_one_shot():
    r = run_program("print('one shot')", timeout_s=TIMEOUT)
    assert (r.status, r.stdout) == ("ok", "one shot\n")


def test_cli_sandbox_run(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("import sys\nprint('cli')\nsys.exit(4)\n")
    argv = [sys.executable, "-m", "projected_grpo.cli", "sandbox-run", str(prog), "--timeout", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert (got["status"], got["exit_code"], got["stdout"]) == ("error", 4, "cli\n")


def test_unisolated_fallback_contains_and_replaces_a_killed_worker():
    # the path taken without root: no uid drop or namespaces; the program can kill its worker, which
    # is then replaced, and the execution reported "killed"
    with SandboxPool(1, isolate=False) as p:
        assert not any(p.isolation.values())
        assert p.run("while True:\n    pass\n", TIMEOUT).status == "timeout"
        code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('x')\n"
        assert p.run(code, TIMEOUT).status == "ok"
        old = p._workers[0].proc.pid
        t0 = time.monotonic()
        r = p.run("import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(100)\n", TIMEOUT)
        assert r.status == "killed" and "replaced" in r.stderr and time.monotonic() - t0 < TIMEOUT + SLACK
        assert p._workers[0].proc.pid != old
        assert p.run("print(2)", TIMEOUT).stdout == "2\n"


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_worker_death_takes_its_executions_along():
    # SIGKILL the worker process the pool holds mid-execution (as when the caller itself is killed):
    # its pid namespace dies with it, daemonised grandchild included, with no help from the pool
    w = _Worker(Limits(), [str(REPO)], True)
    try:
        if not w.isolation.get("pidns"):
            pytest.skip("no pid namespace here (needs root)")
        uid = UID_BASE + w.proc.pid
        code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\ntime.sleep(100)\n"
        data = json.dumps({"code": code, "timeout_s": 30.0}).encode()
        w.proc.stdin.write(struct.pack("<I", len(data)) + data)
        w.proc.stdin.flush()
        assert _wait_for(lambda: len(_processes_of([uid])) == 2, 5.0), _processes_of([uid])
        os.kill(w.proc.pid, signal.SIGKILL)
        assert _wait_for(lambda: not _processes_of([uid]), 2.0), _processes_of([uid])
    finally:
        w.kill()


@pytest.mark.slow
def test_unisolated_fallback_removes_deeply_nested_scratch():
    # without a scratch tmpfs the dir is removed from disk: past shutil.rmtree's recursion, by rm -rf
    with SandboxPool(1, isolate=False) as p:
        deep = "import os\nfor _ in range(1200):\n    os.mkdir('a')\n    os.chdir('a')\n"
        assert p.run(deep, 5.0).status == "ok"
        assert p.run("print(1)", TIMEOUT).stdout == "1\n"  # the same worker carries on
        scratch_root = p._workers[0]._host_scratch
        assert os.listdir(scratch_root) == []
    assert not os.path.exists(scratch_root)
