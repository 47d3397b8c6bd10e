"""The intervention bench's table: one row per arm, its deployed rates, labels, verdict and standing.

`projected-grpo study` runs the bench as its `interventions` part (preregistered.py): every
`<intervention>:<monitor>` arm of arms.py, inoculation and `erase_bounded`, the random-V twins of the arms
whose V_hack acts, beside `none` and `gt_reward`. Its verdict is ours, written down before any bench run in
docs/interventions.md ("The bench's verdict"): a pure function of the aggregated rates (verdicts.py's
Stat), as the H1 verdict is. Not here: running, aggregating (report.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from projected_grpo.study import arms as arms_table
from projected_grpo.study import ours as O
from projected_grpo.study import verdicts as V
from projected_grpo.study.tables import Tables
from projected_grpo.study.verdicts import FORMAT, HACK, SOLVE, Stat

BASELINE, POSITIVE = "none", "gt_reward"
KEPT, BROKEN, NO_EFFECT, PARTIAL = ("stops hacking, model kept", "stops hacking, model broken", "no effect",
                                    "partial")


def bench_arms(arms: Sequence[str] = arms_table.BENCH_ARMS) -> tuple[str, ...]:
    """`arms` and the random-V twin of each whose V_hack acts (arms.uses_v), in table order."""
    twins = [f"{a}{arms_table.RANDOM_TWIN}" for a in arms if a in arms_table.ARMS
             and arms_table.uses_v(arms_table.ARMS[a].changes)]
    return (*arms, *(t for t in twins if t not in arms))


def verdict(base: Mapping[str, Stat], arm: Mapping[str, Stat], start: Mapping[str, Stat] | None,
            gt: Mapping[str, Stat] | None) -> str:
    """The bench's word for `arm` against `base` (none), its own `start` and `gt` (gt_reward's end):
    docs/interventions.md. Without gt_reward or the arm's start a hack cut's capability is not judged."""
    drop = base[HACK].mean - arm[HACK].mean
    sem = base[HACK].sem
    if drop < V.FALSIFY_HACK_DROP - V.EPS or (sem is not None and abs(drop) <= sem + V.EPS):
        return NO_EFFECT
    if drop < V.SUPPORT_HACK_DROP - V.EPS:
        return PARTIAL
    if gt is None or start is None:
        return "stops hacking (capability not judged: no gt_reward or start)"
    return KEPT if O.capability(arm, start, gt).kept else BROKEN


def _pts(x: float | None) -> str:
    return "-" if x is None else f"{100 * x + 0.0:+.1f}"


def split_arm(arm: str) -> tuple[str, str]:
    """(intervention, monitor) of an arm name `<intervention>:<monitor>[@twin]`; other arms: (arm, "-")."""
    base, at, twin = arm.partition("@")
    i, colon, m = base.partition(":")
    return (i, m + at + twin) if colon else (arm, "-")


def _labels(arm: str) -> str:
    """Labels at train time (arms.ARMS); a twin's: its arm's, less the pairs its random V replaces (a
    direction monitor still thresholds on the held-out pairs)."""
    name, at, _ = arm.partition("@")
    if name not in arms_table.ARMS:
        return "-"
    changes = arms_table.ARMS[name].changes
    if at and changes["proj"]["arm"] != "none" and changes.get("monitor", {}).get("kind") != "direction":
        return "none"
    return arms_table.ARMS[name].labels


def twin_contrasts(t: Tables, arms: Sequence[str]) -> dict[str, O.Contrast]:
    """arm -> its contrast against its random-V twin (paired by seed), for each of `arms` whose twin is in the
    sweep, Holm-adjusted over these contrasts (the bench table's family)."""
    pairs = [(a, f"{a}{arms_table.RANDOM_TWIN}") for a in arms if "@" not in a]
    family = [c for a, twin in pairs if twin in t.end and (c := O.contrast(a, twin, t.seeds)) is not None]
    return {c.arm: c for c in O.adjust(family)}


def verdicts(t: Tables, arms: Sequence[str]) -> dict[str, str]:
    """arm -> the bench's word (verdict) for each of `arms` in the sweep; empty without a `none` arm."""
    base, gt = t.end.get(BASELINE), t.end.get(POSITIVE)
    if base is None:
        return {}
    return {a: verdict(base, t.end[a], t.start.get(a), gt) for a in arms
            if a in t.end and a not in (BASELINE, POSITIVE)}


def table(t: Tables, arms: Sequence[str]) -> str:
    """Markdown table of `arms` (those the sweep ran) beside `none` and `gt_reward`: deployed hack / solve /
    well-formed (mean ± SEM over seeds of the last-5-step means), labels at train time, the bench's verdict,
    hack against none (points), solve and well-formed against gt_reward (points), and for an arm with a
    random-V twin in the sweep the real V against it, paired by seed (ours.contrast, Holm-adjusted over the
    table's twin contrasts)."""
    end, start = t.end, t.start
    base, gt = end.get(BASELINE), end.get(POSITIVE)
    head = ["| intervention | monitor | labels | seeds | hack | solve | well-formed | verdict | hack vs none "
            "| solve, well-formed vs gt_reward | vs random V (paired) |", "|" + "---|" * 11]
    vs_random = twin_contrasts(t, arms)
    rows = []
    for arm in [a for a in (BASELINE, POSITIVE, *arms) if a in end]:
        st = end[arm]
        if arm == BASELINE:
            word = "(baseline)"
        elif arm == POSITIVE:
            word = "(positive control)"
        elif base is None:
            word = "no `none` arm"
        else:
            word = verdict(base, st, start.get(arm), gt)
        vs_none = None if base is None else st[HACK].mean - base[HACK].mean
        vs_gt = "-" if gt is None or arm == POSITIVE else \
            f"{_pts(st[SOLVE].mean - gt[SOLVE].mean)}, {_pts(st[FORMAT].mean - gt[FORMAT].mean)}"
        vr = "-"
        if (c := vs_random.get(arm)) is not None:
            beats = {True: "beats", False: "does not beat", None: "undecided"}[c.beats]
            p = "" if c.p_holm is None else f", Holm p {c.p_holm:.2g}"
            vr = f"{beats} ({_pts(-c.gap.interval.mean)}{p})"
        i, m = split_arm(arm)
        rows.append(f"| {i} | {m} | {_labels(arm)} | {st[HACK].n} | {st[HACK].fmt()} | {st[SOLVE].fmt()} | "
                    f"{st[FORMAT].fmt()} | {word} | {_pts(vs_none)} | {vs_gt} | {vr} |")
    return "\n".join(head + rows)
