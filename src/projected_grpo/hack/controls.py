"""The V-level negative controls of V_hack: a random V, and a V matched to the real one's gradient energy.

The pair-level controls (shuffled: orientation; nonhack and within: the label) are in pairs.py; these two
replace V itself after the real extraction, keeping its shape (K rows per module):
  random_like     a random orthonormal V: chance level, ‖relu(V·g)‖/‖g‖ ≈ sqrt(K / 2R) for any g. It does not
                  capture as much of the policy gradient as the real V (on the demo organism at k = 8,
                  proj/cin_student 0.46 real against 0.20 random), so beating it may only mean the real V
                  lies along the directions training uses most (docs/preregistration.md, "Controls").
  energy_matched  a V as energetic as the real one without its label: per module, the top-K principal
                  directions of the fit pairs' completion gradients CENTRED PER PROMPT (C: each distinct
                  completion's gradient minus its prompt's mean, hack and clean alike), rotated toward a
                  random subspace orthogonal to them until it captures exactly the real V's share of C's
                  energy (`subspace.energy`). Oriented by the same majority vote of D as the real V, so
                  only the subspace differs.
Why C: GRPO's advantages sum to zero within a group, so its gradient Σ adv_i ∇logp(o_i) lies in the span of
the completions' gradients centred per prompt; C's principal directions are "the directions the policy
gradient uses most", with no label in them. (The pairs' summed gradients g_hack + g_clean also carry the
prompt's own gradient, which those advantages cancel: a V matched on them was measured on the demo organism
to capture 0.21 of held-out pairs' sums against the real V's 0.31, while one matched on C captured 0.318
against 0.312 of held-out C.) With one hack and one clean per prompt, C's rows are ±D/2: the only
within-prompt variation is the labelled contrast, the control would be V itself, and it cannot be built.
How energy_matched matches, exactly: with M = CᵀC, U its top-K eigenvectors (rows) and W K orthonormal rows
orthogonal to U, the rows v_i = cos t·u_i + sin t·w_i are orthonormal and, since M u_i = λ_i u_i ⟂ w_i,
energy(V) = cos²t·energy(U) + sin²t·energy(W): linear in cos²t, solved in closed form. W is a seeded random
draw; when even that captures more than the real V, W is M's bottom-K eigenvectors, which capture the least
of any K directions (Ky Fan), so a solution always exists. Needs 2K <= R (U and W disjoint). With fewer
completions than a module's knob dimensions, U comes from the completions' Gram matrix C Cᵀ and the bottom K
are drawn outside C's row space (energy 0): the same subspaces, without the O(R³) eigendecomposition
(_top_and_bottom).
Deliberately not here: applying any V (knobs/projection.py), the held-out comparison (check.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from projected_grpo.hack.subspace import energy, orient


def random_like(V: Mapping[str, Tensor], seed: int) -> dict[str, Tensor]:
    """Control `random`: per module a random orthonormal (K, R) of the same shape as V[name] (seeded,
    modules in sorted order). Rows are unit-norm like real V rows; S is kept by the caller."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(V):
        K, R = V[name].shape
        Q, _ = torch.linalg.qr(torch.randn(R, K, generator=gen))  # (R, K) orthonormal columns
        out[name] = Q.T.contiguous()
    return {name: out[name] for name in V}


def _complement(U: Tensor, K: int, gen: torch.Generator) -> Tensor:
    """K random orthonormal rows (K, R) orthogonal to the orthonormal rows of U (K, R), float64."""
    G = torch.randn(U.shape[1], K, generator=gen, dtype=torch.float64)  # (R, K)
    G = G - U.T @ (U @ G)  # out of span(U)
    Q, _ = torch.linalg.qr(G)
    Q = Q - U.T @ (U @ Q)  # once more: QR's rounding may bring back a trace of span(U)
    Q, _ = torch.linalg.qr(Q)
    return Q.T


