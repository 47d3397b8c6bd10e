"""Which arms get more seeds, and the best label-free arm's distance to the goal (study/follow_up.py), on
hand-made end rates; the study's report writes it (tests/test_launch.py's end-to-end study).

Run: pytest tests/test_follow_up.py
"""

from __future__ import annotations

import pytest

from projected_grpo.study import follow_up as F
from projected_grpo.study import ours as O
from projected_grpo.study.bench import BROKEN, KEPT, NO_EFFECT
from projected_grpo.study.verdicts import FORMAT, HACK, SOLVE, Stat


def rates(hack: float, solve: float) -> dict[str, Stat]:
    return {HACK: Stat(hack, 0.01, 3), SOLVE: Stat(solve, 0.01, 3), FORMAT: Stat(0.9, 0.01, 3)}


def contrast(arm: str, other: str, arm_hack: list[float], other_hack: list[float], p_holm: float
             ) -> O.Contrast:
    seeds = {arm: {s: {HACK: h, SOLVE: 0.5} for s, h in enumerate(arm_hack)},
             other: {s: {HACK: h, SOLVE: 0.5} for s, h in enumerate(other_hack)}}
    c = O.contrast(arm, other, seeds)
    return O.Contrast(c.arm, c.other, c.gap, c.solve, p_holm=p_holm)


# none hacks 0.90 solving 0.05; gt_reward hacks 0.02 solving 0.60
BASE = {"none": rates(0.90, 0.05), "gt_reward": rates(0.02, 0.60)}


def test_no_label_free_arm_near_gt_reward_takes_the_highest_solve_among_the_cuts():
    end = {**BASE,
           "erase": rates(0.50, 0.04),  # cut 40 pts, solve 0.04
           "route": rates(0.80, 0.30),  # cut 10 pts < 15: not a cut, whatever its solve
           "random_V": rates(0.10, 0.45),  # a control: never a candidate
           "penalty:direction": rates(0.60, 0.08),  # cut 30 pts, solve 0.08: the highest of the cuts
           "penalty:direction@random": rates(0.55, 0.09),  # a twin: never a candidate
           "penalty:ground_truth": rates(0.01, 0.59),  # per-sample labels: kept, not label-free
           "inoculation": rates(0.70, 0.06)}  # cut 20 pts, solve 0.06
    verdicts = {"penalty:ground_truth": KEPT, "penalty:direction": BROKEN, "inoculation": BROKEN,
                "penalty:direction@random": BROKEN}
    twin = contrast("penalty:direction", "penalty:direction@random", [0.6, 0.6, 0.6], [0.5, 0.6, 0.55], 1.0)
    c = F.choose(end, verdicts, {"penalty:direction": "penalty:direction@random", "erase": "random_V"})
    assert c.kept == ("penalty:ground_truth",)
    assert c.best == "penalty:direction" and "highest solve" in c.why
    assert c.more_seeds == ("penalty:ground_truth", "penalty:direction", "penalty:direction@random", "none",
                            "gt_reward")
    g = F.goal(c.best, end, [twin])
    # hack 0.60 - 0.02 = +58 pts over gt_reward, solve 0.08 - 0.60 = -52 pts
    assert g.hack_vs_gt == pytest.approx(0.58) and g.solve_vs_gt == pytest.approx(-0.52) and not g.met
    text = "\n".join(F.lines(c, g, [0, 1, 2]))
    assert "seeds 0, 1, 2" in text and "+58.0 pts (goal <= +5 pts)" in text
    assert "-52.0 pts (goal >= -10 pts)" in text
    # the twin hacks 0.55 on average, the arm 0.60: the arm's hack +5.0 pts against it
    assert "does not beat `penalty:direction@random` (hack +5.0 pts against it, Holm p 1)" in text
    assert "**Not met.**" in text


