"""check.py: V's held-out separation against its controls, by hand and on planted gradients.

Run: pytest tests/test_check.py
"""

from __future__ import annotations

import pytest
import torch

from projected_grpo.hack import check

E1, E2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])


def test_separation_hand_computed():
    # held-out pairs d: prompt 0 -> (3, 4) and (4, 3); prompt 1 -> (5, 0); prompt 2 -> (0, -2)
    # real V = e1: captures 3/5, 4/5 | 1 | relu(0) = 0 -> per prompt 0.7, 1.0, 0.0
    # control V = e2: 4/5, 3/5 | 0 | relu(-2) = 0 -> per prompt 0.7, 0.0, 0.0
    D = {"m": torch.tensor([[3.0, 4.0], [4.0, 3.0], [5.0, 0.0], [0.0, -2.0]])}
    out = check.separation(D, [0, 0, 1, 2], {"m": E1}, {"random": {"m": E2}})
    assert (out["n_pairs"], out["n_prompts"]) == (4, 3)
    assert out["scores"]["real"][0] == pytest.approx(1.7 / 3)
    assert out["scores"]["random"][0] == pytest.approx(0.7 / 3)
    # paired per prompt: 0, 1, 0 -> mean 1/3, sd 0.57735, t = (1/3) / (0.57735 / sqrt 3) = 1.0, df 2:
    # p = 0.4226
    v = out["vs"]["random"]
    assert v["diff"][0] == pytest.approx(1 / 3) and v["p"] == pytest.approx(0.4226, abs=1e-4)
    assert v["p_holm"] == pytest.approx(v["p"]) and v["beats"] is False and out["passed"] is False
    assert check.verdict(out)[0] is False and "random" in check.verdict(out)[1]