def _top_and_bottom(A64: Tensor, K: int, gen: torch.Generator) -> tuple[Tensor, Callable[[], Tensor]]:
    """For A (N, R) float64: (U (K, R), M = AᵀA's top-K eigenvectors as rows; a function giving K orthonormal
    rows that capture the least energy of any K). With K <= N < R (a LoRA knob's wide modules: R 8192 against
    a few thousand completions) from the N x N Gram A Aᵀ = Q Λ Qᵀ, O(N²R + N³) where eigh(M) is O(R³)
    (minutes per module): u_i = Aᵀq_i / sqrt(λ_i) is M's eigenvector of the same eigenvalue. M's least
    eigenvalue is then 0, taken by any rows outside A's row space (a seeded draw, _complement; the row space
    from A's thin SVD, computed only if asked). Otherwise from eigh(M)."""
    N, R = A64.shape
    if K <= N < R:
        lam, Q = torch.linalg.eigh(A64 @ A64.T)  # (N,), (N, N) ascending: O(N²R + N³)
        row_space = lambda: torch.linalg.svd(A64, full_matrices=False)[2]  # (N, R): only for the rare bottom
        bottom = lambda: _complement(row_space(), K, gen)
        if lam[-K] > 1e-10 * lam[-1]:  # the top K well above 0: u = Aᵀq / sqrt(λ) is exact to rounding
            U = A64.T @ Q[:, -K:] / lam[-K:].sqrt()  # (R, K): M's top-K eigenvectors, ascending as eigh's
            Qr, Rr = torch.linalg.qr(U)  # orthonormal to the last bit, each column's sign kept
            return (Qr * torch.sign(Rr.diagonal())).T.contiguous(), bottom
        Vh = row_space()  # rank below K: the SVD's rows are eigenvectors however small their eigenvalues
        return Vh[:K].flip(0).contiguous(), bottom
    evals, evecs = torch.linalg.eigh(A64.T @ A64)  # ascending
    return evecs[:, -K:].T.contiguous(), lambda: evecs[:, :K].T.contiguous()


def energy_matched_module(V: Tensor, A: Tensor, D: Tensor, gen: torch.Generator) -> tuple[Tensor, dict]:
    """One module: V (K, R) the real rows, A (N, R) the reference gradients (C of the module docstring), D
    (P, R) pair differences -> (V_e (K, R) orthonormal, oriented by D's vote, with energy(A, V_e) =
    energy(A, V); stats: the energies of the real V, the control, U (top-K) and W, and which W was used)."""
    K, R = V.shape
    if K == 0:
        return V.clone(), {"real": 0.0, "control": 0.0, "top": 0.0, "complement": 0.0, "w": "none"}
    if 2 * K > R:
        raise ValueError(f"energy control: K={K} rows need 2K <= R={R} (top-K and a disjoint K)")
    A64 = A.double()
    U, bottom = _top_and_bottom(A64, K, gen)
    W, which = _complement(U, K, gen), "random"
    e_real, e_top, e_w = energy(A64, V.double()), energy(A64, U), energy(A64, W)
    if e_w > e_real:  # the real V captures less than a random K: mix with the least energetic K instead
        W, which = bottom(), "bottom"
        e_w = energy(A64, W)
    cos2 = 1.0 if e_top <= e_w else min(1.0, max(0.0, (e_real - e_w) / (e_top - e_w)))
    Ve = math.sqrt(cos2) * U + math.sqrt(1.0 - cos2) * W  # (K, R) orthonormal: U ⟂ W
    Ve, _ = orient(Ve.float(), D)
    return Ve.contiguous(), {"real": e_real, "control": energy(A64, Ve.double()), "top": e_top,
                             "complement": e_w, "w": which}


def energy_matched(V: Mapping[str, Tensor], A: Mapping[str, Tensor], D: Mapping[str, Tensor], seed: int
                   ) -> tuple[dict[str, Tensor], dict[str, dict]]:
    """Control `energy`: per module energy_matched_module (see the module docstring), modules in sorted order
    for the seeded draws. V[name] (K, R), A[name] (N, R) the reference gradients, D[name] (P, R) ->
    (V_e, per-module energy stats)."""
    gen = torch.Generator().manual_seed(seed)
    out, stats = {}, {}
    for name in sorted(V):
        out[name], stats[name] = energy_matched_module(V[name], A[name], D[name], gen)
    return {n: out[n] for n in V}, {n: stats[n] for n in V}
