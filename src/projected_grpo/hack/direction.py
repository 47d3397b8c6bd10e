"""Hack-direction extraction (V_hack): per-module SVD of paired knob-gradient differences.

The GRPO step on one perfectly labelled pair (adv_hack = +1, adv_clean = -1, no clip) is
∇NLL(hack) − ∇NLL(clean), so per pair and label we take the gradient of that completion's
NLL alone on the knobs (batched, knob_grads.py), stack D = g_hack − g_clean (P × R) per module, and
keep the top-k right singular vectors (top-k, not the mean difference: hacks are multi-modal, CHaRS,
Abdullaev 2025), each oriented hack-ward by per-pair majority vote, because the projection's one-sided
gate removes relu(V·g) and so needs +v to point hack-ward. Also: load-time post-processing (k_use,
global noise floor), the `random` control (the pair-level controls are in pairs.py), safetensors
storage with a checksum, and `resolve` (a cache keyed by model fingerprint, pairs hash and settings).
Deliberately not here: applying V to training gradients (projection.py), the gradients themselves
(knob_grads.py), the `extract-direction` CLI (direction_cli.py).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import Tensor

from projected_grpo.errors import UserError
from projected_grpo.hack.knob_grads import NLL_NORMS, pair_grads
from projected_grpo.hack.pairs import PAIR_CONTROLS, Pair, heldout_shared_prompts, pairs_hash
from projected_grpo.store import load_tensors, save_tensors, tokenizer_fingerprint

FORMAT = "projected-grpo/v_hack/1"
# Axes whose singular value is below this fraction of S_0 span D's numerical null space: their
# direction is arbitrary (P < K pairs, duplicated pairs), so they are never kept.
RANK_RTOL = 1e-6


@dataclass(frozen=True)
class ExtractSettings:
    """What an extraction depends on besides the model and the pairs: the cache key. Built from the run's
    config by run/setup.extract_settings; the fields are `proj.<name>` (docs and defaults live there), plus
    nll_const (the Dr.GRPO constant, used when nll_norm == "constant") and seed (draws the controls)."""

    k: int
    tau_axis: float
    n_heldout: int
    nll_norm: Literal["mean", "constant"]
    nll_const: float
    control: Literal["none", "random", "shuffled", "nonhack"]
    seed: int

    def __post_init__(self):
        checks = [(self.k >= 1, "k must be >= 1"), (0 <= self.tau_axis <= 1, "tau_axis must be in [0, 1]"),
                  (self.n_heldout >= 0, "n_heldout must be >= 0"),
                  (self.nll_const > 0, "nll_const must be > 0"),
                  (self.nll_norm in NLL_NORMS, f"nll_norm must be one of {sorted(NLL_NORMS)}"),
                  (self.control in CONTROLS, f"control must be one of {sorted(CONTROLS)}")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ExtractSettings.{msg}; got {self}")


@dataclass
class Direction:
    """V_hack per module: V[name] (K, R) orthonormal rows, +v hack-ward; S[name] (K,) singular values,
    descending; meta: str -> str (format, fingerprint, knob_kind, pairs_hash, settings and stats as JSON)."""

    V: dict[str, Tensor]
    S: dict[str, Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def stats(self) -> dict:
        return json.loads(self.meta.get("stats", "{}"))


# --- pure math ---------------------------------------------------------------------------------


def top_directions(D: Tensor, k: int, tau_axis: float = 0.0) -> tuple[Tensor, Tensor, dict]:
    """D (P, R) pair differences -> V (K, R), S (K,), stats; K <= min(k, P, R).

    SVD in fp32; each axis oriented by per-pair majority vote: +v when at least as many rows of D have a
    positive as a negative projection (ties -> +1; zero projections abstain). Majority vote rather than
    sign of the mean is robust to a few outlier pairs (the repeng convention). Weak axes
    (S_i / S_0 < tau_axis) are DROPPED, not zeroed: S is descending, so they are a suffix, V keeps
    orthonormal rows and K counts only real axes. All-zero D gives K = 0.
    """
    if not torch.isfinite(D).all():
        raise ValueError("top_directions: D has non-finite entries")
    D = D.float()
    _, S, Vh = torch.linalg.svd(D, full_matrices=False)  # S (min(P,R),), Vh (min(P,R), R)
    K = min(k, S.numel())
    V, S = Vh[:K], S[:K]
    if K == 0 or S[0] <= 0:
        return D.new_zeros((0, D.shape[1])), D.new_zeros((0,)), {"k_kept": 0, "votes_pos": []}
    c = D @ V.T  # (P, K)
    n_pos, n_neg = (c > 0).sum(0), (c < 0).sum(0)
    sign = torch.where(n_pos >= n_neg, 1.0, -1.0)  # (K,)
    V = V * sign[:, None]
    keep = (S / S[0] >= tau_axis) & (S > RANK_RTOL * S[0])  # (K,) a prefix, S being descending
    votes = torch.where(sign > 0, n_pos, n_neg)[keep]
    return V[keep], S[keep], {"k_kept": int(keep.sum()), "votes_pos": [int(v) for v in votes]}


def heldout_score(D_heldout: Tensor, v1: Tensor) -> float:
    """Fraction of held-out pair differences D_heldout (H, R) with a positive projection on v1 (R,)."""
    return float(((D_heldout.float() @ v1.float()) > 0).float().mean())


def heldout_scores(g_hack: dict[str, Tensor], g_clean: dict[str, Tensor], V: dict[str, Tensor],
                   n_heldout: int) -> dict[str, float | None]:
    """Per module the held-out score of V[name][0] on the last n_heldout rows of g_hack − g_clean (P, R);
    None when n_heldout = 0 or the module has no axis."""
    return {n: heldout_score(g_hack[n][-n_heldout:].float() - g_clean[n][-n_heldout:].float(), V[n][0])
            if n_heldout > 0 and V[n].shape[0] > 0 else None for n in V}


def directions_from_grads(g_hack: dict[str, Tensor], g_clean: dict[str, Tensor], k: int, tau_axis: float = 0,
                          n_heldout: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor], dict]:
    """Per module g_hack[name], g_clean[name] (P, R) -> V (K, R), S (K,), stats.

    The last n_heldout pairs are held out of the SVD; stats["heldout"][name] is their score on v1
    (None when n_heldout = 0 or the module has no axis); stats["k_kept"][name] the number of axes kept.
    """
    if g_hack.keys() != g_clean.keys():
        raise ValueError(f"directions_from_grads: modules differ: {sorted(g_hack.keys() ^ g_clean.keys())}")
    if not g_hack:
        raise ValueError("directions_from_grads: no modules")
    P = {g.shape[0] for g in [*g_hack.values(), *g_clean.values()]}
    if len(P) != 1:
        raise ValueError(f"directions_from_grads: modules disagree on the number of pairs: {sorted(P)}")
    P = P.pop()
    if P - n_heldout < 1:
        raise ValueError(f"directions_from_grads: {P} pairs with n_heldout={n_heldout} leaves none to fit")
    V, S, stats = {}, {}, {"k_kept": {}, "votes_pos": {}, "n_train": P - n_heldout}
    for name in g_hack:
        D = g_hack[name].float() - g_clean[name].float()  # (P, R): pairing cancels prompt-specific gradient
        V[name], S[name], st = top_directions(D[:P - n_heldout], k, tau_axis)
        stats["k_kept"][name], stats["votes_pos"][name] = st["k_kept"], st["votes_pos"]
    stats["heldout"] = heldout_scores(g_hack, g_clean, V, n_heldout)
    return V, S, stats


def postprocess(V: dict[str, Tensor], S: dict[str, Tensor], k_use: int | None = None,
                drop_bottom_frac: float = 0.0) -> tuple[dict[str, Tensor], dict]:
    """Load-time post-processing : V[name] (K, R), S[name] (K,) -> V_used[name] (K', R), report.

    Keeps the top k_use rows (None: all), then a global noise floor: the drop_bottom_frac quantile
    (linear interpolation) of ALL modules' stored singular values pooled (before the k_use slice, so
    the floor does not move with k_use); rows with S below it are dropped (a noisy module is not
    protected by its own top axis), and modules left with no row are dropped. report: threshold,
    dropped_rows per module, dropped_modules, kept_rows.
    """
    if not 0.0 <= drop_bottom_frac < 1.0:
        raise ValueError(f"postprocess: drop_bottom_frac must be in [0, 1), got {drop_bottom_frac}")
    if k_use is not None and k_use < 1:
        raise ValueError(f"postprocess: k_use must be >= 1 or None, got {k_use}")
    pooled = torch.cat([S[n].float() for n in sorted(S)]) if S else torch.zeros(0)
    use_floor = drop_bottom_frac > 0 and pooled.numel() > 0
    thresh = float(torch.quantile(pooled, drop_bottom_frac)) if use_floor else None
    out, report = {}, {"threshold": thresh, "dropped_rows": {}, "dropped_modules": [], "kept_rows": 0}
    for name in V:
        Vn, Sn = V[name][:k_use], S[name][:k_use]
        keep = Sn >= thresh if thresh is not None else torch.ones_like(Sn, dtype=torch.bool)
        report["dropped_rows"][name] = int(V[name].shape[0] - keep.sum())
        if keep.any():
            out[name] = Vn[keep]
            report["kept_rows"] += int(keep.sum())
        else:
            report["dropped_modules"].append(name)
    return out, report


def random_like(V: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """Control `random`: per module a random orthonormal (K, R) of the same shape as V[name] (seeded,
    modules in sorted order). Rows are unit-norm like real V rows; S is kept by the caller."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(V):
        K, R = V[name].shape
        Q, _ = torch.linalg.qr(torch.randn(R, K, generator=gen))  # (R, K) orthonormal columns
        out[name] = Q.T.contiguous()
    return {name: out[name] for name in V}