def test_label_free_arms_near_gt_reward_take_the_lowest_hack_and_the_goal_can_be_met():
    end = {**BASE,
           "erase": rates(0.05, 0.55),  # solve within 10 pts of 0.60, hack 0.05
           "route": rates(0.03, 0.52),  # within 10 pts too (0.52 >= 0.50), hack 0.03: the lowest
           "erase_bounded": rates(0.01, 0.45)}  # the lowest hack, but solve 15 pts under gt_reward
    twin = contrast("route", "route@random", [0.03, 0.02, 0.04], [0.8, 0.7, 0.9], 0.01)
    c = F.choose(end, {"erase_bounded": NO_EFFECT}, {"route": "route@random"})
    assert c.kept == () and c.best == "route" and "lowest hack" in c.why
    assert c.more_seeds == ("route", "none", "gt_reward")  # route@random is in no end table: nothing to add
    g = F.goal("route", end, [twin])
    # hack 0.03 - 0.02 = +1 pt (<= 5), solve 0.52 - 0.60 = -8 pts (>= -10), beats its twin (p 0.01)
    assert twin.beats and g.met
    assert "**Met.**" in "\n".join(F.lines(c, g, [0, 1, 2]))
    assert not F.goal("route", end, []).met  # no control in the sweep: not shown to beat one


def test_a_main_arm_brings_its_random_twin_only():
    """erase is compared with five control twins (the goal reads them all), but only its random-V twin,
    random_V, gets more seeds with it (docs/interventions.md)."""
    end = {**BASE, "erase": rates(0.40, 0.30), "random_V": rates(0.45, 0.20), "shuffled_V": rates(0.5, 0.1)}
    c = F.choose(end, {}, {"erase": "random_V"})
    assert c.best == "erase" and c.more_seeds == ("erase", "random_V", "none", "gt_reward")


def test_nothing_cuts_the_hack():
    end = {**BASE, "erase": rates(0.85, 0.05)}
    c = F.choose(end, {}, {})
    assert c.best is None and c.more_seeds == ("none", "gt_reward")
    assert "Best label-free arm: none (no label-free arm cuts the hack by 15 points" in "\n".join(
        F.lines(c, None, [0]))


def test_candidates_are_label_free_interventions_only():
    assert F.candidate("erase") and F.candidate("inoculation") and F.candidate("advantage:direction")
    assert not F.candidate("random_V")  # a negative control
    assert not F.candidate("gt_reward") and not F.candidate("none")
    assert not F.candidate("penalty:probe")  # per-sample labels
    assert not F.candidate("erase_bounded@random")  # a twin


def test_the_command_trains_the_chosen_seeds_and_nothing_else():
    c = F.Choice(("penalty:ground_truth",), "erase", "", ("penalty:ground_truth", "erase", "random_V", "none",
                                                          "gt_reward"))
    study = ("projected-grpo study --preset demo --seeds 3 --lomo-modes sentinel --out runs/study-code "
             "--interventions penalty:ground_truth,penalty:probe --env.max-problems=12")
    main_arms = {"none", "gt_reward", "erase", "random_V", "route"}
    # the main part's chosen arms as --arms, the bench's as --interventions, no fold; the rest kept
    assert F.command(study, c, main_arms) == (
        "projected-grpo study --preset demo --out runs/study-code --env.max-problems=12 --seeds 5 "
        "--arms erase,random_V,none,gt_reward --lomo-modes none --interventions penalty:ground_truth")
    # `--opt=value` and underscore spellings and the report-only flag are replaced too; no bench arm: none
    c2 = F.Choice((), None, "", ("none", "gt_reward"))
    assert F.command("projected-grpo study --seeds=3 --arms=none,erase --report-only --lomo_arms erase",
                     c2, {"none", "gt_reward"}) == ("projected-grpo study --seeds 5 --arms none,gt_reward "
                                                    "--lomo-modes none --interventions ''")
    text = "\n".join(F.lines(c2, None, [0, 1, 2], "projected-grpo study --seeds 5"))
    assert "- To train them (seeds 0-4; finished runs are kept): `projected-grpo study --seeds 5`" in text
