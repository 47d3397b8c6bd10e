"""Every class of a user's mistake ends in one line that names the input and what was expected (exit 2), never
a traceback (cli.py); a run that fails before its first step leaves no run directory in the way of the same
command. One test per class: missing, corrupt or unreadable input file; wrong encoding; wrong schema;
insufficient content; bad flag value; incomplete model directory; a reward function that misbehaves; an
existing run directory or a resume with another config; a full disk or an unwritable directory. (A corrupt
cache entry is rebuilt, not an error: tests/test_organism.py, tests/test_models.py.)

Run: .venv/bin/pytest -q tests/test_user_errors.py
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import re

import pytest

from projected_grpo import store
from projected_grpo.cli import main
from projected_grpo.errors import UserError
from projected_grpo.organism.build import smoke_model_and_tokenizer
from projected_grpo.run import checkpoint, metrics

SMALL = ["--run.steps", "1", "--env.max-problems", "6"]
REWARD_FN = ["--rollout.mix", "0", "--env.name", "reward_fn"]

REWARD_FNS = '''
import math
def nan(prompts, completions, **kw): return [math.nan] * len(completions)
def short(prompts, completions, **kw): return [1.0]
def boom(prompts, completions, **kw): raise RuntimeError("the user's bug")
def text(prompts, completions, **kw): return "1.0"
def nothing(prompts, completions, **kw): return None
def word(prompts, completions, **kw): return ["high"] * len(completions)
def good(prompts, completions, **kw): return [float(len(c) % 3) for c in completions]
'''


def one_line(capsys, command: str = "train") -> str:
    """The one error line of `command` on stderr (other lines: logs, warnings, the progress bar)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"projected-grpo {command}: ")]
    assert len(lines) == 1, err
    return lines[0]


def fails(capsys, argv: list[str], pattern: str) -> str:
    assert main(argv) == 2
    line = one_line(capsys, argv[0])
    assert re.search(pattern, line), line
    return line


@pytest.fixture
def d(tmp_path) -> pathlib.Path:
    """Input files with one defect each."""
    (tmp_path / "onepair.jsonl").write_text('{"prompt": "p", "hack": "h", "clean": "c"}\n')
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "p\xff", "hack": "h", "clean": "c"}\n')
    (tmp_path / "bad.json").write_bytes(b'[\n {"prompt": "p", "hack": "\xe9", "clean": "c"}]\n')
    (tmp_path / "bad_cfg.json").write_bytes(b'{"run": {"steps": 2}}\xff')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "say hi"}\n{"prompt": "say bye"}\n')
    (tmp_path / "noprompt.jsonl").write_text('{"text": "say hi"}\n')
    (tmp_path / "pool.jsonl").write_text('{"problem_id": "sum_list", "mode": 3}\n')
    (tmp_path / "rewards_mod.py").write_text(REWARD_FNS)
    return tmp_path


@pytest.mark.parametrize("argv, pattern", [
    (["--pool.path", "{d}/missing.jsonl"], r"missing.jsonl: no such file"),
    (["--proj.pairs", "{d}/missing.jsonl"], r"pairs file .*missing.jsonl does not exist"),
    (["--model.init-knobs", "{d}/missing.safetensors"],
     r"model.init_knobs: .*missing.safetensors: no such knob file"),
    (["--config", "{d}/missing.json"], r"missing.json: no such config file"),
    ([*REWARD_FN, "--env.reward-fn", "rewards_mod:good", "--env.problems", "{d}/missing.jsonl"],
     r"missing.jsonl: no such file"),
])
def test_missing_input_file(d, capsys, monkeypatch, argv, pattern):
    monkeypatch.syspath_prepend(str(d))
    fails(capsys, ["train", *[a.format(d=d) for a in argv], *SMALL, "--run-dir", str(d / "run")], pattern)
    assert not (d / "run").exists()  # nothing half-started left behind


@pytest.mark.parametrize("argv, pattern", [
    (["--model.init-knobs", "{d}/garbage.safetensors"], r"garbage.safetensors: unreadable as safetensors"),
    (["--pool.path", "{d}/garbage.safetensors"], r"garbage.safetensors:1: invalid JSON"),
])
def test_corrupt_input_file(d, capsys, argv, pattern):
    fails(capsys, ["train", *[a.format(d=d) for a in argv], *SMALL, "--run-dir", str(d / "run")], pattern)


def test_unreadable_input_file(d, capsys, monkeypatch):
    # a file this user may not read (root may read anything, so the kernel's refusal is simulated at open)
    real_open, path = io.open, str(d / "prompts.jsonl")

    def refusing_open(file, *args, **kw):
        if str(file) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(file, *args, **kw)

    monkeypatch.setattr(io, "open", refusing_open)
    monkeypatch.syspath_prepend(str(d))
    fails(capsys, ["train", *REWARD_FN, "--env.reward-fn", "rewards_mod:good", "--env.problems", path, *SMALL,
                   "--run-dir", str(d / "run")], r"prompts.jsonl: Permission denied \[EACCES\]$")


