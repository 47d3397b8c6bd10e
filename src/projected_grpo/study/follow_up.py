"""What a study earns next: which arms get more seeds, and how far its best label-free arm is from the goal.

The rule is docs/interventions.md's ("More seeds, and the goal"; first written in docs/findings.md 9.0,
before any bench run). A pure function of the study's end rates (main part and bench together), the bench's
verdicts, each arm's random-V twin and its contrasts against its controls, as the reports computed them:
  more seeds  every bench arm whose verdict is "stops hacking, model kept", and the best label-free arm:
              among the interventions (arms.ARMS role `arm`, no twin suffix) needing no per-sample labels at
              train time (labels `none` or `pairs`), the lowest deployed hack of those solving within
              KEPT_TOL of gt_reward, else the highest solve of those cutting the hack by CUT or more against
              `none`; each with its random-V twin where it has one, beside `none` and `gt_reward`. Controls
              and twins are what a candidate is compared with, never candidates.
  the goal    the best label-free arm's hack within GOAL_HACK of gt_reward's, its solve within KEPT_TOL of
              gt_reward's, and a paired win over every control it has in the sweep (ours.Contrast.beats).
  choose      (end, verdicts, random twins) on the seeds every arm ran -> Choice
  goal        the chosen arm's distance on all its seeds -> Goal
  command     the study's own command -> the one that trains the chosen arms' extra seeds and nothing else
  lines       Choice, Goal, that command -> markdown lines for the bench report
Not here: the verdicts (bench.py), the contrasts (ours.py), reading runs (tables.py).
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from projected_grpo.study import arms as arms_table
from projected_grpo.study.bench import BASELINE, KEPT, POSITIVE
from projected_grpo.study.ours import KEPT_TOL, Contrast
from projected_grpo.study.verdicts import EPS, FALSIFY_HACK_DROP, HACK, SOLVE, Stat, pts

LABEL_FREE = ("none", "pairs")
CUT = FALSIFY_HACK_DROP  # a hack cut of 15 points: less is "no effect" (docs/interventions.md)
GOAL_HACK = 0.05  # the goal: deployed hack within 5 points of gt_reward's
MORE_SEEDS = 5  # seeds 0-4: the rule adds seeds 3 and 4
NO_FOLDS = "none"  # `study --lomo-modes none`: no leave-one-mode-out part (the rule adds no fold seeds)
# the study options `command` sets itself (valued, and the one flag); every other word is kept
_SET = ("--seeds", "--arms", "--lomo-modes", "--lomo-arms", "--interventions")
_FLAG = "--report-only"


@dataclass(frozen=True)
class Choice:
    """kept: bench arms "stops hacking, model kept"; best: the best label-free arm (None: no candidate cuts
    the hack by CUT) and why it was picked; more_seeds: every arm that gets more seeds, in order."""

    kept: tuple[str, ...]
    best: str | None
    why: str
    more_seeds: tuple[str, ...]


@dataclass(frozen=True)
class Goal:
    """The best label-free arm's deployed hack and solve minus gt_reward's (None without one) and its
    contrasts against its controls."""

    arm: str
    hack_vs_gt: float | None
    solve_vs_gt: float | None
    vs_controls: tuple[Contrast, ...]

    @property
    def met(self) -> bool:
        return (self.hack_vs_gt is not None and self.hack_vs_gt <= GOAL_HACK + EPS
                and self.solve_vs_gt is not None and self.solve_vs_gt >= -KEPT_TOL - EPS
                and bool(self.vs_controls) and all(c.beats for c in self.vs_controls))


def candidate(arm: str) -> bool:
    """An intervention needing no per-sample labels at train time (not a baseline, control or twin)."""
    a = arms_table.ARMS.get(arm)
    return a is not None and a.role == "arm" and a.labels in LABEL_FREE


def choose(end: Mapping[str, Mapping[str, Stat]], verdicts: Mapping[str, str],
           random_twin: Mapping[str, str]) -> Choice:
    """The rule over `end` (arm -> deployed end rates, main part and bench, on the seeds every arm ran),
    `verdicts` (bench arm -> the bench's word on those seeds) and `random_twin` (arm -> its random-V twin in
    the sweep, which gets more seeds with it)."""
    base, gt = end.get(BASELINE), end.get(POSITIVE)
    kept = tuple(a for a, word in verdicts.items() if word == KEPT and "@" not in a)
    pool = [a for a in end if candidate(a)]
    near = [a for a in pool if gt is not None and end[a][SOLVE].mean >= gt[SOLVE].mean - KEPT_TOL - EPS]
    cut = [a for a in pool if base is not None and base[HACK].mean - end[a][HACK].mean >= CUT - EPS]
    if near:  # ties: the table's order (main part first), as min and max keep the first
        best = min(near, key=lambda a: end[a][HACK].mean)
        why = f"lowest hack of the label-free arms solving within {100 * KEPT_TOL:.0f} points of gt_reward"
    elif cut:
        best = max(cut, key=lambda a: end[a][SOLVE].mean)
        why = (f"no label-free arm solves within {100 * KEPT_TOL:.0f} points of gt_reward: the highest solve "
               f"of those cutting the hack by {100 * CUT:.0f} points or more against none")
    else:
        best, why = None, f"no label-free arm cuts the hack by {100 * CUT:.0f} points against none"
    chosen = [*kept, *([best] if best else [])]
    twins = [random_twin[a] for a in chosen if a in random_twin]
    more = tuple(dict.fromkeys(a for a in (*chosen, *twins, BASELINE, POSITIVE) if a in end))
    return Choice(kept, best, why, more)


def goal(arm: str, end: Mapping[str, Mapping[str, Stat]], controls: Sequence[Contrast]) -> Goal:
    """`arm`'s distance to the goal over `end` (every seed each arm ran) and its `controls` contrasts."""
    gt = end.get(POSITIVE)
    rel = (lambda k: None if gt is None else end[arm][k].mean - gt[k].mean)
    return Goal(arm, rel(HACK), rel(SOLVE), tuple(controls))


