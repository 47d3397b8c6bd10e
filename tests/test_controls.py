"""controls.py: the random V and the energy-matched V on hand-made gradient sets.

Run: pytest tests/test_controls.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from projected_grpo.hack.controls import energy_matched, energy_matched_module, random_like
from projected_grpo.hack.subspace import directions_from_grads, energy

# the stated tolerance of the energy match: the construction is exact up to float rounding
ENERGY_TOL = 1e-5


def _orthonormal(K: int, R: int, seed: int) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(R, K, generator=torch.Generator().manual_seed(seed)))
    return Q.T.contiguous()


def test_random_control_same_shapes_orthonormal_seeded():
    V = {"a": _orthonormal(3, 8, 0), "b": _orthonormal(1, 4, 1), "c": torch.zeros(0, 6)}
    R1, R2, R3 = random_like(V, 0), random_like(V, 0), random_like(V, 1)
    for n in V:
        assert R1[n].shape == V[n].shape
        torch.testing.assert_close(R1[n] @ R1[n].T, torch.eye(V[n].shape[0]))
        assert torch.equal(R1[n], R2[n])
    assert not torch.equal(R1["a"], R3["a"])


def test_energy_matched_hand_computed():
    # A = diag(4, 3, 2, 1) rows: M = diag(16, 9, 4, 1), trace 30; K = 1, U = e1 (energy 16/30).
    # Real V = e2 (9/30). Any random W orthogonal to e1 captures (9 w2² + 4 w3² + w4²) / 30 <= 9/30, so W is
    # random and V_e = cos t e1 + sin t w with cos²t = (9/30 - e_W) / (16/30 - e_W): energy(V_e) = 9/30.
    A = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    gen = lambda: torch.Generator().manual_seed(0)
    Ve, st_ = energy_matched_module(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), A, A, gen())
    assert st_["w"] == "random" and st_["real"] == pytest.approx(9 / 30)
    assert st_["top"] == pytest.approx(16 / 30)
    assert energy(A, Ve) == pytest.approx(9 / 30, abs=ENERGY_TOL)
    e_w = st_["complement"]
    assert float(Ve[0, 0]) ** 2 == pytest.approx((9 / 30 - e_w) / (16 / 30 - e_w), abs=ENERGY_TOL)
    assert float(Ve[0, 0]) > 0  # oriented by D = A's vote: every row projects >= 0 on e1
    # Real V = e4 (1/30, the least any direction captures): a random W captures more, so W = the bottom
    # eigenvector e4 and cos²t = (1/30 - 1/30) / (16/30 - 1/30) = 0: V_e = e4 itself
    Ve, st_ = energy_matched_module(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), A, A, gen())
    assert st_["w"] == "bottom" and energy(A, Ve) == pytest.approx(1 / 30, abs=ENERGY_TOL)
    torch.testing.assert_close(Ve, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def _grads(seed: int, P: int = 30, R: int = 24):
    """Hand-made pair gradients: a shared part concentrated on 3 heavy axes (what every completion's gradient
    looks like) and a hack-vs-clean contrast along a light axis."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(R)
    scale[:3] = torch.tensor([10.0, 6.0, 4.0])
    base = torch.randn(P, R, generator=gen) * scale
    v_hack = torch.zeros(R)
    v_hack[5] = 1.0
    g_hack = base + 0.3 * torch.randn(P, R, generator=gen) + (1 + torch.rand(P, 1, generator=gen)) * v_hack
    g_clean = base + 0.3 * torch.randn(P, R, generator=gen)
    return {"m": g_hack, "n": g_hack[:, :10]}, {"m": g_clean, "n": g_clean[:, :10]}


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_energy_control_matches_the_real_v_and_is_another_subspace(seed, k):
    g_hack, g_clean = _grads(seed)
    V, S, _ = directions_from_grads(g_hack, g_clean, k)
    A = {m: g_hack[m] + g_clean[m] for m in g_hack}
    D = {m: g_hack[m] - g_clean[m] for m in g_hack}
    Ve, stats = energy_matched(V, A, D, seed)
    for m in V:
        assert Ve[m].shape == V[m].shape
        torch.testing.assert_close(Ve[m] @ Ve[m].T, torch.eye(V[m].shape[0]), atol=1e-5, rtol=0)
        # matched: the share of the summed gradients' energy inside span(V_e) equals the real V's
        assert abs(energy(A[m], Ve[m]) - energy(A[m], V[m])) <= ENERGY_TOL
        assert stats[m]["control"] == pytest.approx(stats[m]["real"], abs=ENERGY_TOL)
        assert stats[m]["complement"] <= stats[m]["real"] + ENERGY_TOL <= stats[m]["top"] + 2 * ENERGY_TOL
    # the real V's first axis is the light hack axis e5; the energy control is built from A's heavy axes and a
    # complement, not from D: it is not V (its first row is far from e5)
    assert abs(float(V["m"][0, 5])) > 0.9
    assert abs(float(Ve["m"][0, 5])) < 0.9


