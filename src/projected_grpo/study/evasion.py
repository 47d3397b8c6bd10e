"""Is a monitor evaded under training? Its recall against the oracle early and late, beside the hack's form.

An intervention that acts on a monitor's flags puts the monitor under optimisation pressure: a hack the
monitor does not flag earns its reward. The bench's second table (written below study/bench.py's) reads,
per run, the mean `monitor/recall` and `monitor/flagged_frac` over its first EARLY and its last LATE logged
steps, and over its last LATE steps the deployed hack rate beside each of the environment's detectors on the
deployed samples (`detect/<name>/deploy`). A recall that falls while the hack rate rises is evasion; a
detector rate that falls while the hack stays says the hack changed form (docs/interventions.md, "Is the
monitor evaded?"). Descriptive: no verdict reads this table.
  run_windows  one run's metric rows -> key -> (early mean, late mean)
  table        arm -> each seed's metric rows -> markdown
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from projected_grpo.run import metrics
from projected_grpo.study.bench import split_arm
from projected_grpo.study.verdicts import HACK, Stat, mean_sem

EARLY, LATE = 30, 50  # steps: the windows docs/findings.md 9.8 first read the maths bench's recall over
RECALL, FLAGGED = "monitor/recall", "monitor/flagged_frac"
NOT_A_FORM = ("detect/grade_error/deploy",)  # a grading failure, not a shape of the hack


def detector_keys(rows: Sequence[Mapping]) -> list[str]:
    """The `detect/<name>/deploy` keys the rows logged (grade errors left out), sorted."""
    return sorted({k for r in rows for k in r
                   if k.startswith("detect/") and k.endswith("/deploy") and k not in NOT_A_FORM})


def run_windows(rows: Sequence[Mapping], keys: Sequence[str]) -> dict[str, tuple[float | None, float | None]]:
    """key -> (mean over the first EARLY steps' rows that logged it, mean over the last LATE steps'), None
    where no row of the window logged it (recall is absent at a step with no hack)."""
    early = metrics.summarize(sorted(rows, key=lambda r: r["step"])[:EARLY], last=EARLY, keys=keys)
    late = metrics.summarize(rows, last=LATE, keys=keys)
    return {k: (early.get(k), late.get(k)) for k in keys}


def _stat(vals: Sequence[float | None]) -> Stat | None:
    got = [v for v in vals if v is not None]
    return mean_sem(got) if got else None


def _fmt(st: Stat | None, seeds: int) -> str:
    if st is None:
        return "-"
    return st.fmt() + ("" if st.n == seeds else f" (n {st.n})")


def table(rows_by_arm: Mapping[str, Sequence[Sequence[Mapping]]]) -> str:
    """Markdown: one row per arm (its seeds' metric rows, in the caller's order), mean ± SEM over seeds of:
    recall and flagged fraction, first EARLY -> last LATE steps (arms with a monitor); deployed hack and each
    detector's deployed rate over the last LATE steps. "(n k)" where only k seeds logged a value (recall
    needs a hack in the window)."""
    all_rows = [r for runs in rows_by_arm.values() for run in runs for r in run]
    dets = detector_keys(all_rows)
    head = [f"| intervention | monitor | seeds | recall, first {EARLY} -> last {LATE} steps | flagged, first "
            f"{EARLY} -> last {LATE} | hack, last {LATE} | "
            + " | ".join(f"{d.split('/')[1]}, last {LATE}" for d in dets) + " |",
            "|" + "---|" * (6 + len(dets))]
    lines = []
    for arm, runs in rows_by_arm.items():
        w = [run_windows(run, [RECALL, FLAGGED, HACK, *dets]) for run in runs]
        n = len(runs)
        cells = []
        for key in (RECALL, FLAGGED):
            early, late = _stat([x[key][0] for x in w]), _stat([x[key][1] for x in w])
            cells.append("-" if early is None and late is None else f"{_fmt(early, n)} -> {_fmt(late, n)}")
        cells += [_fmt(_stat([x[k][1] for x in w]), n) for k in (HACK, *dets)]
        i, m = split_arm(arm)
        lines.append(f"| {i} | {m} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(head + lines)
