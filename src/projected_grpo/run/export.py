"""`projected-grpo export RUN_DIR OUT_DIR`: a run's checkpoint as a plain Hugging Face model directory.

Rebuilds the model and knobs the run trained (the checkpoint's config.json, the same load and wrap as
training), loads the main knob of one checkpoint (the latest by default), leaves the quarantine knob at
zero (the deployed model of `route`; the others never write it) and folds the knob into the weights with
`knobs.plain.export`: W + U·diag(δS)·Vh (svd) or W + B·A (lora), in the base weights' dtype, plus the run's
tokenizer. The result loads with stock `AutoModelForCausalLM` / `AutoTokenizer` (or vLLM) and gives the
logits of the knob model under `knobs.ablate_quarantine()`. Not here: training, or exporting the
quarantine itself (`knobs.plain.export(include_quarantine=True)` does that, for analysis only).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Annotated

import tyro

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.errors import UserError
from projected_grpo.knobs import plain
from projected_grpo.run import checkpoint, setup

EXPORT_FILE = "projected_grpo_export.json"  # beside config.json: which run, step and knob it came from


def pick_checkpoint(run_dir: pathlib.Path, step: int | None) -> pathlib.Path:
    """The checkpoint directory of `step` (None: the latest); UserError naming the steps there are."""
    found = checkpoint.checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir}: no ckpt-* checkpoint to export (the run saved none yet)")
    if step is None:
        return found[-1][1]
    by_step = dict(found)
    if step not in by_step:
        raise UserError(f"{run_dir}: no checkpoint for step {step}; there are steps "
                        f"{', '.join(str(s) for s, _ in found)}")
    return by_step[step]


def export_run(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, step: int | None = None,
               device: str = "cpu") -> pathlib.Path:
    """Write checkpoint `step` (None: the latest) of `run_dir` as a Hugging Face model directory `out_dir`
    (must not exist or be empty), main knob merged, quarantine zeroed. Returns `out_dir`.

    device: where the merge runs (a GPU run exports on a CPU machine too); the dtype stays the run's."""
    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export target {out} exists and is not empty; choose a new directory")
    ckpt = pick_checkpoint(run_dir, step)  # before the (slow) model build: a wrong step fails at once
    # the checkpoint's own copy of the config: the one its knobs were trained under (a resumed run's
    # run_dir/config.json may differ in run.steps, never in the model or knob settings)
    cfg_file = ckpt / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{ckpt}: no config.json; the checkpoint is incomplete")
    cfg = C.replace(C.Config.from_json(str(cfg_file)), model={"device": device})
    model, tok = setup.load_model(cfg)  # as training built it (run/setup.py)
    knobs = setup.wrap_knobs(cfg, model)
    checkpoint.load_checkpoint(ckpt).load_knobs(knobs)  # refused, naming the file, for another base model
    for m in knobs.modules.values():
        m.delta_hack.data.zero_()  # deployment view: the quarantine is never exported
    record = {"run_dir": str(run_dir.resolve()), "checkpoint": ckpt.name, "arm": cfg.proj.arm,
              "knob": cfg.model.knob, "rank": cfg.model.rank, "model": cfg.model.path or cfg.model.source,
              "fingerprint": knobs.fingerprint(), "quarantine": "zeroed"}
    with store.atomic_dir(out) as tmp:
        plain.export(knobs, tmp, include_quarantine=False, tokenizer=tok)  # tmp is empty: filled in place
        store.write_json_atomic(tmp / EXPORT_FILE, record)
    return out


@dataclass(frozen=True)
class ExportOpts:
    """Merge a run's main knob into its base model and write a plain Hugging Face model directory."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """run directory (holds ckpt-*/, each with the config it was trained under)"""
    out_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="OUT_DIR")]
    """output directory (must not exist or be empty)"""
    step: Annotated[int | None, tyro.conf.arg(metavar="N")] = None
    """checkpoint step to export (default: the latest)"""
    device: str = "cpu"
    """torch device for the merge (the weights keep the run's dtype)"""


def export_main(argv: list[str]) -> int:
    """`projected-grpo export RUN_DIR OUT_DIR [--step N]`: prints the output directory last."""
    opts = tyro.cli(ExportOpts, args=argv, prog="projected-grpo export")
    print(export_run(opts.run_dir, opts.out_dir, step=opts.step, device=opts.device))
    return 0
