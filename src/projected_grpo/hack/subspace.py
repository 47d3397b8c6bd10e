"""V from per-pair gradient differences, and how much of a set of gradients a V captures: pure tensor math.

The GRPO step on one perfectly labelled pair (adv_hack = +1, adv_clean = -1, no clip) is
∇NLL(hack) − ∇NLL(clean), so per module the rows of D = g_hack − g_clean (P × R) are the gradients of
perfectly labelled pairs, and V_hack is D's top-k right singular vectors (top-k, not the mean difference:
hacks are multi-modal, CHaRS, Abdullaev 2025), each oriented hack-ward by per-pair majority vote, because the
projection's one-sided gate removes relu(V·g) and so needs +v to point hack-ward.
  top_directions   D (P, R) -> V (K, R), S (K,): SVD, rank cut, orientation
  orient           flip V's rows to the majority vote of D's rows (also used by the controls)
  energy           ‖X Vᵀ‖²_F / ‖X‖²_F: the share of a gradient set's energy inside span(V), both signs
  centred          each prompt's completion gradients minus the prompt's mean (the span GRPO's gradient is in)
  capture          per row ‖relu(V x)‖² and ‖x‖², pooled over modules: the one-sided gate's own measure
  along            per row Σ_m Σ_k v_mk · x_m: the direction monitor's raw score of a gradient
  shared_span      Σ_m ‖A_m B_mᵀ‖² / Σ_m K_m: how much of B's span A's rows lie in, pooled over modules
Deliberately not here: the gradients (knob_grads.py), the controls (controls.py), storage (direction.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

# Axes whose singular value is below this fraction of S_0 span D's numerical null space: their
# direction is arbitrary (P < K pairs, duplicated pairs), so they are never kept.
RANK_RTOL = 1e-6


def orient(V: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """V (K, R) with each row's sign set by majority vote of D's rows (P, R): +v when at least as many rows
    have a positive as a negative projection (ties -> +1; zero projections abstain). Majority vote rather
    than the sign of the mean is robust to a few outlier pairs (the repeng convention).
    Returns (oriented V (K, R), votes (K,): the rows of D agreeing with each oriented axis)."""
    c = D.float() @ V.T  # (P, K)
    n_pos, n_neg = (c > 0).sum(0), (c < 0).sum(0)
    sign = torch.where(n_pos >= n_neg, 1.0, -1.0)  # (K,)
    return V * sign[:, None], torch.where(sign > 0, n_pos, n_neg)


def top_directions(D: Tensor, k: int) -> tuple[Tensor, Tensor, dict]:
    """D (P, R) pair differences -> V (K, R), S (K,), stats; K <= min(k, P, R).

    SVD in fp32; each axis oriented by `orient`. Axes with S_i <= RANK_RTOL * S_0 (D's null space) are
    dropped: S is descending, so they are a suffix and V keeps orthonormal rows. All-zero D gives K = 0.
    stats: k_kept, votes_pos (per kept axis, the pairs agreeing with its orientation).
    """
    if not torch.isfinite(D).all():
        raise ValueError("top_directions: D has non-finite entries")
    if k < 1:
        raise ValueError(f"top_directions: k must be >= 1, got {k}")
    D = D.float()
    _, S, Vh = torch.linalg.svd(D, full_matrices=False)  # S (min(P,R),), Vh (min(P,R), R)
    K = min(k, S.numel())
    if K == 0 or S[0] <= 0:
        return D.new_zeros((0, D.shape[1])), D.new_zeros((0,)), {"k_kept": 0, "votes_pos": []}
    keep = S[:K] > RANK_RTOL * S[0]  # (K,) a prefix, S being descending
    V, votes = orient(Vh[:K][keep], D)
    return V, S[:K][keep], {"k_kept": int(keep.sum()), "votes_pos": [int(v) for v in votes]}


def directions_from_grads(g_hack: Mapping[str, Tensor], g_clean: Mapping[str, Tensor], k: int
                          ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict]:
    """Per module g_hack[name], g_clean[name] (P, R) -> V[name] (K, R), S[name] (K,), stats with per module
    k_kept and votes_pos, and n_train = P."""
    if g_hack.keys() != g_clean.keys():
        raise ValueError(f"directions_from_grads: modules differ: {sorted(g_hack.keys() ^ g_clean.keys())}")
    if not g_hack:
        raise ValueError("directions_from_grads: no modules")
    P = {g.shape[0] for g in [*g_hack.values(), *g_clean.values()]}
    if len(P) != 1 or 0 in P:
        raise ValueError(f"directions_from_grads: need one non-zero number of pairs, got {sorted(P)}")
    V, S, stats = {}, {}, {"k_kept": {}, "votes_pos": {}, "n_train": P.pop()}
    for name in g_hack:
        D = g_hack[name].float() - g_clean[name].float()  # (P, R): pairing cancels prompt-specific gradient
        V[name], S[name], st = top_directions(D, k)
        stats["k_kept"][name], stats["votes_pos"][name] = st["k_kept"], st["votes_pos"]
    return V, S, stats


def energy(X: Tensor, V: Tensor) -> float:
    """‖X Vᵀ‖²_F / ‖X‖²_F for rows X (N, R) and orthonormal V (K, R): the share of X's energy inside
    span(V), both signs (0 for X = 0)."""
    total = float(X.float().square().sum())
    return float((X.float() @ V.float().T).square().sum()) / total if total > 0 else 0.0


def centred(g_hack: Mapping[str, Tensor], g_clean: Mapping[str, Tensor],
            groups: Sequence[Sequence[tuple[int, str]]]) -> dict[str, Tensor]:
    """Per module the completions' gradients centred per prompt: for each group (one prompt's distinct
    completions as (pair index, "hack" / "clean"), pairs.completions_by_prompt) the rows of g_hack[m] (P, R)
    or g_clean[m] they name, minus their mean. GRPO's advantages sum to zero within a group, so its gradient
    lies in the span of these rows. Returns module -> (N, R), N = the number of completions."""
    out = {}
    for m in g_hack:
        rows = []
        for group in groups:
            X = torch.stack([(g_hack if side == "hack" else g_clean)[m][i].float() for i, side in group])
            rows.append(X - X.mean(0))
        out[m] = torch.cat(rows) if rows else g_hack[m].new_zeros((0, g_hack[m].shape[1]))
    return out


def capture(X: Mapping[str, Tensor], V: Mapping[str, Tensor]) -> Tensor:
    """Per row n the one-sided gate's captured share of x_n pooled over modules (as proj/cin pools them):
    sqrt(Σ_m ‖relu(V_m x_nm)‖²) / sqrt(Σ_m ‖x_nm‖²) for X[m] (N, R_m), V[m] (K_m, R_m). Every module of X
    counts in the denominator; a module without V (or with K_m = 0) captures nothing. Rows with x = 0: 0.
    Returns (N,)."""
    num = den = None
    for m, x in X.items():
        x = x.float()
        d = x.square().sum(1)  # (N,)
        v = V.get(m)
        has = v is not None and v.shape[0] > 0
        c = torch.relu(x @ v.float().T).square().sum(1) if has else torch.zeros_like(d)
        num, den = (c, d) if num is None else (num + c, den + d)
    if num is None:
        raise ValueError("capture: no modules")
    return torch.where(den > 0, num.sqrt() / den.clamp_min(1e-38).sqrt(), torch.zeros_like(den))


def along(X: Mapping[str, Tensor], V: Mapping[str, Tensor]) -> Tensor:
    """Per row n the sum over modules and V's rows of v_mk · x_nm, in float64: the direction monitor's raw
    score (hack/monitors.py), high for a hack-like completion's NLL gradient since V's rows point hack-ward.
    X[m] (N, R_m) in X's module order, V[m] (K_m, R_m); a module without V adds 0. Returns (N,)."""
    if not X:
        raise ValueError("along: no modules")
    total = torch.zeros(len(next(iter(X.values()))), dtype=torch.float64)
    for m, x in X.items():
        if m in V:
            total += (x.double() @ V[m].double().T).sum(1)
    return total


def shared_span(A: Mapping[str, Tensor], B: Mapping[str, Tensor]) -> float:
    """Σ_m ‖A_m B_mᵀ‖²_F / Σ_m K_m for orthonormal rows A[m] (K_m, R_m) and B[m] (J_m, R_m) over A's modules:
    the mean over A's rows of the share of each row inside span(B) (1: A's span within B's; about J/R for a
    random A). Signs do not count. 0 when A has no rows."""
    rows = sum(a.shape[0] for a in A.values())
    if rows == 0:
        return 0.0
    return sum(float((a.double() @ B[m].double().T).square().sum()) for m, a in A.items() if m in B) / rows
