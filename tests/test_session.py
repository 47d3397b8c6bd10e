"""run/session.py: the one resume path, the fail-closed check that training trains, one writer per run
directory (a lock released when its holder dies, even by SIGKILL), and the one-line refusals of PPO and DPO
under torchrun.

Run: .venv/bin/pytest -q tests/test_session.py   (the kill-a-training-run lock test is marked slow)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.cli import PARENT_ENV, main
from projected_grpo.errors import RunLocked, TrainingStalled
from projected_grpo.knobs.adapters import wrap
from projected_grpo.organism.build import smoke_model_and_tokenizer
from projected_grpo.run import checkpoint, dpo, metrics, ppo, session
from projected_grpo.run import train as T
from projected_grpo.sampling import packed
from projected_grpo.study import launch

SMALL = ["--env.max-problems", "6", "--rollout.max-new-tokens", "8"]


def small(root: pathlib.Path, name: str, **sections) -> C.Config:
    cfg = C.replace(presets.SMOKE, env={"max_problems": 6}, rollout={"max_new_tokens": 8},
                    model={"cache_dir": str(root / "cache")},
                    run={"steps": 4, "checkpoint_every": 2, "dir": str(root / name)})
    return C.replace(cfg, **sections)


# --- session.resume: one path for every loop ---------------------------------------------------------------

def _knobs(seed: int = 0):
    model, _ = smoke_model_and_tokenizer(seed=0)
    knobs = wrap(model, "svd", seed=seed)
    return knobs, torch.optim.AdamW(knobs.parameters() + knobs.hack_parameters(), lr=0.1)


def test_resume_restores_state_or_resolves_fresh(tmp_path):
    knobs, opt = _knobs()
    calls = []
    fresh = lambda: calls.append(1) or ({"m": torch.eye(2)}, "fresh V")
    V, line, start = session.resume(None, knobs, opt, fresh=fresh)
    assert (line, start, calls) == ("fresh V", 0, [1])  # no checkpoint: V_hack resolved, step 0
    for p in knobs.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    checkpoint.save_checkpoint(tmp_path, 5, knobs=knobs, V_hack={"m": torch.eye(2, 3)}, optimizer=opt,
                               cursors={}, config={})
    want_rng = torch.get_rng_state()
    torch.rand(3)  # moves the global RNG: resume must put it back
    knobs2, opt2 = _knobs(seed=1)
    ck = checkpoint.load_checkpoint(tmp_path / "ckpt-000005")
    V, line, start = session.resume(ck, knobs2, opt2, fresh=fresh)
    assert start == 5 and line == f"V_hack from {ck.path}" and calls == [1]  # never re-resolved
    assert torch.equal(V["m"], torch.eye(2, 3)) and torch.equal(torch.get_rng_state(), want_rng)
    assert all(torch.equal(a, b) for a, b in zip(knobs.parameters(), knobs2.parameters()))
    assert opt2.state_dict()["state"][0]["step"] == 1


@pytest.mark.bitwise  # a promise across a save and a load: docs/reproducibility.md
def test_grpo_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    cfg = small(tmp_path, "full", proj={"arm": "route"})
    T.train(cfg)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "ckpt-000004")  # as if killed after step 2's checkpoint
    (cut / metrics.SUMMARY_FILE).unlink()
    T.train(C.replace(cfg, run={"dir": str(cut), "resume": True}))
    strip = lambda d: [{k: v for k, v in r.items() if not k.startswith("time/")}
                       for r in metrics.read_rows(d / metrics.METRICS_FILE)]
    assert [r["step"] for r in strip(cut)] == [0, 1, 2, 3] and strip(cut) == strip(tmp_path / "full")
    a, b = (store.load_tensors(d / "ckpt-000004" / "knobs.safetensors")[0] for d in (tmp_path / "full", cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- MovementGuard: a run whose knobs do not move stops -------------------------------------------------

def test_guard_names_a_frozen_optimizer_and_zero_gradients():
    knobs, opt = _knobs()
    guard = session.MovementGuard(knobs, steps=2)
    guard.after_step(0, grad_norm=0.5)
    guard.after_step(1, informative=False, grad_norm=0.0)  # no signal: not counted
    with pytest.raises(TrainingStalled, match=r"step 2: the knobs have not moved in 2 informative steps, "
                                              r"so this run does not train: the gradients were not zero "
                                              r"\(norm up to 0.5\) but the optimizer did not move the knobs"):
        guard.after_step(2, grad_norm=0.25)
    guard = session.MovementGuard(knobs, steps=1)
    with pytest.raises(TrainingStalled, match="every knob gradient was zero: no gradient reaches the knobs"):
        guard.after_step(0, grad_norm=0.0)
    guard = session.MovementGuard(knobs, steps=1)
    for p in knobs.hack_parameters():  # one quarantine value moved is movement (route moves only it)
        p.data.view(-1)[0] += 1e-7
    guard.after_step(0, grad_norm=0.0)
    guard.after_step(1, grad_norm=0.0)  # checked once: later steps cost nothing
    with pytest.raises(ValueError, match="steps must be >= 1"):
        session.MovementGuard(knobs, steps=0)


def _frozen_adamw(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)


def test_a_grpo_run_with_a_frozen_optimizer_stops(tmp_path, monkeypatch, capsys):
    _frozen_adamw(monkeypatch)
    with pytest.raises(TrainingStalled, match=r"have not moved in 3 informative steps, so this run does not "
                                              r"train: the gradients were not zero"):
        T.train(small(tmp_path, "frozen"))
    # the CLI: one line, exit 2
    assert main(["train", *SMALL, "--run.steps", "4", "--run-dir", str(tmp_path / "cli")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("projected-grpo train:")]
    assert len(err) == 1 and "this run does not train" in err[0]


def test_a_grpo_run_whose_loss_is_detached_from_the_knobs_stops(tmp_path, monkeypatch):
    real = T.clip_surrogate
    # the loss keeps a graph (backward runs) but no gradient reaches the knobs: what a detached forward does
    monkeypatch.setattr(T, "clip_surrogate", lambda logp, *a, **kw: real(logp.detach() + 0 * logp, *a, **kw))
    with pytest.raises(TrainingStalled, match="every knob gradient was zero"):
        T.train(small(tmp_path, "detached"))


def test_ppo_and_dpo_runs_with_a_frozen_optimizer_stop(tmp_path, monkeypatch):
    _frozen_adamw(monkeypatch)
    with pytest.raises(TrainingStalled, match="the optimizer did not move the knobs"):
        ppo.train_ppo(small(tmp_path, "ppo", loss={"algo": "ppo"}, ppo={"epochs": 1, "minibatches": 1}))
    with pytest.raises(TrainingStalled, match="the optimizer did not move the knobs"):
        dpo.train_dpo(small(tmp_path, "dpo", dpo={"steps": 4, "sample_n": 0}))


# --- PPO and DPO under torchrun: refused in one line -------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["train", "--loss.algo", "ppo"], "loss.algo ppo trains in one process; run it without torchrun"),
    (["dpo"], "DPO trains in one process; run `projected-grpo dpo` without torchrun"),
])
def test_ppo_and_dpo_refuse_torchrun(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun --nproc_per_node 2 sets in each rank
    assert main([*argv, *SMALL, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


# --- one writer per run directory ---------------------------------------------------------------------------

HOLD = ("import sys, time; from projected_grpo.store import DirLock; lock = DirLock(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)")


def test_a_second_writer_is_refused_until_the_first_dies(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", *SMALL, "--run.steps", "2", "--run-dir", str(run)]
    assert main(argv) == 0
    capsys.readouterr()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run / session.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        resume = [*argv[:-4], "--run.steps", "3", "--run-dir", str(run), "--resume"]
        assert main(resume) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"projected-grpo train: {run} is being written by another "
                                                   f"process (pid {holder.pid} since ")
        holder.send_signal(signal.SIGKILL)  # the holder dies at a bad moment: the kernel drops its lock
        holder.wait()
        assert main(resume) == 0
    finally:
        holder.kill()
        holder.wait()
    assert [r["step"] for r in metrics.read_rows(run / metrics.METRICS_FILE)] == [0, 1, 2]


def test_this_process_takes_its_own_lock_again_and_finish_releases_it(tmp_path):
    run = tmp_path / "run"
    session._lock(run)  # a run in this process that ended in an exception and never released
    session._lock(run)  # the same process opens it again: no RunLocked
    with pytest.raises(store.Locked):
        store.DirLock(run / session.LOCK_FILE)
    session.release(run)
    store.DirLock(run / session.LOCK_FILE).release()  # free again


@pytest.mark.slow
def test_a_second_train_is_refused_while_the_first_trains_and_resumes_after_it_is_killed(tmp_path, capsys):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "projected_grpo.cli", "train", *SMALL, "--run.steps", "40",
           "--run.checkpoint-every", "2", "--run-dir", str(run)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (run / "ckpt-000002").is_dir():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        argv = ["train", *SMALL, "--run.steps", "40", "--run.checkpoint-every", "2", "--run-dir", str(run),
                "--resume"]
        assert main(argv) == 2  # the first is mid-run: one line, and nothing of its run touched
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is being written by another process (pid {first.pid}" in err[0]
        time.sleep(0.3)
        os.kill(first.pid, signal.SIGKILL)  # mid-step
        first.wait()
    finally:
        first.kill()
        first.wait()
    assert main(argv) == 0
    assert [r["step"] for r in metrics.read_rows(run / metrics.METRICS_FILE)] == list(range(40))


def test_the_run_started_by_a_sweep_and_the_cli_agree_on_the_parent_variable():
    assert launch.PARENT_ENV == PARENT_ENV


def test_run_locked_is_a_user_error():
    assert issubclass(RunLocked, ValueError) and issubclass(TrainingStalled, ValueError)


@pytest.mark.parametrize("bf16_kernels, want", [(True, "bfloat16"), (False, "float32")])
def test_config_json_records_what_sample_dtype_auto_resolved_to(tmp_path, monkeypatch, bf16_kernels, want):
    """A run's config.json says which weights its students were sampled from on this machine, so the file
    reruns it anywhere as it ran here."""
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: bf16_kernels)
    cfg, ck = session.open_run(small(tmp_path, "run", rollout={"sample_dtype": "auto"}), "x")
    try:
        assert ck is None and cfg.rollout.sample_dtype == want
        assert C.Config.from_json(tmp_path / "run" / "config.json").rollout.sample_dtype == want
    finally:
        session.release(tmp_path / "run")