def _same_V(V: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    return V


# control -> (pair transform before extraction, V transform after). `random` extracts from the real
# pairs first so its shapes (K per module) and S (hence what the noise floor drops) match the real V.
CONTROLS: dict[str, tuple[Callable, Callable[[dict[str, Tensor], int], dict[str, Tensor]]]] = {
    "none": (PAIR_CONTROLS["none"], _same_V), "random": (PAIR_CONTROLS["none"], random_like),
    "shuffled": (PAIR_CONTROLS["shuffled"], _same_V), "nonhack": (PAIR_CONTROLS["nonhack"], _same_V),
}


# --- extraction from a model ---------------------------------------------------------------


def cache_meta(settings: ExtractSettings, knobs, tokenizer, pairs: Sequence[Pair]) -> dict[str, str]:
    """The metadata an extraction is keyed by: format, model fingerprint, knob kind, tokenizer fingerprint
    (text pairs are encoded with its vocabulary and chat template), pairs hash, settings."""
    return {"format": FORMAT, "fingerprint": str(knobs.fingerprint()), "knob_kind": str(knobs.kind),
            "tokenizer": tokenizer_fingerprint(tokenizer), "pairs_hash": pairs_hash(pairs),
            "settings": json.dumps(asdict(settings), sort_keys=True)}


def extract_direction(model, knobs, tokenizer, pairs: Sequence[Pair], settings: ExtractSettings) -> Direction:
    """V_hack from `pairs` under `settings` (control applied: pairs transformed first, V replaced after)."""
    pair_control, v_control = CONTROLS[settings.control]
    used = pair_control(pairs, settings.seed)
    if len(used) - settings.n_heldout < 1:  # fail before the (slow) gradients, not after
        raise ValueError(f"extract_direction: {len(used)} pairs with n_heldout={settings.n_heldout} "
                         "leaves none to fit; add pairs or lower n_heldout")
    g_hack, g_clean = pair_grads(model, knobs, tokenizer, used, settings.nll_norm, settings.nll_const)
    V, S, stats = directions_from_grads(g_hack, g_clean, settings.k, settings.tau_axis, settings.n_heldout)
    V = v_control(V, settings.seed)
    stats["heldout"] = heldout_scores(g_hack, g_clean, V, settings.n_heldout)  # of the V actually returned
    stats["n_pairs"] = len(used)
    stats["heldout_shared_prompts"] = heldout_shared_prompts(used, settings.n_heldout)
    meta = cache_meta(settings, knobs, tokenizer, pairs)
    return Direction(V, S, {**meta, "stats": json.dumps(stats, sort_keys=True)})


# --- storage and cache -------------------------------------------------------------------------


class DirectionFileError(ValueError):
    """A V_hack file that cannot be trusted (unreadable, wrong format, checksum or shape mismatch)."""


def _checksum(tensors: dict[str, Tensor], meta: dict[str, str]) -> str:
    """sha256 over the metadata (all but the checksum itself) and every tensor's name, dtype, shape, bytes."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    h = hashlib.sha256(json.dumps(body, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def save_direction(path: str | pathlib.Path, d: Direction) -> None:
    """Atomically write `d` as safetensors: `V/<module>` (K, R) and `S/<module>` (K,) fp32, plus d.meta
    and a sha256 `checksum` of the tensors."""
    path = pathlib.Path(path)
    tensors = {f"V/{n}": d.V[n].detach().float().cpu().contiguous() for n in d.V}
    tensors |= {f"S/{n}": d.S[n].detach().float().cpu().contiguous() for n in d.S}
    meta = {**d.meta, "format": FORMAT}
    meta["checksum"] = _checksum(tensors, meta)
    save_tensors(path, tensors, meta)


def load_direction(path: str | pathlib.Path) -> Direction:
    """Read and verify a V_hack file; anything untrustworthy raises DirectionFileError naming the file."""
    path = pathlib.Path(path)
    try:
        tensors, meta = load_tensors(path)  # fresh aligned copies: see store.py
    except (UserError, OSError) as e:
        raise DirectionFileError(str(e) if isinstance(e, UserError) else f"{path}: unreadable ({e})") from e
    if meta.get("format") != FORMAT:
        raise DirectionFileError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("checksum") != _checksum(tensors, meta):
        raise DirectionFileError(f"{path}: checksum mismatch (file modified or corrupted)")
    V = {k[2:]: t for k, t in tensors.items() if k.startswith("V/")}
    S = {k[2:]: t for k, t in tensors.items() if k.startswith("S/")}
    if V.keys() != S.keys() or len(V) + len(S) != len(tensors):
        raise DirectionFileError(f"{path}: tensors must be V/<module> and S/<module> pairs, "
                                 f"got {sorted(tensors)}")
    for n in V:
        if V[n].ndim != 2 or S[n].shape != (V[n].shape[0],):
            raise DirectionFileError(f"{path}: module {n}: V {tuple(V[n].shape)} and S {tuple(S[n].shape)} "
                                     "do not match (expected (K, R) and (K,))")
        gram = V[n] @ V[n].T  # (K, K): rows must be orthonormal for the projection to be exact
        if not torch.allclose(gram, torch.eye(V[n].shape[0]), atol=1e-4):
            raise DirectionFileError(f"{path}: module {n}: rows of V are not orthonormal")
    return Direction(V, S, meta)


def _meta_diff(have: dict[str, str], want: dict[str, str]) -> list[str]:
    """Human-readable differences between cached and wanted metadata (settings field by field)."""
    out = []
    for k, v in want.items():
        if have.get(k) == v:
            continue
        if k == "settings" and k in have:
            a, b = json.loads(have[k]), json.loads(v)
            out += [f"settings.{f}: cached {a.get(f)!r} != wanted {b[f]!r}" for f in b if a.get(f) != b[f]]
        else:
            out.append(f"{k}: cached {have.get(k)!r} != wanted {v!r}")
    return out


def resolve(path: str | pathlib.Path, settings: ExtractSettings, model, knobs, tokenizer, pairs: list[Pair],
            *, extract: Callable[..., Direction] = extract_direction) -> tuple[Direction, str]:
    """Cached V_hack: (direction, status) with status "hit", "miss", "mismatch: ..." or "corrupt: ...".

    hit: the file's metadata equals cache_meta(settings, knobs, tokenizer, pairs) and the file verifies.
    miss: no file. Mismatch (another model, knob kind, tokenizer, pairs or settings) and a corrupt file
    are re-extracted and overwritten, with a warning saying why; a wrong V is never returned.
    """
    path = pathlib.Path(path)
    want = cache_meta(settings, knobs, tokenizer, pairs)
    status = "miss"
    if path.exists():
        try:
            d = load_direction(path)
        except DirectionFileError as e:
            status = f"corrupt: {e}"
        else:
            diff = _meta_diff(d.meta, want)
            if not diff:
                return d, "hit"
            status = "mismatch: " + "; ".join(diff)
        warnings.warn(f"V_hack cache {path}: {status}; re-extracting", stacklevel=2)
    d = extract(model, knobs, tokenizer, pairs, settings)
    save_direction(path, d)
    return d, status
