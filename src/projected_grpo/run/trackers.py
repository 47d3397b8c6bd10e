"""Where a run's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, trackio (`run.report_to`).

metrics.jsonl is always written and is the record every report reads; a tracker receives the same numbers
(each row's floats) for the dashboards researchers already use, as TRL's `report_to` does. Each is an optional
dependency (`pip install 'projected-grpo[tb]'` or `'projected-grpo[track]'`), imported only when asked for.
  tensorboard  scalars in RUN_DIR/tb/
  wandb        a W&B run named after the run directory, its id derived from the directory, so `--resume`
               continues the same W&B run; offline with WANDB_MODE=offline (no network), synced later with
               `wandb sync RUN_DIR/wandb/offline-run-*`; project $WANDB_PROJECT or "projected-grpo"
  trackio      a local trackio run (SQLite under $TRACKIO_DIR or trackio's default), project
               $TRACKIO_PROJECT or "projected-grpo"; `trackio show` opens its dashboard
Not here: validating rows, the JSONL file (metrics.py).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pathlib
from collections.abc import Callable, Mapping

from projected_grpo.errors import UserError

PROJECT = "projected-grpo"


class Tracker:
    """One destination of the rows: log(step, floats) per step, close() once."""

    def __init__(self, log: Callable[[int, dict[str, float]], None], close: Callable[[], None]):
        self.log, self.close = log, close


def _need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"run.report_to names {module}, which is not installed: pip install "
                        f"'projected-grpo[{extra}]' (or drop it from --run.report-to)") from e


def _tensorboard(run_dir: pathlib.Path, name: str, config: Mapping) -> Tracker:
    _need("tensorboard", "tb")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(step: int, row: dict[str, float]) -> None:
        for k, v in row.items():
            writer.add_scalar(k, v, step)
        writer.flush()

    return Tracker(log, writer.close)


def run_id(run_dir: pathlib.Path) -> str:
    """A tracker run id stable for one run directory: a resumed run logs to the run it continues."""
    return hashlib.blake2b(str(run_dir.resolve()).encode(), digest_size=8).hexdigest()


def _wandb(run_dir: pathlib.Path, name: str, config: Mapping) -> Tracker:
    wandb = _need("wandb", "track")
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, id=run_id(run_dir),
                     resume="allow", dir=str(run_dir), config=dict(config))
    return Tracker(lambda step, row: run.log(row, step=step), run.finish)


def _trackio(run_dir: pathlib.Path, name: str, config: Mapping) -> Tracker:
    trackio = _need("trackio", "track")
    trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=dict(config),
                 resume="allow")
    return Tracker(lambda step, row: trackio.log(row, step=step), trackio.finish)


# run.report_to -> the tracker's constructor (run_dir, run name, config dict)
TRACKERS: dict[str, Callable[[pathlib.Path, str, Mapping], Tracker]] = {
    "tensorboard": _tensorboard, "wandb": _wandb, "trackio": _trackio}


def open_trackers(report_to: tuple[str, ...], run_dir: pathlib.Path, config: Mapping) -> list[Tracker]:
    """The trackers `report_to` names, opened for the run in `run_dir` (named after it)."""
    return [TRACKERS[t](run_dir, run_dir.name, config) for t in report_to]
