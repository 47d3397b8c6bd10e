"""Run-directory metrics: one JSONL row per step, optional TensorBoard, progress bar, end-of-run summary.

Every metric name is defined once, in docs/metrics.md; `KNOWN_METRICS` mirrors that table's names
(a test keeps the two equal and checks that the required keys are all there). Rows are appended
with flush + fsync, numbers must be finite (a NaN is a bug to stop on, not a point to plot), and
`truncate_to` rewrites the file atomically on resume so a resumed run's rows equal an uninterrupted
run's. This module computes no metric itself: rows come from run/row.py.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import weakref
from collections.abc import Iterable, Mapping

from projected_grpo.store import naming, read_jsonl, write_text_atomic

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

# Every training row carries at least these keys (the original design's list, docs/metrics.md).
REQUIRED_METRICS: tuple[str, ...] = (
    "reward/mean", "reward/std", "reward/frac_zero_std", "hack/student", "hack/teacher",
    "solve/student", "solve/teacher", "loss/policy", "entropy/mean",
    "clip/low_frac", "clip/high_frac", "grad/norm", "proj/cin_student", "proj/cin_teacher",
    "proj/cin", "proj/cout", "proj/cout_update", "proj/fired_frac", "knob/hack_norm",
    "completion/mean_len", "completion/clipped_frac", "sandbox/timeout_frac", "time/generate",
    "time/grade", "time/backward", "time/step",
)

# Mirror of the names in docs/metrics.md (definitions live there only; tests/test_metrics.py keeps
# the two sets equal).
KNOWN_METRICS: frozenset[str] = frozenset(REQUIRED_METRICS) | frozenset({
    "step", "lr", "kl/mean", "reward/student_mean", "reward/teacher_mean", "reward/informative",
    "curriculum/stage",
    "adv/mean", "adv/std", "adv/abs_max", "adv/student_mean", "adv/teacher_mean",
    "groups/zero_std", "groups/skipped", "groups/resampled", "groups/resample_tries",
    "loss/kl", "kl/is_weight_mean", "clip/region_frac", "ratio/mean", "ratio/max",
    "teacher/mode", "teacher/frac", "teacher/ratio_mean", "teacher/is_weight_mean", "teacher/clip_frac",
    "sample/kl", "sample/logratio_abs_mean",
    "proj/norm_removed", "proj/skipped", "proj/cin_module_mean", "proj/cout_module_mean",
    "proj/cin_update", "proj/fired_frac_update", "proj/purged_frac",
    "proj/v_overlap", "knob/norm", "knob/step", "knob/hack_step", "completion/max_len", "eval/accuracy",
    "sandbox/grade_error_frac",
    "eval/hack", "eval/format",
    "hack/deploy", "solve/deploy", "format/deploy", "hack/deploy/<mode>", "solve/deploy/<mode>",
    "detect/det_E/deploy", "detect/det_C/deploy", "detect/det_D/deploy", "detect/hedge/deploy",
    "detect/grade_error/deploy",
    # monitors and interventions (run/intervene.py), the knob's place along V (projection.bound_drift)
    "monitor/precision", "monitor/recall", "monitor/flagged_frac", "monitor/penalised_frac",
    "monitor/screened_frac", "monitor/adv_shift", "monitor/threshold", "monitor/heldout_bacc",
    "groups/screened_out", "knob/v_coef", "knob/v_share", "knob/v_clamped", "time/monitor",
    # PPO (run/ppo.py) and DPO (run/dpo.py)
    "loss/value", "loss/entropy", "value/mean", "value/clip_frac", "value/returns_mean",
    "value/explained_var", "value/grad_norm", "adv/raw_std", "ppo/approx_kl", "loss/dpo", "dpo/accuracy",
    "dpo/reward_chosen",
    "dpo/reward_rejected", "dpo/margin", "dpo/logp_chosen", "dpo/logp_rejected", "dpo/heldout_loss",
    "dpo/heldout_margin", "dpo/heldout_accuracy", "dpo/hack_before", "dpo/solve_before", "dpo/format_before",
    "dpo/hack_after", "dpo/solve_after", "dpo/format_after",
})
# A `<mode>` in a KNOWN_METRICS name stands for one loophole mode's name (docs/metrics.md): one definition
# covers the family, e.g. hack/deploy/<mode> covers hack/deploy/run_tests.
MODE_SLOT = "<mode>"
_PATTERNS = [re.compile("^" + re.escape(k).replace(re.escape(MODE_SLOT), "[a-z0-9_]+") + "$")
             for k in KNOWN_METRICS if MODE_SLOT in k]
# summary.json: last-`last`-row means of these
SUMMARY_KEYS: tuple[str, ...] = (
    "reward/mean", "hack/student", "hack/teacher", "solve/student", "solve/teacher", "hack/deploy",
    "solve/deploy", "format/deploy", "proj/cin_student", "proj/cin_teacher", "proj/cin", "proj/cout",
)


def undocumented(keys: Iterable[str]) -> list[str]:
    """Keys not defined in docs/metrics.md (a test on the training loop's row should find none); a name with
    a `<mode>` slot there covers every key with a mode name in its place."""
    return sorted(k for k in keys if k not in KNOWN_METRICS and not any(p.match(k) for p in _PATTERNS))


def _clean_row(step: int, row: Mapping[str, object]) -> dict[str, object]:
    """{"step": step, **row} with numbers as finite floats; raises naming the first bad key."""
    out: dict[str, object] = {"step": int(step)}
    for k, v in row.items():
        if k == "step":
            raise ValueError("metrics row: 'step' is set by MetricsLogger.log(step, ...), not by the row")
        if isinstance(v, str):  # categorical (e.g. teacher/mode): JSON only, not TensorBoard
            out[k] = v
            continue
        try:
            f = float(v.item() if hasattr(v, "item") else v)  # accepts 0-d tensors / numpy scalars
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"metrics row at step {step}: {k!r} = {v!r} is not a number or string") from e
        if not math.isfinite(f):
            raise ValueError(f"metrics row at step {step}: {k!r} is {f} (every value must be finite)")
        out[k] = f
    return out


class MetricsLogger:
    """Appends one JSON line per step to `run_dir/metrics.jsonl`, and sends each row's numbers to the trackers
    `report_to` names (run/trackers.py: tensorboard, wandb, trackio). config: the run's config, for them."""

    def __init__(self, run_dir: str | os.PathLike, report_to: tuple[str, ...] = (),
                 config: Mapping[str, object] | None = None):
        from projected_grpo.run.trackers import open_trackers

        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._f = open(self.path, "a", encoding="utf-8")  # closed in close()
        try:
            self._trackers = open_trackers(tuple(report_to), self.run_dir, config or {})
        except BaseException:
            self._f.close()
            raise

    def log(self, step: int, row: Mapping[str, object]) -> dict[str, object]:
        """Validate and append {"step": step, **row}; returns the written row."""
        clean = _clean_row(step, row)
        with naming(self.path):  # a full disk's error names the file
            self._f.write(json.dumps(clean, allow_nan=False) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())  # a SIGKILL after log() returns cannot lose this row
        numbers = {k: v for k, v in clean.items() if k != "step" and isinstance(v, float)}
        for t in self._trackers:
            t.log(int(step), numbers)
        return clean

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        trackers, self._trackers = self._trackers, []
        for t in trackers:
            t.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a metrics.jsonl file; a malformed line raises naming the file and line number."""
    return [row for _, row in read_jsonl(path)]


def truncate_to(run_dir: str | os.PathLike, step: int) -> int:
    """Drop metrics rows with step > `step` (resume from a checkpoint at `step`); returns rows kept.

    A final line without its newline is a write cut off by a kill; it is dropped. Any other malformed
    line raises (read_rows). The rewrite is atomic.
    """
    path = pathlib.Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # cut-off last write
    kept = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno}): {line[:80]!r}") from e
        if row["step"] <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(kept)


def summarize(rows: list[Mapping[str, object]], last: int = 5,
              keys: Iterable[str] = SUMMARY_KEYS) -> dict[str, float]:
    """Mean of each key over the last `last` rows (by step) that carry it as a number.

    Keys that no row in that window carries are left out of the summary (e.g. proj/* under a run that
    logs no projection). Also reports `steps` (rows seen) and `last_step`.
    """
    if not rows:
        raise ValueError("summarize: no metrics rows (did the run log any step?)")
    window = sorted(rows, key=lambda r: r["step"])[-last:]
    out: dict[str, float] = {"steps": float(len(rows)), "last_step": float(window[-1]["step"])}
    for k in keys:
        vals = [float(r[k]) for r in window if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


# progress bar: the three numbers a human watches (reward up, hack rate, how hack-ward the gradient is)
PROGRESS_KEYS: dict[str, str] = {"reward": "reward/mean", "hack": "hack/student", "cin": "proj/cin"}


_OPEN_BARS: weakref.WeakSet = weakref.WeakSet()  # Progress bars not closed yet (close_bars)


class Progress:
    """tqdm bar over training steps whose postfix shows reward / hack / cin of the last row."""

    def __init__(self, total: int, initial: int = 0, disable: bool = False, desc: str = "train", file=None):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, disable=disable, desc=desc, dynamic_ncols=True,
                        file=file)
        _OPEN_BARS.add(self)

    def update(self, row: Mapping[str, object]) -> None:
        self.bar.set_postfix({short: f"{float(row[k]):.3f}" for short, k in PROGRESS_KEYS.items()
                              if isinstance(row.get(k), (int, float))}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        _OPEN_BARS.discard(self)


def close_bars() -> None:
    """Close every open Progress bar (a run that failed mid-step): its line ends, so the error printed next
    starts a line of its own, and no bar redraws after it when the process exits."""
    for bar in list(_OPEN_BARS):
        bar.close()