@pytest.mark.parametrize("argv, pattern", [
    (["--pool.path", "{d}/bad.jsonl"], r"bad.jsonl:1: not UTF-8 text: byte 0xff at column 14"),
    (["--proj.pairs", "{d}/bad.jsonl"], r"bad.jsonl:1: not UTF-8 text: byte 0xff at column 14"),
    (["--proj.pairs", "{d}/bad.json"], r"bad.json:2: not UTF-8 text: byte 0xe9 at column 27"),
    (["--config", "{d}/bad_cfg.json"], r"bad_cfg.json: not UTF-8 text"),
])
def test_wrong_encoding(d, capsys, argv, pattern):
    fails(capsys, ["train", *[a.format(d=d) for a in argv], *SMALL, "--run-dir", str(d / "run")], pattern)


@pytest.mark.parametrize("argv, pattern", [
    (["--pool.path", "{d}/pool.jsonl"], r"pool.jsonl:1: fields differ from the schema"),
    ([*REWARD_FN, "--env.reward-fn", "rewards_mod:good", "--env.problems", "{d}/noprompt.jsonl"],
     r"noprompt.jsonl:1: a prompt row must be a JSON object with a 'prompt' field"),
    (["--env.reward-fn", "rewards_mod", *REWARD_FN, "--env.problems", "{d}/prompts.jsonl"],
     r"env.reward_fn='rewards_mod': expected 'module.path:function'"),
])
def test_wrong_schema(d, capsys, monkeypatch, argv, pattern):
    monkeypatch.syspath_prepend(str(d))
    fails(capsys, ["train", *[a.format(d=d) for a in argv], *SMALL, "--run-dir", str(d / "run")], pattern)


@pytest.mark.parametrize("argv, pattern", [
    # one pair: no second clean completion of a prompt to build the non-hack control from
    (["train", "--proj.pairs", "{d}/onepair.jsonl", "--proj.control", "nonhack"],
     r"proj.control='nonhack' cannot be built from these pairs"),
    (["train", "--proj.pairs", "{d}/empty.jsonl"], r"pairs file .*empty.jsonl holds no pairs"),
    (["dpo", "--dpo.pairs", "{d}/onepair.jsonl", "--dpo.heldout-frac", "0.5"],
     r"dpo.heldout_frac=0.5: the pairs have 1 prompt\(s\), too few to hold some out"),
    # the reward_fn environment has no templates, so the template pool has no rows for its prompts
    (["train", "--env.name", "reward_fn", "--env.reward-fn", "rewards_mod:good", "--env.problems",
      "{d}/prompts.jsonl"], r"teacher pool .*pool.jsonl: no rows for any of the 2 train problems"),
])
def test_insufficient_content(d, capsys, monkeypatch, argv, pattern):
    monkeypatch.syspath_prepend(str(d))
    fails(capsys, [*[a.format(d=d) for a in argv], *SMALL, "--run-dir", str(d / "run")], pattern)
    assert not (d / "run").exists()


