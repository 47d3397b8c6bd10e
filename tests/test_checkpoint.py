"""checkpoint.py: round trip, exact RNG/optimizer continuation, atomicity, retention, corrupt files."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch

from projected_grpo.run.checkpoint import (
    FILES,
    LATEST_FILE,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


def _setup(seed: int = 0):
    """A knob, AdamW with one step taken (non-empty moments) and a warmup LambdaLR."""
    torch.manual_seed(seed)
    knob = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([knob], lr=0.1, betas=(0.5, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    knob.grad = torch.randn(5)
    opt.step()
    sched.step()
    return knob, opt, sched


def _save(run_dir, step, knob, opt, sched, **kw):
    return save_checkpoint(run_dir, step, knobs_state={"delta/layer0": knob, "V/layer0": torch.eye(2)},
                           optimizer=opt, scheduler=sched, cursors={"prompts": {"pos": step}},
                           config={"run": {"seed": 0}, "lr": 0.1}, **kw)


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_continues_exactly(tmp_path):
    knob, opt, sched = _setup()
    path = _save(tmp_path, 7, knob, opt, sched)
    after_save = _draws()
    grads = [torch.randn(5) for _ in range(3)]

    def run(k, o, s):  # three more optimizer steps with fixed gradients
        for g in grads:
            k.grad = g.clone()
            o.step()
            s.step()
        return k.detach().clone()

    expected = run(knob, opt, sched)

    ck = load_checkpoint(latest_checkpoint(tmp_path))
    assert ck.path == path and path.name == "ckpt-000007" and ck.step == 7
    assert ck.cursors == {"prompts": {"pos": 7}} and ck.config == {"run": {"seed": 0}, "lr": 0.1}
    assert torch.equal(ck.knobs_state["V/layer0"], torch.eye(2))
    k2, o2, s2 = _setup(seed=1)  # different values everywhere, then restored
    with torch.no_grad():
        k2.copy_(ck.knobs_state["delta/layer0"])
    o2.load_state_dict(ck.optimizer_state)
    s2.load_state_dict(ck.scheduler_state)
    assert torch.equal(run(k2, o2, s2), expected)

    _draws()  # move every RNG on, then restore: the draws repeat those made right after saving
    restore_rng(ck)
    assert _draws() == after_save


def test_latest_pointer_retention_and_resave(tmp_path):
    knob, opt, sched = _setup()
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, knob, opt, sched, keep_last=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [6, 8]
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-000008\n"
    with torch.no_grad():
        knob.add_(1.0)
    _save(tmp_path, 8, knob, opt, sched, keep_last=2)  # re-saving a step replaces it whole
    assert torch.equal(load_checkpoint(tmp_path / "ckpt-000008").knobs_state["delta/layer0"], knob.detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000006", "ckpt-000008", LATEST_FILE]
    assert latest_checkpoint(tmp_path / "missing") is None


def test_leftover_temp_dir_is_ignored_then_cleaned(tmp_path):
    knob, opt, sched = _setup()
    _save(tmp_path, 1, knob, opt, sched)
    stale = tmp_path / ".tmp-ckpt-000009-4242"  # a save killed before its os.replace
    stale.mkdir()
    (stale / "knobs.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "ckpt-000001"
    _save(tmp_path, 2, knob, opt, sched)
    assert not stale.exists()


def test_checkpoint_moved_aside_by_a_killed_resave_is_restored_or_cleaned(tmp_path):
    knob, opt, sched = _setup()
    _save(tmp_path, 1, knob, opt, sched)
    _save(tmp_path, 2, knob, opt, sched)
    # killed between the two renames of a re-save of step 1: its only copy is the moved-aside one
    os.replace(tmp_path / "ckpt-000001", tmp_path / ".tmp-old-ckpt-000001-4242")
    # killed after them: the new step-2 checkpoint is in place, the moved-aside old one is garbage
    shutil.copytree(tmp_path / "ckpt-000002", tmp_path / ".tmp-old-ckpt-000002-4243")
    _save(tmp_path, 3, knob, opt, sched, keep_last=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "ckpt-000002", "ckpt-000003",
                                                          LATEST_FILE]
    assert load_checkpoint(tmp_path / "ckpt-000001").step == 1


def test_failed_save_leaves_nothing_half_written(tmp_path):
    knob, opt, sched = _setup()
    _save(tmp_path, 1, knob, opt, sched)
    with pytest.raises(TypeError, match=r"config.json: the config must be JSON-serialisable"):
        save_checkpoint(tmp_path, 2, knobs_state={"a": knob}, optimizer=opt, scheduler=None, cursors={},
                        config={"device": torch.device("cpu")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", LATEST_FILE]
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-000001\n"


@pytest.mark.parametrize("fname", sorted(FILES))
def test_missing_file_is_named(tmp_path, fname):
    knob, opt, sched = _setup()
    path = _save(tmp_path, 3, knob, opt, sched)
    (path / fname).unlink()
    with pytest.raises(FileNotFoundError, match=rf"ckpt-000003 is incomplete: missing {fname}"):
        load_checkpoint(path)


@pytest.mark.parametrize("fname", ["knobs.safetensors", "optimizer.pt", "rng.pt", "cursors.json"])
def test_corrupt_file_is_named(tmp_path, fname):
    knob, opt, sched = _setup()
    path = _save(tmp_path, 3, knob, opt, sched)
    data = (path / fname).read_bytes()
    (path / fname).write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    with pytest.raises(ValueError, match=rf"checkpoint file .*ckpt-000003/{fname} is corrupt"):
        load_checkpoint(path)


def test_scheduler_none_and_bad_args(tmp_path):
    knob, opt, _ = _setup()
    path = save_checkpoint(tmp_path, 0, knobs_state={"a": knob}, optimizer=opt, scheduler=None,
                           cursors={}, config={}, keep_last=None)
    assert load_checkpoint(path).scheduler_state is None
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        save_checkpoint(tmp_path, 1, knobs_state={}, optimizer=opt, scheduler=None, cursors={}, config={},
                        keep_last=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "ckpt-000099")
