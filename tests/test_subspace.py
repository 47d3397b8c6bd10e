"""subspace.py: V from planted pair differences (recovery, orientation, rank cut), energy and capture by hand.

Run: pytest tests/test_subspace.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.hack.pairs import Pair, shuffle_labels, within_pairs
from projected_grpo.hack.subspace import (
    along,
    capture,
    centred,
    directions_from_grads,
    energy,
    orient,
    shared_span,
    top_directions,
)


def planted_grads(seed: int, P: int = 40, R: int = 32, noise: float = 0.2):
    """g_hack = base + noise + a * v_true, g_clean = base + noise: D = a * v_true + noise (a in [1, 2])."""
    gen = torch.Generator().manual_seed(seed)
    v_true = torch.randn(R, generator=gen)
    v_true /= v_true.norm()
    base = 5 * torch.randn(P, R, generator=gen)  # prompt-specific part, shared by both labels: cancels
    a = 1 + torch.rand(P, 1, generator=gen)
    g_hack = base + noise * torch.randn(P, R, generator=gen) + a * v_true
    g_clean = base + noise * torch.randn(P, R, generator=gen)
    return {"m": g_hack}, {"m": g_clean}, v_true



@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_planted_direction_recovered_with_hackward_sign(seed):
    g_hack, g_clean, v_true = planted_grads(seed)
    V, S, stats = directions_from_grads(g_hack, g_clean, k=3)
    assert torch.dot(V["m"][0], v_true) > 0.9  # |cos| > 0.9 AND positive: +v points hack-ward
    assert stats["k_kept"] == {"m": 3} and stats["n_train"] == 40
    # swapping the labels flips the sign of every kept axis
    V_sw, S_sw, _ = directions_from_grads(g_clean, g_hack, k=3)
    assert torch.dot(V_sw["m"][0], v_true) < -0.9
    torch.testing.assert_close(S_sw["m"], S["m"])


def test_shuffled_labels_keep_the_subspace_and_randomise_only_orientation():
    # DᵀD = Σ d_i d_iᵀ does not see a row's sign, so the `shuffled` control (labels swapped per pair)
    # has exactly the real S and span(V); only the vote-chosen orientations change. Under the one-sided
    # gate it is therefore a control for orientation, not for the subspace.
    g_hack, g_clean, _ = planted_grads(0)
    flip = torch.rand(40, generator=torch.Generator().manual_seed(1)) < 0.5
    sh = {"m": torch.where(flip[:, None], g_clean["m"], g_hack["m"])}
    sc = {"m": torch.where(flip[:, None], g_hack["m"], g_clean["m"])}
    V, S, _ = directions_from_grads(g_hack, g_clean, k=3)
    V_sh, S_sh, _ = directions_from_grads(sh, sc, k=3)
    torch.testing.assert_close(S_sh["m"], S["m"])
    torch.testing.assert_close((V_sh["m"] @ V["m"].T).abs(), torch.eye(3), atol=1e-4, rtol=0)


def test_orientation_is_majority_vote_not_mean():
    # D rows project on e1 as 1, 1, -3: two of three pairs vote +, the mean (-1/3) would say -.
    D = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-3.0, 0.0]])
    V, S, stats = top_directions(D, k=1)
    torch.testing.assert_close(V, torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(S, torch.tensor([11.0]).sqrt())  # sqrt(1 + 1 + 9)
    assert stats["votes_pos"] == [2]


def test_orientation_tie_keeps_plus_one():
    # projections 2 and -2: a 1-1 tie, so the axis keeps the sign the SVD returned (vote +1)
    D = torch.tensor([[2.0, 0.0], [-2.0, 0.0]])
    _, _, Vh = torch.linalg.svd(D, full_matrices=False)
    V, _, _ = top_directions(D, k=1)
    torch.testing.assert_close(V, Vh[:1])


def test_rank_deficient_D_keeps_only_real_axes_and_zero_D_keeps_none():
    D = torch.tensor([[1.0, 2.0, 0.0]] * 3)  # rank 1: axes 2, 3 would be arbitrary null-space directions
    V, S, _ = top_directions(D, k=3)
    assert V.shape == (1, 3)
    V0, S0, st0 = top_directions(torch.zeros(4, 3), k=2)
    assert V0.shape == (0, 3) and S0.shape == (0,) and st0["k_kept"] == 0


def test_nonfinite_D_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        top_directions(torch.tensor([[float("nan"), 0.0]]), k=1)


def test_k_must_be_positive():
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_directions(torch.eye(2), k=0)


def test_orient_flips_to_the_majority_and_counts_votes():
    V = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    D = torch.tensor([[-1.0, 1.0], [-2.0, 0.0], [3.0, 0.0]])  # e1: 1 +, 2 -; e2: 1 +, 2 zero (abstain)
    Vo, votes = orient(V, D)
    torch.testing.assert_close(Vo, torch.tensor([[-1.0, 0.0], [0.0, 1.0]]))
    assert votes.tolist() == [2, 1]


def test_energy_hand_computed():
    # X rows (3, 4), (0, 5): ||X||^2 = 9 + 16 + 25 = 50; V = e1: ||X V^T||^2 = 9 -> 0.18; V = e2: 41 / 50
    X = torch.tensor([[3.0, 4.0], [0.0, 5.0]])
    assert energy(X, torch.tensor([[1.0, 0.0]])) == pytest.approx(0.18)
    assert energy(X, torch.tensor([[0.0, 1.0]])) == pytest.approx(0.82)
    assert energy(X, torch.eye(2)) == pytest.approx(1.0) and energy(torch.zeros(2, 2), torch.eye(2)) == 0.0


def test_capture_pools_modules_one_sided_hand_computed():
    # row 0: module a x = (3, 4), V_a = e1 -> relu(3)^2 = 9; module b x = (0, 12), V_b = -e2 -> relu(-12) = 0
    #   -> sqrt(9) / sqrt(25 + 144) = 3 / 13
    # row 1: a x = (-3, 0) -> relu(-3) = 0; b x = (0, -4) -> relu(4)^2 = 16 -> sqrt(16) / sqrt(9 + 16) = 0.8
    X = {"a": torch.tensor([[3.0, 4.0], [-3.0, 0.0]]), "b": torch.tensor([[0.0, 12.0], [0.0, -4.0]])}
    V = {"a": torch.tensor([[1.0, 0.0]]), "b": torch.tensor([[0.0, -1.0]])}
    torch.testing.assert_close(capture(X, V), torch.tensor([3 / 13, 0.8]))
    # a module without V counts in the denominator only: row 0 -> 3 / 13 still without b's V, row 1 -> 0
    torch.testing.assert_close(capture(X, {"a": V["a"]}), torch.tensor([3 / 13, 0.0]))
    torch.testing.assert_close(capture({"a": torch.zeros(1, 2)}, {"a": V["a"]}), torch.tensor([0.0]))


def test_along_sums_every_row_of_every_module_hand_computed():
    # row 0: a x = (3, 4), V_a rows e1, e2 -> 3 + 4 = 7; b x = (0, 12), V_b = -e2 -> -12; total -5
    # row 1: a x = (-3, 0) -> -3 + 0; b x = (0, -4) -> +4; total 1. A module without V adds 0.
    X = {"a": torch.tensor([[3.0, 4.0], [-3.0, 0.0]]), "b": torch.tensor([[0.0, 12.0], [0.0, -4.0]])}
    V = {"a": torch.eye(2), "b": torch.tensor([[0.0, -1.0]])}
    out = along(X, V)
    assert out.dtype == torch.float64 and out.tolist() == [-5.0, 1.0]
    assert along(X, {"a": V["a"]}).tolist() == [7.0, -3.0]
    with pytest.raises(ValueError, match="no modules"):
        along({}, V)


def test_shared_span_hand_computed():
    # module a: A rows e1, (e2 + e3)/sqrt 2 against B = span(e1, e2): 1 + 1/2; module b: A row e1, B row -e1:
    # 1 (signs do not count) -> (1.5 + 1) / 3 rows
    r = 2 ** -0.5
    A = {"a": torch.tensor([[1.0, 0, 0], [0, r, r]]), "b": torch.tensor([[1.0, 0]])}
    B = {"a": torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]), "b": torch.tensor([[-1.0, 0]])}
    assert shared_span(A, B) == pytest.approx(2.5 / 3)
    assert shared_span(A, A) == pytest.approx(1.0) and shared_span({"a": torch.zeros(0, 3)}, B) == 0.0


def _completion_grads(R: int = 6, seed: int = 0):
    """A hand-made gradient per completion text: hacks = base + e0 + within-class noise on e1 / e2; cleans =
    base + noise on e3 / e4. The hack-vs-clean contrast lies along e0; within-class variation along e1..e4."""
    gen = torch.Generator().manual_seed(seed)
    base = 3 * torch.randn(R, generator=gen)
    e = torch.eye(R)
    g = {}
    for j in range(3):
        g[f"h{j}"] = base + e[0] + (torch.randn(2, generator=gen) * 0.2) @ e[1:3]
        g[f"c{j}"] = base + (torch.randn(2, generator=gen) * 0.2) @ e[3:5]
    return g, e


def _V_of(pairs, g, k):
    gh = {"m": torch.stack([g[p.hack] for p in pairs])}
    gc = {"m": torch.stack([g[p.clean] for p in pairs])}
    return directions_from_grads(gh, gc, k)[0]["m"]


def test_label_control_changes_the_span_the_orientation_control_does_not():
    # a prompt with 3 hacks and 3 cleans, the built-in pairs' rotation: (h_i, c_{i+1})
    g, e = _completion_grads()
    pairs = [Pair("q", f"h{i}", f"c{(i + 1) % 3}") for i in range(3)]
    V = _V_of(pairs, g, k=1)
    assert abs(float(V[0] @ e[0])) > 0.95  # the real V finds the hack-vs-clean axis e0
    shuffled = _V_of(shuffle_labels(pairs * 4, seed=1), g, k=1)
    assert abs(float(shuffled[0] @ V[0])) > 0.999  # same span: orientation only
    within = _V_of(within_pairs(pairs), g, k=2)
    # within-class rows (h_i - h_j, c_i - c_j) have no e0 component, so neither has span(V_within): it is
    # another subspace, nearly orthogonal to V (cosine of the smallest principal angle < 0.3)
    assert float((within @ e[0]).norm()) < 1e-5
    assert float(torch.linalg.matrix_norm(within @ V.T, ord=2)) < 0.3


def test_centred_subtracts_each_prompts_mean_hand_computed():
    # prompt 0: completions hack 0 (1, 0), clean 0 (3, 0), hack 1 (2, 3) -> mean (2, 1): rows (-1, -1),
    # (1, -1), (0, 2); prompt 1: hack 2 (5, 5), clean 2 (1, 1) -> mean (3, 3): rows (2, 2), (-2, -2)
    g_hack = {"m": torch.tensor([[1.0, 0.0], [2.0, 3.0], [5.0, 5.0]])}
    g_clean = {"m": torch.tensor([[3.0, 0.0], [3.0, 0.0], [1.0, 1.0]])}
    groups = [[(0, "hack"), (0, "clean"), (1, "hack")], [(2, "hack"), (2, "clean")]]
    torch.testing.assert_close(centred(g_hack, g_clean, groups)["m"], torch.tensor(
        [[-1.0, -1.0], [1.0, -1.0], [0.0, 2.0], [2.0, 2.0], [-2.0, -2.0]]))
