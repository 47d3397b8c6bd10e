"""The CLI lists every subcommand and rejects unknown ones. Run: pytest tests/test_cli.py"""

import errno
import re
import signal
import subprocess
import sys

import pytest

from projected_grpo.cli import COMMANDS, main
from projected_grpo.errors import Interrupted, UserError


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_rejected(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "projected_grpo.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: projected-grpo" in r.stdout


# --- a user's mistake is one line, not a traceback (issue 13) -------------------------------------------


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "garbage.jsonl").write_text("garbage{\n")
    (tmp_path / "trunc.jsonl").write_text('{"problem_id": "sum_list", "mode": "run_t')
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "x", "hack": "y"}\n')
    (tmp_path / "ds.jsonl").write_text('{"x": 1}\n')
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["train", "--pool.path", "{d}/trunc.jsonl"], r"trunc.jsonl:1: invalid JSON"),
    (["train", "--pool.path", "{d}/garbage.jsonl"], r"garbage.jsonl:1: invalid JSON"),
    (["train", "--pool.path", "{d}/missing.jsonl"], r"missing.jsonl: no such file"),
    (["train", "--proj.pairs", "{d}/pairs.jsonl"], r"pairs.jsonl:1: missing field\(s\) \['clean'\]"),
    (["train", "--config", "{d}/missing.json"], r"missing.json: no such config file"),
    (["train", "--model", "{d}/no-model"], r"is neither a local directory nor a known name"),
    (["check-grader", "--dataset", "{d}/missing.jsonl"], r"missing.jsonl: no such file"),
    (["check-grader", "--dataset", "{d}/garbage.jsonl"], r"garbage.jsonl:1: invalid JSON"),
    (["check-grader", "--dataset", "{d}/ds.jsonl"], r"ds.jsonl:1: field 'id' is missing"),
    (["experiment", "--arms", "none,bogus"], r"unknown \['bogus'\]"),
])
def test_user_mistakes_print_one_line_and_exit_2(bad_files, capsys, argv, message):
    argv = [a.format(d=bad_files) for a in argv] + (["--run-dir", str(bad_files / "run")]
                                                      if argv[0] == "train" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"projected-grpo {argv[0]}: ")
    assert re.search(message, err[0]), err[0]


def test_truncated_checkpoint_file_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--run.steps", "1", "--env.max-problems", "6"]) == 0
    opt = run / "ckpt-000001" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])
    capsys.readouterr()
    resume = ["train", "--run-dir", str(run), "--resume", "--run.steps", "2", "--env.max-problems", "6"]
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("projected-grpo train: checkpoint file")
    assert "optimizer.pt is corrupt" in err[-1]
    assert len([line for line in err if line.startswith("projected-grpo")]) == 1
    assert "Traceback" not in "\n".join(err)
    with pytest.raises(ValueError, match="optimizer.pt is corrupt"):  # --debug: the exception itself
        main([*resume, "--debug"])


# --- which errors are one line: an input's (named), a signal's; a bug keeps its traceback ------------------

def _raising(exc: BaseException):
    def command(argv: list[str]) -> int:
        raise exc
    return command


@pytest.mark.parametrize("exc, code, line", [
    (UserError("pool.jsonl:3: field 'mode' must be str"), 2, "pool.jsonl:3: field 'mode' must be str"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/pool.jsonl"), 2,
     "/data/pool.jsonl: Permission denied [EACCES]"),
    (OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl"), 2,
     "runs/x/metrics.jsonl: No space left on device [ENOSPC]"),
    (FileNotFoundError("pairs file p.jsonl does not exist"), 2, "pairs file p.jsonl does not exist"),
    (Interrupted(signal.SIGTERM, "stopped by SIGTERM: 2 running run(s) stopped"), 143,
     "stopped by SIGTERM: 2 running run(s) stopped"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)"),
])
def test_input_errors_and_signals_are_one_line(monkeypatch, capsys, exc, code, line):
    monkeypatch.setitem(sys.modules, "fake_cmd", type(sys)("fake_cmd"))
    sys.modules["fake_cmd"].run = _raising(exc)
    monkeypatch.setitem(COMMANDS, "fake", ("a fake command", "fake_cmd:run"))
    assert main(["fake"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [f"projected-grpo fake: {line}"]
    with pytest.raises(type(exc)):  # --debug: the traceback
        main(["fake", "--debug"])


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), OSError(errno.EIO, "I/O error"), KeyError("x")])
def test_a_bug_keeps_its_traceback(monkeypatch, exc):
    # an OSError that names no file cannot say which input to fix: it is reported as a bug, traceback and all
    monkeypatch.setitem(sys.modules, "fake_cmd", type(sys)("fake_cmd"))
    sys.modules["fake_cmd"].run = _raising(exc)
    monkeypatch.setitem(COMMANDS, "fake", ("a fake command", "fake_cmd:run"))
    with pytest.raises(type(exc)):
        main(["fake"])