def _planted(n_prompts: int, seed: int = 0):
    """Held-out differences along e1 (the real V) with a little noise, 2 pairs per prompt."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.zeros(2 * n_prompts, 8)
    d[:, 0] = 1 + torch.rand(2 * n_prompts, generator=gen)
    d += 0.2 * torch.randn(d.shape, generator=gen)
    return {"m": d}, [i // 2 for i in range(2 * n_prompts)]


def test_real_v_beats_controls_that_miss_the_held_out_contrast():
    D, groups = _planted(10)
    real = {"m": torch.eye(8)[:1]}
    controls = {"random": {"m": torch.eye(8)[3:4]}, "energy": {"m": torch.eye(8)[5:6]},
                "shuffled": {"m": -torch.eye(8)[:1]}}  # same span, flipped: captures nothing one-sided
    out = check.separation(D, groups, real, controls, {"within": "no prompt has two distinct completions"})
    assert out["passed"] is True and all(v["beats"] for v in out["vs"].values())
    assert list(out["vs"]) == ["random", "energy", "shuffled"]  # check.CHECKED order
    assert out["scores"]["real"][0] > 0.9 and out["scores"]["shuffled"][0] < 0.1
    # Holm: the adjusted p-values are at least the raw ones
    assert all(v["p_holm"] >= v["p"] for v in out["vs"].values())
    text = "\n".join(check.lines(out))
    assert "10 held-out prompts / 20 pairs" in text and "real V beats it" in text
    assert "within V    not built: no prompt has two distinct completions" in text
    assert check.verdict(out) == (True, "V_hack beats every control on held-out pairs (random, energy, "
                                        "shuffled)")


def test_a_control_as_good_as_the_real_v_fails_the_check():
    D, groups = _planted(10)
    real = {"m": torch.eye(8)[:1]}
    out = check.separation(D, groups, real, {"random": {"m": torch.eye(8)[3:4]}, "energy": real})
    assert out["vs"]["energy"]["beats"] is False and out["vs"]["random"]["beats"] is True
    assert out["passed"] is False
    passed, why = check.verdict(out)
    assert passed is False and why.startswith("V_hack does NOT beat the energy control(s)")


def test_no_or_one_held_out_prompt_is_undecided():
    empty = check.separation({"m": torch.zeros(0, 2)}, [], {"m": E1}, {"random": {"m": E2}})
    assert empty["passed"] is None and empty["scores"] == {}
    assert check.verdict(empty) == (None, "V_hack unchecked (no held-out pairs)")
    assert "V is used unchecked" in check.lines(empty)[0]
    one = check.separation({"m": torch.tensor([[1.0, 0.0]])}, [0], {"m": E1}, {"random": {"m": E2}})
    assert one["scores"]["real"] == [1.0, None, None] and one["vs"]["random"]["beats"] is None
    assert one["passed"] is None and check.verdict(one)[0] is None


def test_ordering_hand_computed():
    # 3 prompts; completions (prompt, label, real score, control score):
    #   prompt 0: hack 3, clean 1, clean 2 | control: hack 0, cleans 1, 2
    #   prompt 1: hack 5, clean 4           | control: hack 1, clean 0
    #   prompt 2: hack 0, clean 1           | control: hack 1, clean 1 (a tie: 1/2)
    # within-prompt AUC real: 1 (3 > 1, 3 > 2), 1, 0 -> mean 2/3; control: 0, 1, 0.5 -> mean 0.5
    # real − control per prompt: 1, 0, -0.5 -> mean 1/6, sd = sqrt((25 + 1 + 16) / 36 / 2) = 0.7638
    # pooled real: hacks {3, 5, 0} vs cleans {1, 2, 4, 1}: 3 beats 1, 2, 1 (3 of 4); 5 beats all 4; 0 none
    #   -> 7 / 12; balanced accuracy at its best cut (> 4.5 flags the 5 alone: tpr 1/3, tnr 1; > 2.5 flags 3,
    #   5 and the clean 4: tpr 2/3, tnr 3/4 -> 0.708)
    labels = torch.tensor([True, False, False, True, False, True, False])
    groups = [0, 0, 0, 1, 1, 2, 2]
    real = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0, 0.0, 1.0])
    control = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 1.0, 1.0])
    out = check.ordering({"real": real, "random": control}, labels, groups, n_boot=200)
    assert (out["n_completions"], out["n_prompts"]) == (7, 3)
    assert out["auc"]["real"]["within"][0] == pytest.approx(2 / 3)
    assert out["auc"]["random"]["within"][0] == pytest.approx(0.5)
    assert out["auc"]["real"]["pooled"][0] == pytest.approx(7 / 12)
    lo, hi = out["auc"]["real"]["pooled"][1:]
    assert 0.0 <= lo <= 7 / 12 <= hi <= 1.0
    assert out["auc"]["real"]["bacc"] == pytest.approx((2 / 3 + 3 / 4) / 2)
    v = out["vs"]["random"]
    assert v["diff"][0] == pytest.approx(1 / 6)
    # t = (1/6) / (0.7638 / sqrt 3) = 0.378, df 2: two-sided p = 0.7418; one control: Holm = raw
    assert v["p"] == pytest.approx(0.7418, abs=1e-4) and v["p_holm"] == pytest.approx(v["p"])
    assert v["beats"] is False and out["passed"] is False


def test_ordering_real_beats_a_control_that_does_not_rank():
    # 10 prompts, each a hack scored above its two cleans by the real V; the control scores noise
    gen = torch.Generator().manual_seed(0)
    labels = torch.tensor([True, False, False] * 10)
    groups = [i // 3 for i in range(30)]
    real = torch.randn(30, generator=gen) + 5 * labels
    noise = torch.randn(30, generator=gen)
    out = check.ordering({"real": real, "energy": noise, "within": -real}, labels, groups, seed=1)
    assert out["passed"] is True and list(out["vs"]) == ["energy", "within"]  # check.CHECKED order
    assert out["auc"]["real"]["within"][0] == 1.0 and out["auc"]["within"]["within"][0] == 0.0
    assert all(v["beats"] and v["p_holm"] >= v["p"] for v in out["vs"].values())
    # deterministic given the seed
    assert check.ordering({"real": real, "energy": noise}, labels, groups, seed=1)["auc"] == \
        {k: out["auc"][k] for k in ("real", "energy")}


def test_ordering_needs_both_labels_in_every_prompt():
    with pytest.raises(ValueError, match="every prompt needs a hack and a clean"):
        check.ordering({"real": torch.zeros(3)}, torch.tensor([True, False, True]), [0, 0, 1])