def test_wide_modules_take_the_thin_svd_and_give_the_eigh_subspaces():
    """N < R (fewer completions than knob dimensions): U from the Gram matrix A Aᵀ spans what eigh(AᵀA) gives
    (the projectors agree); the matched energy is exact; a real V outside A's row space (energy 0, the least
    of any K) is matched by a W drawn outside it too; below rank K the SVD's rows stand in."""
    from projected_grpo.hack.controls import _top_and_bottom

    gen = torch.Generator().manual_seed(3)
    N, R, K = 12, 40, 3
    A = torch.randn(N, R, generator=gen, dtype=torch.float64) * torch.linspace(5, 0.5, R, dtype=torch.float64)
    U, bottom = _top_and_bottom(A, K, torch.Generator().manual_seed(0))
    evecs = torch.linalg.eigh(A.T @ A)[1][:, -K:].T  # the O(R³) way
    torch.testing.assert_close(U.T @ U, evecs.T @ evecs, atol=1e-9, rtol=0)
    torch.testing.assert_close(U @ U.T, torch.eye(K, dtype=torch.float64), atol=1e-12, rtol=0)
    W = bottom()
    assert energy(A, W) < 1e-12 and float((W @ U.T).abs().max()) < 1e-12  # outside the row space
    V = _orthonormal(K, R, 1)
    Ve, st_ = energy_matched_module(V, A.float(), A.float(), torch.Generator().manual_seed(0))
    assert st_["w"] == "random"
    assert energy(A.float(), Ve) == pytest.approx(energy(A.float(), V), abs=ENERGY_TOL)
    null = torch.linalg.svd(A, full_matrices=True)[2][N:N + K].float()  # a real V A cannot see: energy 0
    Ve, st_ = energy_matched_module(null, A.float(), A.float(), torch.Generator().manual_seed(0))
    assert st_["w"] == "bottom" and energy(A.float(), Ve) == pytest.approx(0.0, abs=ENERGY_TOL)
    torch.testing.assert_close(Ve @ Ve.T, torch.eye(K), atol=1e-5, rtol=0)
    # rank below K (2 independent rows): the SVD's rows instead, orthonormal, spanning A's whole row space
    low = torch.randn(N, 2, generator=gen, dtype=torch.float64) @ A[:2]
    U, _ = _top_and_bottom(low, K, torch.Generator().manual_seed(0))
    torch.testing.assert_close(U @ U.T, torch.eye(K, dtype=torch.float64), atol=1e-12, rtol=0)
    assert energy(low, U) == pytest.approx(1.0, abs=1e-6)  # energy() sums in float32


def test_energy_control_is_seeded_and_refuses_2k_over_r():
    g_hack, g_clean = _grads(0)
    V, _, _ = directions_from_grads(g_hack, g_clean, 3)
    A = {m: g_hack[m] + g_clean[m] for m in g_hack}
    D = {m: g_hack[m] - g_clean[m] for m in g_hack}
    a, _ = energy_matched(V, A, D, 0)
    b, _ = energy_matched(V, A, D, 0)
    assert all(torch.equal(a[m], b[m]) for m in a)
    with pytest.raises(ValueError, match="2K <= R"):
        energy_matched_module(torch.eye(3), torch.randn(4, 5), torch.randn(4, 5), torch.Generator())
    empty, st_ = energy_matched_module(torch.zeros(0, 5), torch.randn(4, 5), torch.randn(4, 5),
                                       torch.Generator())
    assert empty.shape == (0, 5) and st_["w"] == "none"
