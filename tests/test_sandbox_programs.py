"""The sandbox on normal programs (outputs, files, a clean start per execution), its workers' lifecycle
and the unisolated fallback. Hostile programs are in test_sandbox.py; shared pieces in sandbox_helpers.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sandbox_helpers import (
    REPO,
    SLACK,
    TIMEOUT,
    _assert_host_clean,
    _needs,
    _processes_of,
    _run,
    make_pool,
)

from projected_grpo.envs.coding.sandbox import Limits, SandboxPool, _Worker, run_program
from projected_grpo.envs.coding.sandbox_worker import UID_BASE


@pytest.fixture(scope="module")
def pool():
    yield from make_pool()

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


def test_a_pip_installed_package_is_hidden_inside_a_venv_in_tmp(tmp_path):
    # this package installed (copied) into a venv's site-packages, the venv in /tmp: the Python
    # installation is bound into the programs' root (/tmp included), this package's dir inside it is not
    venv, python = tmp_path / "venv", str(tmp_path / "venv" / "bin" / "python")
    base = os.path.join(sys.base_prefix, "bin", "python3")
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = pathlib.Path(subprocess.run([python, "-c", purelib], capture_output=True, text=True,
                                       check=True).stdout.strip())
    shutil.copytree(REPO / "src" / "projected_grpo", site / "projected_grpo")
    bank = site / "projected_grpo" / "envs" / "coding" / "problem_bank.py"
    program = (f"import os\nprint(os.path.isdir({str(site)!r}), os.path.exists({str(bank)!r}))\n"
               f"print(open({str(bank)!r}).read(10))\n")
    script = ("import json\nfrom projected_grpo.envs.coding.sandbox import PACKAGE_ROOT, SandboxPool\n"
              "with SandboxPool(1) as pool:\n"
              f"    r = pool.run({program!r}, 5.0)\n"
              "print(json.dumps([str(PACKAGE_ROOT), pool.isolation['mountns'], r.status, r.stdout]))\n")
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}  # torch, tyro: not in the new venv
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=True).stdout
    package_root, mountns, status, stdout = json.loads(out.splitlines()[-1])
    assert package_root == str(site)
    if not mountns:
        pytest.skip("isolation 'mountns' unavailable here (needs root / namespaces)")
    assert (status, stdout) == ("error", "True False\n")
