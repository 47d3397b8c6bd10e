"""checkpoint.py: round trip, exact RNG/optimizer continuation, atomicity, retention, corrupt files."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch

from projected_grpo.errors import UserError
from projected_grpo.knobs.adapters import wrap
from projected_grpo.run.checkpoint import (
    FILES,
    LATEST_FILE,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same base weights every time: knob files carry its fingerprint
        self.q_proj = torch.nn.Linear(5, 4)


def _setup(seed: int = 0, cache=None):
    """SVD knobs on a one-Linear model, random values, and AdamW with one step taken (non-empty moments)."""
    knobs = wrap(_Tiny(), "svd", targets=("q_proj",), cache_dir=cache)
    torch.manual_seed(seed)
    knob = knobs.parameters()[0]
    with torch.no_grad():
        knob.copy_(torch.randn(4))
    opt = torch.optim.AdamW(knobs.parameters(), lr=0.1, betas=(0.5, 0.9))
    knob.grad = torch.randn(4)
    opt.step()
    return knobs, knob, opt


V = {"q_proj": torch.eye(2, 4)}


def _save(run_dir, step, knobs, opt, **kw):
    return save_checkpoint(run_dir, step, knobs=knobs, V_hack=V, optimizer=opt,
                           cursors={"prompts": {"pos": step}}, config={"run": {"seed": 0}, "lr": 0.1}, **kw)


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.mark.bitwise  # a promise across a save and a load: docs/reproducibility.md
def test_round_trip_continues_exactly(tmp_path):
    knobs, knob, opt = _setup()
    path = _save(tmp_path, 7, knobs, opt)
    after_save = _draws()
    grads = [torch.randn(4) for _ in range(3)]

    def run(k, o):  # three more optimizer steps with fixed gradients
        for g in grads:
            k.grad = g.clone()
            o.step()
        return k.detach().clone()

    expected = run(knob, opt)

    ck = load_checkpoint(latest_checkpoint(tmp_path))
    assert ck.path == path and path.name == "ckpt-000007" and ck.step == 7
    assert ck.cursors == {"prompts": {"pos": 7}} and ck.config == {"run": {"seed": 0}, "lr": 0.1}
    assert torch.equal(ck.V_hack["q_proj"], torch.eye(2, 4)) and ck.V_hack["q_proj"].data_ptr() % 64 == 0
    knobs2, k2, o2 = _setup(seed=1)  # different values everywhere, then restored
    ck.load_knobs(knobs2)
    o2.load_state_dict(ck.optimizer_state)
    assert torch.equal(run(k2, o2), expected)

    _draws()  # move every RNG on, then restore: the draws repeat those made right after saving
    restore_rng(ck)
    assert _draws() == after_save


def test_latest_pointer_retention_and_resave(tmp_path):
    knobs, knob, opt = _setup()
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, knobs, opt, keep_last=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [6, 8]
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-000008\n"
    with torch.no_grad():
        knob.add_(1.0)
    _save(tmp_path, 8, knobs, opt, keep_last=2)  # re-saving a step replaces it whole
    knobs2, k2, _ = _setup(seed=1)
    load_checkpoint(tmp_path / "ckpt-000008").load_knobs(knobs2)
    assert torch.equal(k2, knob)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000006", "ckpt-000008", LATEST_FILE]
    assert latest_checkpoint(tmp_path / "missing") is None


def test_leftover_temp_dir_is_ignored_then_cleaned(tmp_path):
    knobs, knob, opt = _setup()
    _save(tmp_path, 1, knobs, opt)
    stale = tmp_path / ".tmp-ckpt-000009-4242"  # a save killed before its os.replace
    stale.mkdir()
    (stale / "knobs.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "ckpt-000001"
    _save(tmp_path, 2, knobs, opt)
    assert not stale.exists()


def test_checkpoint_moved_aside_by_a_killed_resave_is_restored_or_cleaned(tmp_path):
    knobs, knob, opt = _setup()
    _save(tmp_path, 1, knobs, opt)
    _save(tmp_path, 2, knobs, opt)
    # killed between the two renames of a re-save of step 1: its only copy is the moved-aside one
    os.replace(tmp_path / "ckpt-000001", tmp_path / ".tmp-old-ckpt-000001-4242")
    # killed after them: the new step-2 checkpoint is in place, the moved-aside old one is garbage
    shutil.copytree(tmp_path / "ckpt-000002", tmp_path / ".tmp-old-ckpt-000002-4243")
    _save(tmp_path, 3, knobs, opt, keep_last=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "ckpt-000002", "ckpt-000003",
                                                          LATEST_FILE]
    assert load_checkpoint(tmp_path / "ckpt-000001").step == 1


def test_failed_save_leaves_nothing_half_written(tmp_path):
    knobs, knob, opt = _setup()
    _save(tmp_path, 1, knobs, opt)
    with pytest.raises(TypeError, match=r"config.json: the config must be JSON-serialisable"):
        save_checkpoint(tmp_path, 2, knobs=knobs, V_hack=V, optimizer=opt, cursors={},
                        config={"device": torch.device("cpu")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", LATEST_FILE]
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-000001\n"


@pytest.mark.parametrize("fname", sorted(FILES))
def test_missing_file_is_named(tmp_path, fname):
    knobs, knob, opt = _setup()
    path = _save(tmp_path, 3, knobs, opt)
    (path / fname).unlink()
    with pytest.raises(UserError, match=rf"ckpt-000003 is incomplete: missing {fname}"):
        load_checkpoint(path)


@pytest.mark.parametrize("fname", ["knobs.safetensors", "v_hack.safetensors", "optimizer.pt", "rng.pt",
                                   "cursors.json"])
def test_corrupt_file_is_named(tmp_path, fname):
    knobs, knob, opt = _setup()
    path = _save(tmp_path, 3, knobs, opt)
    data = (path / fname).read_bytes()
    (path / fname).write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    with pytest.raises(ValueError, match=rf"checkpoint file .*ckpt-000003/{fname} is corrupt"):
        load_checkpoint(path)


def test_bad_args_and_knobs_of_another_model(tmp_path):
    knobs, knob, opt = _setup()
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        _save(tmp_path, 1, knobs, opt, keep_last=0)
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "ckpt-000099")
    path = _save(tmp_path, 1, knobs, opt)
    other = wrap(torch.nn.Sequential(torch.nn.Linear(5, 4)), "svd", targets=("0",))
    with pytest.raises(UserError, match=r"ckpt-000001/knobs.safetensors was saved for .* fingerprint"):
        load_checkpoint(path).load_knobs(other)