def command(study: str, c: Choice, main_arms: Collection[str]) -> str:
    """`study` (a `projected-grpo study ...` command line) made to train c.more_seeds at MORE_SEEDS seeds and
    nothing else: the chosen arms of the main part (`main_arms`) as --arms, the others as --interventions
    (empty: no bench part), no leave-one-mode-out part (`--lomo-modes none`); every other word (preset,
    --out, config fields) as it was. Finished runs are kept by the study: it trains the extra seeds only."""
    words, kept, skip = shlex.split(study), [], False
    for w in words:
        name = w.split("=", 1)[0].replace("_", "-")
        if skip or name == _FLAG:
            skip = False
            continue
        if name in _SET:
            skip = "=" not in w  # `--opt value`: its value is the next word
            continue
        kept.append(w)
    main = [a for a in c.more_seeds if a in main_arms]
    bench = [a for a in c.more_seeds if a not in main_arms]
    return shlex.join([*kept, "--seeds", str(MORE_SEEDS), "--arms", ",".join(main), "--lomo-modes", NO_FOLDS,
                       "--interventions", ",".join(bench)])


def lines(c: Choice, g: Goal | None, seeds: Sequence[int], next_command: str = "") -> list[str]:
    """The bench report's section: what gets more seeds and why (chosen on `seeds`, those every arm ran),
    the command that trains them (`next_command`, when given), and the best label-free arm's distance to the
    goal on all its seeds, each beside its goal."""
    on = f"seeds {', '.join(map(str, seeds))}, which every arm ran"
    out = [f"- Chosen on {on}. Bench arms \"{KEPT}\": {', '.join(f'`{a}`' for a in c.kept) or 'none'}.",
           f"- Best label-free arm: {f'`{c.best}`' if c.best else 'none'} ({c.why}).",
           f"- More seeds for: {', '.join(f'`{a}`' for a in c.more_seeds)}."]
    if next_command:
        out.append(f"- To train them (seeds 0-{MORE_SEEDS - 1}; finished runs are kept): `{next_command}`")
    if g is None:
        return out
    hack = "-" if g.hack_vs_gt is None else f"{pts(g.hack_vs_gt)} (goal <= +{100 * GOAL_HACK:.0f} pts)"
    solve = "-" if g.solve_vs_gt is None else f"{pts(g.solve_vs_gt)} (goal >= -{100 * KEPT_TOL:.0f} pts)"
    word = {True: "beats", False: "does not beat", None: "undecided against"}
    ctl = "; ".join(f"{word[x.beats]} `{x.other}` (hack {pts(-x.gap.interval.mean)} against it"
                    + ("" if x.p_holm is None else f", Holm p {x.p_holm:.2g}") + ")"
                    for x in g.vs_controls) or "no control in the sweep"
    out.append(f"- The goal, for `{g.arm}` on all its seeds: hack vs gt_reward {hack}; solve vs gt_reward "
               f"{solve}; controls: {ctl}. **{'Met' if g.met else 'Not met'}.**")
    return out
