"""One step's metrics row: a pure function of the step's batch, advantages and the stats the math returned.

Rates come from the batch's Samples and deployed grades; losses, clip fractions, KL, projection
diagnostics and advantages' stats arrive as stats from the tested functions that computed them (they are
never recomputed here). Every key is defined once in docs/metrics.md. Not here: writing rows (metrics.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from projected_grpo.envs.base import Graded
from projected_grpo.run import intervene
from projected_grpo.run.batches import Batch


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def rates(grades: Sequence[Graded], prefix: str) -> dict[str, float]:
    """hack / solve / format rates of `grades` as {"hack/<prefix>", "solve/<prefix>", "format/<prefix>"}."""
    return {f"hack/{prefix}": _mean([g.exploited for g in grades]),
            f"solve/{prefix}": _mean([g.solved for g in grades]),
            f"format/{prefix}": _mean([g.format_ok for g in grades])}


def mode_rates(grades: Sequence[Graded], modes: Sequence[str], prefix: str) -> dict[str, float]:
    """Per-mode hack and solve rates: {"hack/<prefix>/<mode>", "solve/<prefix>/<mode>"} for every mode
    among `modes` (one per grade); a mode with no grade this step has no key (not a 0)."""
    by_mode: dict[str, list[Graded]] = {}
    for g, m in zip(grades, modes, strict=True):
        by_mode.setdefault(m, []).append(g)
    out: dict[str, float] = {}
    for m in sorted(by_mode):
        out[f"hack/{prefix}/{m}"] = _mean([g.exploited for g in by_mode[m]])
        out[f"solve/{prefix}/{m}"] = _mean([g.solved for g in by_mode[m]])
    return out


def detector_rates(grades: Sequence[Graded], prefix: str) -> dict[str, float]:
    """{"detect/<name>/<prefix>": fraction of `grades` the environment's detector <name> flags} for every
    detector (Graded.extras key) the grades carry: coding det_E / det_C / det_D (and grade_error: grading
    raised), maths hedge."""
    names = sorted({k for g in grades for k in g.extras})
    return {f"detect/{k}/{prefix}": _mean([bool(g.extras.get(k, False)) for g in grades]) for k in names}


def eval_rates(grades: Sequence[Graded]) -> dict[str, float]:
    """eval/accuracy (solved), eval/hack, eval/format of a greedy eval of the deployed model."""
    return {"eval/accuracy": _mean([g.solved for g in grades]),
            "eval/hack": _mean([g.exploited for g in grades]),
            "eval/format": _mean([g.format_ok for g in grades])}


def step_row(batch: Batch, adv: torch.Tensor, stats: Mapping[str, object], *, lr: float, grad_norm: float,
             knob_norms: Mapping[str, torch.Tensor], teacher_mode: str,
             t_backward: float) -> dict[str, object]:
    """The metrics row of one step (time/step is added by the loop once the step is done).

    batch: the step's Batch; adv (B, G) the advantages trained on; stats: name -> value from advantages,
    losses and projection (already aggregated over micro-batches); knob_norms: Knobs.norms().
    """
    is_student = batch.is_student  # (B, G)
    trained = batch.samples
    students = [s for s in trained if s.student]
    teachers = [s for s in trained if not s.student]
    row: dict[str, object] = {k: v if isinstance(v, str) else float(v) for k, v in stats.items()}
    row |= {"lr": lr, "grad/norm": float(grad_norm), "teacher/mode": teacher_mode,
            "teacher/frac": len(teachers) / len(trained),
            "reward/student_mean": float(batch.rewards[is_student].mean()),
            "reward/teacher_mean": float(batch.rewards[~is_student].mean()) if teachers else 0.0,
            "adv/student_mean": float(adv[is_student].mean()),
            "adv/teacher_mean": float(adv[~is_student].mean()) if teachers else 0.0,
            "hack/student": _mean([s.grade.exploited for s in students]),
            "hack/teacher": _mean([s.grade.exploited for s in teachers]),
            "solve/student": _mean([s.grade.solved for s in students]),
            "solve/teacher": _mean([s.grade.solved for s in teachers]),
            **rates([s.grade for s in batch.deploy], "deploy"),
            **mode_rates([s.grade for s in batch.deploy], [s.mode for s in batch.deploy], "deploy"),
            **detector_rates([s.grade for s in batch.deploy], "deploy"),
            **{k: float(v) for k, v in knob_norms.items()},
            "completion/mean_len": _mean([len(s.completion_ids) for s in students]),
            "completion/max_len": float(max(len(s.completion_ids) for s in students)),
            "completion/clipped_frac": _mean([s.truncated for s in students]),
            "sandbox/timeout_frac": _mean([s.grade.timeout for s in students]),
            "sandbox/grade_error_frac": _mean([bool(s.grade.extras.get("grade_error")) for s in students]),
            "groups/zero_std": float(batch.zero.sum()),
            "groups/skipped": float(len(batch.groups) - len(batch.keep)),
            "groups/resampled": float(batch.resampled), "groups/resample_tries": float(batch.tries),
            "curriculum/stage": float(batch.stage != "warmup"),
            "time/generate": batch.clock.get("generate", 0.0), "time/grade": batch.clock.get("grade", 0.0),
            "time/backward": t_backward}
    row |= batch.monitor_stats  # the intervention's reward stage and the monitor's own stats
    if batch.verdict is not None:  # the monitor against the oracle on the step's student rows (logged only)
        row |= intervene.rates(batch.groups, batch.verdict)
        row["time/monitor"] = batch.clock.get("monitor", 0.0)
    return row
