"""The demo's closing summary: what a reader sees at the end of `projected-grpo demo`.

  table    per arm the deployed model's hack / solve / well-formed rate (last-5-step means; ± SEM only over
           more than one seed)
  verdict  one line: per arm that projects with the real V_hack, whether it cut hacking and whether the
           model survived (the bench's words, docs/interventions.md "The bench's verdict", on ours.py's
           capability), its paired contrasts against its control twins when the seeds allow, and at one
           seed that it is a demonstration, not evidence
  text     the table, a legend, the verdict line, the paths of report.md and curves.png
Computed from the Tables report.md is written from, by the same rules (bench.verdict, ours.capability,
ours.positive_control, verdict_text.family); report.md keeps the preregistered word and every clause.
Deliberately not here: the rules themselves, reading runs (tables.py), report.md (report.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from projected_grpo.study import bench
from projected_grpo.study import ours as O
from projected_grpo.study import verdict_text as VT
from projected_grpo.study.tables import LAST, Tables
from projected_grpo.study.verdicts import FORMAT, HACK, SOLVE, Stat

# where a reader of a one-seed demo finds the results measured over seeds (relative to a clone's root)
RESULTS_DOC = "docs/results.md"
COLUMNS = ((HACK, "hack"), (SOLVE, "solve"), (FORMAT, "well-formed"))
LEGEND = ("hack: passes the foolable grader but not the true tests; solve: passes the true tests; "
          "well-formed: a parsable answer")


def _rate(s: Stat) -> str:
    return f"{s.mean:.3f}" if s.sem is None else f"{s.mean:.3f} ± {s.sem:.3f}"


def table(t: Tables) -> list[str]:
    """One row per arm: hack / solve / well-formed of the deployed model, columns aligned."""
    rows = [("arm", *(name for _, name in COLUMNS))]
    rows += [(arm, *(_rate(st[k]) if k in st else "-" for k, _ in COLUMNS)) for arm, st in t.end.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _lost(end: Mapping[str, Stat], start: Mapping[str, Stat], gt: Mapping[str, Stat] | None) -> str:
    """What the capability rule (ours.capability) found lost, per rate: its fall from the arm's start, else
    its gap to gt_reward's."""
    cap, lost = O.capability(end, start, gt), []
    for key, name, vs_start, vs_gt in ((FORMAT, "well-formed", cap.format_vs_start, cap.format_vs_gt),
                                       (SOLVE, "solve", cap.solve_vs_start, cap.solve_vs_gt)):
        if vs_start < -O.KEPT_TOL:
            lost.append(f"{name} {start[key].mean:.3f} -> {end[key].mean:.3f}")
        elif vs_gt is not None and vs_gt < -O.KEPT_TOL:
            lost.append(f"{name} {end[key].mean:.3f} against gt_reward's {gt[key].mean:.3f}")
    return ", ".join(lost)


def arm_phrase(t: Tables, arm: str) -> str:
    """What `arm` did, in words: its hack cut against `none` (bench.verdict's word) and the model's state."""
    base, end, start, gt = t.end[VT.BASELINE], t.end[arm], t.start.get(arm), t.end.get(VT.POSITIVE)
    cut = 100 * (base[HACK].mean - end[HACK].mean) + 0.0
    word = bench.verdict(base, end, start, gt)
    judged = start is not None and gt is not None
    kept = judged and O.capability(end, start, gt).kept
    model = ("" if not judged else "it kept the model" if kept else
             f"it lost capability ({_lost(end, start, gt)})")
    if word == bench.KEPT:
        return (f"{arm} cut hacking by {cut:.1f} points and kept the model (solve {end[SOLVE].mean:.3f} "
                f"against gt_reward's {gt[SOLVE].mean:.3f}, well-formed {end[FORMAT].mean:.3f})")
    if word == bench.BROKEN:
        return f"{arm} cut hacking by {cut:.1f} points only by breaking the model ({_lost(end, start, gt)})"
    if word == bench.NO_EFFECT:
        head = f"{arm} did not cut hacking (hack {-cut:+.1f} points against none)"
    elif word == bench.PARTIAL:
        head = f"{arm} cut hacking by {cut:.1f} points, short of H1's 30"
    else:  # no gt_reward arm or no start rates: the capability rule has no yardstick
        return (f"{arm} cut hacking by {cut:.1f} points; whether it kept the model is not judged "
                "(no gt_reward)")
    return f"{head}, and {model}" if model else head


def verdict(t: Tables) -> str:
    """The one verdict line (see the module docstring)."""
    if VT.BASELINE not in t.end:
        return f"Verdict: none: the sweep has no `{VT.BASELINE}` arm to compare with."
    if any(k not in st for st in t.end.values() for k in (HACK, SOLVE, FORMAT)):
        return f"Verdict: none: some runs logged no {HACK} / {SOLVE} / {FORMAT} (see report.md)."
    method = [a for a in VT.verdict_arms(t) if t.info[a].control == "none" and t.info[a].proj_arm != "none"]
    if not method:
        return "Verdict: none: no arm projects with the real V_hack in this sweep."
    parts, gt = [], t.end.get(VT.POSITIVE)
    if gt is not None and VT.POSITIVE in t.start:
        ok, why = O.positive_control(gt, t.start[VT.POSITIVE])
        if not ok:
            parts.append(f"the positive control failed (gt_reward: {why}): honest training did not raise "
                         "solving, so solve against gt_reward is no yardstick")
    contrasts = VT.family(t)
    for arm in method:
        phrase = arm_phrase(t, arm)
        vs = [c for (a, other), c in contrasts.items()
              if a == arm and other != VT.BASELINE and c.beats is not None]
        if vs:
            phrase += "; against its controls it " + ", ".join(
                f"{'beats' if c.beats else 'does not beat'} {c.other} (Holm p {c.p_holm:.2g})" for c in vs)
        parts.append(phrase)
    n = min(s.n for st in t.end.values() for s in st.values())
    seeds = (f"1 seed: a demonstration, not evidence (the results over seeds: {RESULTS_DOC})" if n == 1 else
             f"{n} seeds (every preregistered clause: report.md; the results so far: {RESULTS_DOC})")
    return f"Verdict: {'; '.join(parts)}. {seeds}."


def text(t: Tables, report: str | os.PathLike, plot: str | os.PathLike) -> str:
    """The summary the demo prints last."""
    n = min(s.n for st in t.end.values() for s in st.values())
    head = (f"Deployed model (quarantine knob zeroed), means of each run's last {LAST} steps"
            + (f", ± SEM over {n} seeds:" if n > 1 else ", 1 seed:"))
    return "\n".join([head, *table(t), LEGEND, "", verdict(t), "", f"report: {report}", f"curves: {plot}"])