def test_bad_flag_value(capsys, tmp_path):
    fails(capsys, ["train", "--arm", "bogus", "--run-dir", str(tmp_path / "r")],
          r"ProjCfg.arm='bogus' is not one of \['none', 'erase', 'route'")
    fails(capsys, ["experiment", "--jobs", "-1"], r"--jobs -1: need seeds >= 1 and jobs >= 0")
    # a value the parser itself refuses: tyro's framed message naming the field, no traceback
    with pytest.raises(SystemExit) as stop:
        main(["train", "--run.steps", "0", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "RunCfg.steps=0 must be > 0" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """The smoke model saved as a plain Hugging Face directory."""
    out = tmp_path_factory.mktemp("hf")
    model, tok = smoke_model_and_tokenizer()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("damage, pattern", [
    ("config.json", r"model directory .* has no config.json: a Hugging Face model directory holds"),
    ("tokenizer.json", r"model directory .* has no tokenizer: a Hugging Face model directory holds"),
    ("model.safetensors", r"model directory .* has no weights"),
    ("truncate", r"model directory .*: cannot load its model \(\w+Error: .*"),
])
def test_model_dir_incomplete(hf_dir, tmp_path, capsys, damage, pattern):
    model = tmp_path / "model"
    model.mkdir()
    for f in hf_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    if damage == "truncate":
        w = model / "model.safetensors"
        w.write_bytes(w.read_bytes()[:-100])
    else:
        (model / damage).unlink()
    fails(capsys, ["train", "--model", str(model), *SMALL, "--run-dir", str(tmp_path / "run")], pattern)


@pytest.mark.parametrize("fn, pattern", [
    ("nan", r"env.reward_fn rewards_mod:nan returned nan at index 0 \(completion .*\); expected a list of 8 "
            r"finite floats, one per completion"),
    ("short", r"env.reward_fn rewards_mod:short returned 1 rewards for 8 completions"),
    ("boom", r"env.reward_fn rewards_mod:boom raised RuntimeError: the user's bug \(called on 8 completions; "
             r"--debug shows its traceback\)"),
    ("text", r"env.reward_fn rewards_mod:text returned a str; expected a list of 8 finite floats"),
    ("nothing", r"env.reward_fn rewards_mod:nothing returned a NoneType"),
    ("word", r"env.reward_fn rewards_mod:word returned 'high' at index 0"),
])
def test_reward_function_misbehaving_and_the_same_command_runs_again(d, capsys, monkeypatch, fn, pattern):
    monkeypatch.syspath_prepend(str(d))
    argv = ["train", *REWARD_FN, "--env.problems", str(d / "prompts.jsonl"), *SMALL,
            "--run-dir", str(d / "run")]
    fails(capsys, [*argv, "--env.reward-fn", f"rewards_mod:{fn}"], pattern)
    assert not (d / "run").exists()  # failed in its first step: the directory it made is gone
    assert main([*argv, "--env.reward-fn", "rewards_mod:good"]) == 0  # the plain command, fixed, runs
    with pytest.raises(UserError) as raised:  # --debug: the traceback, the user's function's under it
        main([*argv, "--run-dir", str(d / "run2"), "--env.reward-fn", "rewards_mod:boom", "--debug"])
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_existing_run_dir_and_resume_with_another_config(tmp_path, capsys):
    run = ["train", *SMALL, "--run-dir", str(tmp_path / "run")]
    assert main(run) == 0
    capsys.readouterr()
    fails(capsys, run, r"run holds a run: pass --resume to continue it, or a new --run-dir")
    fails(capsys, [*run, "--resume", "--loss.beta", "0.5"],
          r"--resume: .*ckpt-000001 was written with another config: \['loss.beta: 0.0 -> 0.5'\]; resume "
          r"with the config it was written with, or start a new --run-dir")
    # a directory left by a run killed before its first step (config, an empty metrics file) is no run
    left = tmp_path / "left"
    left.mkdir()
    (left / "config.json").write_text("{}")
    (left / metrics.METRICS_FILE).write_text("")
    assert main(["train", *SMALL, "--run-dir", str(left)]) == 0


def test_disk_full_during_a_checkpoint_then_resume(tmp_path, capsys, monkeypatch):
    import torch

    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kw):  # the 3rd file written (step 2's optimizer.pt) finds the disk full
        calls.append(1)
        if len(calls) == 3:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) raises it: no file name
        return real_save(obj, f, *args, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    run = ["train", "--run.steps", "3", "--run.checkpoint-every", "1", "--env.max-problems", "6",
           "--run-dir", str(tmp_path / "run")]
    fails(capsys, run, r"checkpoint .*run/ckpt-000002: cannot write it \(No space left on device "
                       r"\[ENOSPC\]\); the checkpoints already in .*run are whole: free space or fix the "
                       r"directory, then continue with --resume")
    assert [s for s, _ in checkpoint.checkpoints(tmp_path / "run")] == [1]  # step 1's, whole
    assert not list((tmp_path / "run").glob(".tmp-*"))
    monkeypatch.setattr(torch, "save", real_save)
    assert main([*run, "--resume"]) == 0
    assert [r["step"] for r in metrics.read_rows(tmp_path / "run" / metrics.METRICS_FILE)] == [0, 1, 2]


def test_unwritable_run_dir(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    fails(capsys, ["train", *SMALL, "--run-dir", str(tmp_path / "file" / "run")],
          r"file/run: Not a directory \[ENOTDIR\]$")

    def refuse(self, *args, **kw):  # a directory this user may not write in (root may: simulated)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    fails(capsys, ["train", *SMALL, "--run-dir", str(tmp_path / "ro" / "run")],
          r"ro/run: Permission denied \[EACCES\]$")


def test_a_full_disk_names_the_file_being_written(tmp_path):
    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as e, store.naming(tmp_path / "metrics.jsonl"):
        full()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "metrics.jsonl")
    with pytest.raises(OSError) as e, store.atomic_path(tmp_path / "a.json") as tmp:
        json.dumps({})
        tmp.write_text("x")
        full()
    assert e.value.filename == str(tmp_path / "a.json") and not list(tmp_path.iterdir())
