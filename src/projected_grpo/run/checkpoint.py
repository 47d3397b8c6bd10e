"""Atomic checkpoints for exact resume: knobs, V_hack, optimizer, RNG states, cursors, config.

A checkpoint is a directory `run_dir/ckpt-<step:06d>/` written under a temporary name and moved into
place with os.replace, so a run killed mid-save leaves either the previous checkpoint set or the new
one, never a half directory under a ckpt- name (stray `.tmp-ckpt-*` dirs are ignored and cleaned up
by the next save). `run_dir/latest` names the newest one for humans and scripts. Knobs are written
by `Knobs.save` (safetensors with the base model's fingerprint, so a resume on another model is refused)
and V_hack as safetensors (read back as aligned copies: store.py); optimizer and RNG states are
torch.save'd and loaded with weights_only=True; cursors (data and pool positions) and the config are JSON.
A loop with trained tensors beyond the knobs (PPO's value head) passes them as `extra` (extra.safetensors).

Not here: what the cursors mean (batches.py, pool.py) or how knob tensors map onto modules (adapters.py).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from projected_grpo.errors import UserError
from projected_grpo.store import load_tensors, save_tensors, write_text_atomic

CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
LATEST_FILE = "latest"
# file name -> what it holds; every one must exist for a checkpoint to load
FILES: dict[str, str] = {
    "meta.json": "step and format version",
    "knobs.safetensors": "knob values (Knobs.save)",
    "v_hack.safetensors": "the V_hack in use (V/<module>, (K, R))",
    "optimizer.pt": "optimizer state_dict",
    "rng.pt": "python / numpy / torch CPU / CUDA RNG states",
    "cursors.json": "data and pool cursors",
    "config.json": "resolved run config",
}
# written only when the loop has such tensors; a checkpoint without it loads with extra = {}
EXTRA_FILE = "extra.safetensors"
FORMAT_VERSION = 2  # 2: knobs via Knobs.save, V_hack in its own file, no scheduler


@dataclass
class Checkpoint:
    """A loaded checkpoint: `load_knobs(knobs)` restores the knobs; `optimizer_state` goes to the optimizer's
    load_state_dict; V_hack: name -> (K, R)."""

    path: pathlib.Path
    step: int
    knobs: tuple[dict[str, Tensor], dict[str, str]]
    V_hack: dict[str, Tensor]
    optimizer_state: dict
    rng: dict
    cursors: dict
    config: dict
    extra: dict[str, Tensor]

    def load_knobs(self, knobs) -> None:
        """Knob values into `knobs` (refused, naming the file, when saved for another model or knob)."""
        try:
            knobs.load_state(*self.knobs, where=f"checkpoint file {self.path / 'knobs.safetensors'}")
        except ValueError as e:
            raise UserError(str(e)) from e


def rng_state() -> dict:
    """Python / numpy / torch CPU (and CUDA, when present) RNG states, loadable with weights_only=True."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(ckpt: Checkpoint | dict) -> None:
    """Set every RNG to the state saved in `ckpt` (a Checkpoint or its `.rng` dict).

    CUDA states are restored when CUDA is available here; a CPU process ignores them (CPU sampling
    and training never read the CUDA generators).
    """
    state = ckpt.rng if isinstance(ckpt, Checkpoint) else ckpt
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(obj: object, path: pathlib.Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _json_dump(obj: object, path: pathlib.Path, what: str) -> None:
    try:
        text = json.dumps(obj, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint {path.name}: the {what} must be JSON-serialisable (plain str/int/float/"
                        f"bool/list/dict, finite): {e}") from e
    write_text_atomic(path, text + "\n")


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of every `ckpt-<step>` directory in run_dir, oldest first (temp dirs excluded)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := CKPT_RE.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """Newest checkpoint directory in run_dir, or None.

    Chosen by scanning the ckpt- directories (each is complete, being moved into place whole), so a
    kill between the directory move and the `latest` pointer update still resumes from the newest.
    """
    found = checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, knobs, V_hack: dict[str, Tensor], optimizer,
                    cursors: dict, config: dict, keep_last: int | None = 3,
                    extra: dict[str, Tensor] | None = None) -> pathlib.Path:
    """Write `run_dir/ckpt-<step:06d>` atomically, point `run_dir/latest` at it, keep the newest
    `keep_last` checkpoints (None keeps all); `extra`: further trained tensors (e.g. a value head). The RNG
    states saved are the ones at call time, so call this at the point the resumed run will continue from.
    Returns the checkpoint directory."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last must be >= 1 or None, got {keep_last}")
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".tmp-ckpt-*"):  # left by a run killed mid-save; never a valid checkpoint
        shutil.rmtree(stale)
    for old in run_dir.glob(".tmp-old-ckpt-*"):  # a complete checkpoint, moved aside to re-save its step
        final = run_dir / old.name.removeprefix(".tmp-old-").rsplit("-", 1)[0]
        if final.exists():  # killed after the new one took its place: the old one is garbage
            shutil.rmtree(old)
        else:  # killed between the two renames: the old one is still the only copy, so put it back
            os.replace(old, final)
    name = f"ckpt-{int(step):06d}"
    final = run_dir / name
    tmp = run_dir / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        knobs.save(tmp / "knobs.safetensors")
        save_tensors(tmp / "v_hack.safetensors", {f"V/{n}": v for n, v in V_hack.items()})
        _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
        _torch_save(rng_state(), tmp / "rng.pt")
        if extra:
            save_tensors(tmp / EXTRA_FILE, dict(extra))
        _json_dump(cursors, tmp / "cursors.json", "cursors")
        _json_dump(config, tmp / "config.json", "config")
        _json_dump({"step": int(step), "format": FORMAT_VERSION}, tmp / "meta.json", "meta")
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one out first
            old = run_dir / f".tmp-old-{name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException as e:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a read-only or unwritable run directory: the input's fault
            code = f" [{errno.errorcode.get(e.errno, e.errno)}]" if e.errno else ""
            raise UserError(f"checkpoint {final}: cannot write it ({e.strerror or e}{code}); the checkpoints "
                            f"already in {run_dir} are whole: free space or fix the directory, then continue "
                            "with --resume") from e
        raise
    write_text_atomic(run_dir / LATEST_FILE, name + "\n")
    if keep_last is not None:
        for _, old_path in checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old_path)
    return final


def _load_part(path: pathlib.Path, loader):
    try:
        return loader(path)
    except Exception as e:  # any failure to read a file is reported as that file's corruption
        raise UserError(f"checkpoint file {path} is corrupt or unreadable ({type(e).__name__}: {e}); "
                        f"resume from an earlier checkpoint in {path.parent.parent}") from e


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a checkpoint directory; a missing or unreadable file raises naming that file."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint directory {path} does not exist")
    for fname, what in FILES.items():
        if not (path / fname).is_file():
            raise UserError(f"checkpoint {path} is incomplete: missing {fname} ({what}); checkpoints written "
                            "before format 2 cannot be resumed")
    read_json = lambda p: json.loads(p.read_text(encoding="utf-8"))
    read_torch = lambda p: torch.load(p, map_location="cpu", weights_only=True)
    meta = _load_part(path / "meta.json", read_json)
    if meta.get("format") != FORMAT_VERSION or not isinstance(meta.get("step"), int):
        raise UserError(f"checkpoint file {path / 'meta.json'}: expected format {FORMAT_VERSION} and an int "
                         f"step, got {meta}")
    V = _load_part(path / "v_hack.safetensors", lambda p: load_tensors(p)[0])  # aligned copies: store.py
    return Checkpoint(
        path=path, step=meta["step"], knobs=_load_part(path / "knobs.safetensors", load_tensors),
        V_hack={k.removeprefix("V/"): v for k, v in V.items()},
        optimizer_state=_load_part(path / "optimizer.pt", read_torch),
        rng=_load_part(path / "rng.pt", read_torch),
        cursors=_load_part(path / "cursors.json", read_json),
        config=_load_part(path / "config.json", read_json),
        extra=(_load_part(path / EXTRA_FILE, lambda p: load_tensors(p)[0]) if (path / EXTRA_FILE).is_file()
               else {}),
    )
