"""Hack-direction extraction (V_hack): from contrastive pairs to per-module hack directions, checked, cached.

`extract_direction` holds whole prompts out of the fit (pairs.split_heldout), takes every needed pair's knob
gradients once (knob_grads.py; the controls reuse the real pairs' completions), fits V on the fit pairs
(subspace.py: SVD of D = g_hack − g_clean, majority-vote orientation), builds every negative control
(pairs.py: shuffled, nonhack, within; controls.py: random, and energy, matched on the fit completions'
gradients centred per prompt) and checks the real V against them on the
held-out pairs (check.py). It returns the V that `settings.control` names, with the check of the real V in its
stats; `extract_many` returns several controls and seeds from the one pass of gradients. Also here:
safetensors storage with a checksum, and `resolve` / `resolve_many` (a cache keyed by model fingerprint,
tokenizer, pairs hash and exactly the settings the extraction reads).
Deliberately not here: applying V to training gradients (projection.py), the math (subspace.py), the
`extract-direction` CLI (run/direction_cli.py).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from projected_grpo.errors import UserError
from projected_grpo.hack import check as C
from projected_grpo.hack.controls import energy_matched, random_like
from projected_grpo.hack.knob_grads import pair_grads
from projected_grpo.hack.pairs import (
    PAIR_CONTROLS,
    Pair,
    completions_by_prompt,
    pairs_hash,
    prompt_groups,
    split_heldout,
)
from projected_grpo.hack.subspace import centred, directions_from_grads, energy
from projected_grpo.store import load_tensors, save_tensors, tokenizer_fingerprint

# /3: the energy control of wide modules from the completions' Gram matrix (controls._top_and_bottom): V
# files of /2 are re-extracted, so no cache mixes the two constructions
FORMAT = "projected-grpo/v_hack/3"
# every control of V_hack (docs/preregistration.md, "Controls"): pair-level ones change the pairs before the
# fit (pairs.PAIR_CONTROLS), V-level ones replace the real V after it (controls.py)
CONTROLS = ("none", "random", "shuffled", "nonhack", "within", "energy")
# controls drawn at random (the run's seed draws them); the others are deterministic
SEEDED = ("random", "shuffled", "energy")
# the held-out check's controls are drawn with this seed, so every run (any seed, any control) carries the
# same check of the same real V
CHECK_SEED = 0


@dataclass(frozen=True)
class ExtractSettings:
    """Exactly what an extraction reads besides the model and the pairs: the cache key. Built from the run's
    config by hack/resolve.extract_settings (validated there, once: the fields are `proj.<name>`), plus
    nll_const (the Dr.GRPO constant; None unless nll_norm == "constant", which alone reads it) and seed
    (draws the seeded controls; 0 for the real V and the deterministic controls)."""

    k: int
    heldout_frac: float
    nll_norm: Literal["mean", "constant"]
    nll_const: float | None
    control: Literal["none", "random", "shuffled", "nonhack", "within", "energy"]
    seed: int


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


# --- extraction from a model ---------------------------------------------------------------


def cache_meta(settings: ExtractSettings, knobs, tokenizer, pairs: Sequence[Pair]) -> dict[str, str]:
    """The metadata an extraction is keyed by: format, model fingerprint, knob kind, tokenizer fingerprint
    (text pairs are encoded with its vocabulary and chat template), pairs hash, settings."""
    return {"format": FORMAT, "fingerprint": str(knobs.fingerprint()), "knob_kind": str(knobs.kind),
            "tokenizer": tokenizer_fingerprint(tokenizer), "pairs_hash": pairs_hash(pairs),
            "settings": json.dumps(asdict(settings), sort_keys=True)}


def _pooled_energy(X: dict[str, Tensor], V: dict[str, Tensor]) -> float:
    """Σ_m ‖X_m V_mᵀ‖² / Σ_m ‖X_m‖²: subspace.energy pooled over modules (as proj/cin pools them)."""
    tot = {m: float(x.float().square().sum()) for m, x in X.items()}
    num = sum(energy(X[m], V[m]) * tot[m] for m in X if m in V and V[m].shape[0])
    return num / sum(tot.values()) if sum(tot.values()) > 0 else 0.0


def _pair_lists(fit: list[Pair], seed: int) -> tuple[dict[str, list[Pair]], dict[str, str]]:
    """The pair-level controls of the fit pairs (name -> pairs), and those that cannot be built (name ->
    why)."""
    out, unavailable = {}, {}
    for name, fn in PAIR_CONTROLS.items():
        if name != "none":
            try:
                out[name] = fn(fit, seed)
            except ValueError as e:
                unavailable[name] = str(e)
    return out, unavailable


def _grads(model, knobs, tokenizer, lists: dict[str, list[Pair]], settings: ExtractSettings,
           chunk_tokens: int | None = None):
    """Knob gradients of every list's pairs from ONE pair_grads call (repeated completions computed once):
    name -> (g_hack, g_clean) with module -> (P_list, R). chunk_tokens: pair_grads's (None: its default)."""
    flat = [p for ps in lists.values() for p in ps]
    chunk = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    g_hack, g_clean = pair_grads(model, knobs, tokenizer, flat, settings.nll_norm, settings.nll_const or 1.0,
                                 **chunk)
    out, at = {}, 0
    for name, ps in lists.items():
        out[name] = ({m: g[at:at + len(ps)] for m, g in g_hack.items()},
                     {m: g[at:at + len(ps)] for m, g in g_clean.items()})
        at += len(ps)
    return out


ENERGY_UNAVAILABLE = ("energy control: every prompt has one hack and one clean completion, so the only "
                      "within-prompt variation is the labelled contrast itself and a label-free V of the "
                      "same energy would be V; give several variants per prompt (pairs_per_problem >= 2)")


def unavailable_controls(pairs: Sequence[Pair], heldout_frac: float) -> dict[str, str]:
    """The controls that cannot be built from `pairs` (name -> why), decided as `extract` decides it, from
    the fit pairs alone and without a gradient: a study refuses such an arm when it plans it."""
    fit, _ = split_heldout(list(pairs), heldout_frac)
    unavailable = _pair_lists(fit, CHECK_SEED)[1]
    if not _varies_within_prompt(completions_by_prompt(fit)):
        unavailable["energy"] = ENERGY_UNAVAILABLE
    return unavailable


def _varies_within_prompt(groups: Sequence[Sequence]) -> bool:
    """Some prompt has more than its one hack and one clean completion: the energy control's condition."""
    return max((len(g) for g in groups), default=0) > 2


def _control(name: str, seed: int, G: dict, V: dict[str, Tensor], S: dict[str, Tensor], k: int,
             C_fit: dict[str, Tensor] | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(V, S) of control `name` drawn with `seed`. G: list name -> (g_hack, g_clean) of the fit pairs ("fit")
    and of each pair-level control's pairs; C_fit: the fit completions' gradients centred per prompt, None
    when every prompt has a single pair's two completions (the energy control cannot be built: ValueError)."""
    if name == "random":
        return random_like(V, seed), S
    if name == "energy":
        if C_fit is None:
            raise ValueError(ENERGY_UNAVAILABLE)
        D = {m: G["fit"][0][m].float() - G["fit"][1][m].float() for m in V}
        return energy_matched(V, C_fit, D, seed)[0], S
    V_c, S_c, _ = directions_from_grads(*G[name], k)
    return V_c, S_c


@dataclass
class Extraction:
    """Everything one extraction computed: `direction` (what extract_direction returns), the real V (module ->
    (K, R); direction.V is the control's under settings.control), every control V the check built (name ->
    module -> (K, R)), the held-out pairs and their knob gradients g_hack, g_clean (module -> (H, R); empty
    dicts when nothing is held out). run/separation.py scores the direction monitor with them."""

    direction: Direction
    real: dict[str, Tensor]
    controls: dict[str, dict[str, Tensor]]
    held: list[Pair]
    g_held: tuple[dict[str, Tensor], dict[str, Tensor]]


def extract_direction(model, knobs, tokenizer, pairs: Sequence[Pair], settings: ExtractSettings) -> Direction:
    """V_hack from `pairs` under `settings`: the V of settings.control (the real one for "none"), with the
    real V's held-out check against every control in its stats (see the module docstring)."""
    return extract(model, knobs, tokenizer, pairs, settings).direction


def extract(model, knobs, tokenizer, pairs: Sequence[Pair], settings: ExtractSettings,
            chunk_tokens: int | None = None) -> Extraction:
    """extract_direction, keeping what it computed on the way (Extraction). chunk_tokens bounds the padded
    tokens of one forward and backward (knob_grads.pair_grads; None: its default): memory, not the result
    (beyond float rounding of other batch shapes)."""
    return extract_many(model, knobs, tokenizer, pairs, [settings], chunk_tokens)[0]


def _refuse_unavailable(control: str, unavailable: dict[str, str]) -> None:
    """UserError when proj.control names a control that cannot be built from these pairs (and why)."""
    if control in unavailable:
        raise UserError(f"proj.control={control!r} cannot be built from these pairs: {unavailable[control]}")


def control_settings(settings: ExtractSettings, control: str, seed: int) -> ExtractSettings:
    """`settings` for another control: drawn with `seed` when the control is SEEDED, else with 0 (the
    deterministic controls and the real V are seed-free, so every seed shares one cached V)."""
    return replace(settings, control=control, seed=seed if control in SEEDED else 0)


def extract_many(model, knobs, tokenizer, pairs: Sequence[Pair], settings: Sequence[ExtractSettings],
                 chunk_tokens: int | None = None) -> list[Extraction]:
    """`extract` for each of `settings` (alike but for control and seed) from ONE pass of knob gradients.

    Every control's pairs reuse the fit pairs' completions, and pair_grads computes each distinct sequence
    once in first-appearance order whatever lists follow the fit and held-out ones; so each result equals its
    own `extract` call bitwise, at the cost of one extraction (a study fills the cache of every control and
    seed of its runs this way: `extract-direction --controls`)."""
    if not settings:
        return []
    if len({control_settings(s, "none", 0) for s in settings}) != 1:
        raise ValueError(f"extract_many: settings must differ only in control and seed, got {list(settings)}")
    base = settings[0]
    fit, held = split_heldout(list(pairs), base.heldout_frac)
    lists, unavailable = _pair_lists(fit, CHECK_SEED)
    for s in settings:  # a seeded pair control at another seed: its own pairs (their gradients are copies)
        if s.control in lists and s.control in SEEDED and s.seed != CHECK_SEED:
            lists.setdefault(f"{s.control}@{s.seed}", PAIR_CONTROLS[s.control](fit, s.seed))
        _refuse_unavailable(s.control, unavailable)  # before the (slow) gradients
    every_list = {"fit": fit, "held": held, **lists}
    G = _grads(model, knobs, tokenizer, {n: ps for n, ps in every_list.items() if ps}, base, chunk_tokens)
    V, S, stats = directions_from_grads(*G["fit"], base.k)
    groups = completions_by_prompt(fit)
    C_fit = centred(*G["fit"], groups) if _varies_within_prompt(groups) else None
    fitted = {}
    for name in C.CHECKED:
        if name not in unavailable:
            try:
                fitted[name] = _control(name, CHECK_SEED, G, V, S, base.k, C_fit)
            except ValueError as e:
                unavailable[name] = str(e)
    held_D = {m: G["held"][0][m].float() - G["held"][1][m].float() for m in V} if held else \
        {m: torch.zeros(0, v.shape[1]) for m, v in V.items()}
    check = C.separation(held_D, prompt_groups(held), V, {n: f[0] for n, f in fitted.items()}, unavailable)
    every_v = [("real", V), *((n, f[0]) for n, f in fitted.items())]
    C_ref = C_fit if C_fit is not None else centred(*G["fit"], groups)
    check["energy"] = {n: _pooled_energy(C_ref, v) for n, v in every_v}
    if held:
        C_held = centred(*G["held"], completions_by_prompt(held))
        check["energy_heldout"] = {n: _pooled_energy(C_held, v) for n, v in every_v}
    stats |= {"n_pairs": len(pairs), "n_train": len(fit), "n_heldout": len(held),
              "heldout_prompts": len(set(prompt_groups(held))), "check": check}
    out = []
    for s in settings:
        V_s, S_s = V, S
        if s.control != "none":
            _refuse_unavailable(s.control, unavailable)  # now with the ones only the gradients showed
            own = f"{s.control}@{s.seed}"
            V_s, S_s = fitted[s.control] if s.seed == CHECK_SEED or s.control not in SEEDED else _control(
                s.control, s.seed, {**G, s.control: G[own]} if own in G else G, V, S, s.k, C_fit)
        meta = cache_meta(s, knobs, tokenizer, pairs)
        out.append(Extraction(Direction(V_s, S_s, {**meta, "stats": json.dumps(stats, sort_keys=True)}), V,
                              {n: f[0] for n, f in fitted.items()}, held, G.get("held", ({}, {}))))
    return out


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


def _cached(path: pathlib.Path, want: dict[str, str]) -> tuple[Direction | None, str]:
    """(the cached direction at `path` when its metadata equals `want` and it verifies, else None; status)."""
    if not path.exists():
        return None, "miss"
    try:
        d = load_direction(path)
    except DirectionFileError as e:
        status = f"corrupt: {e}"
    else:
        diff = _meta_diff(d.meta, want)
        if not diff:
            return d, "hit"
        status = "mismatch: " + "; ".join(diff)
    warnings.warn(f"V_hack cache {path}: {status}; re-extracting", stacklevel=3)
    return None, status


def resolve(path: str | pathlib.Path, settings: ExtractSettings, model, knobs, tokenizer, pairs: list[Pair],
            *, extract: Callable[..., Direction] = extract_direction) -> tuple[Direction, str]:
    """Cached V_hack: (direction, status) with status "hit", "miss", "mismatch: ..." or "corrupt: ...".

    hit: the file's metadata equals cache_meta(settings, knobs, tokenizer, pairs) and the file verifies.
    miss: no file. Mismatch (another model, knob kind, tokenizer, pairs or settings) and a corrupt file
    are re-extracted and overwritten, with a warning saying why; a wrong V is never returned.
    """
    path = pathlib.Path(path)
    d, status = _cached(path, cache_meta(settings, knobs, tokenizer, pairs))
    if d is None:
        d = extract(model, knobs, tokenizer, pairs, settings)
        save_direction(path, d)
    return d, status


def random_from_real(real: Direction, settings: ExtractSettings, knobs, tokenizer,
                     pairs: Sequence[Pair]) -> Direction:
    """Control `random` (settings.seed) of the real V `real` (settings.control "none"): only V's shapes and S
    enter it (controls.random_like) and its stats are the real V's check, so it equals its own extraction
    bitwise without one gradient."""
    return Direction(random_like(real.V, settings.seed), dict(real.S),
                     {**cache_meta(settings, knobs, tokenizer, pairs), "stats": real.meta["stats"]})


def resolve_many(wanted: Sequence[tuple[str | pathlib.Path, ExtractSettings]], model, knobs, tokenizer,
                 pairs: list[Pair], chunk_tokens: int | None = None) -> list[tuple[Direction, str]]:
    """`resolve` for several (path, settings) alike but for control and seed: a random control is drawn from
    the real V when that is cached (random_from_real); the others not cached are extracted together by ONE
    extract_many (each equal to its own extraction); each is saved. In `wanted`'s order."""
    found = [_cached(pathlib.Path(p), cache_meta(s, knobs, tokenizer, pairs)) for p, s in wanted]
    real = next((d for (d, _), (_, s) in zip(found, wanted) if d is not None and s.control == "none"), None)
    for i, ((d, status), (p, s)) in enumerate(zip(found, wanted)):
        if d is None and s.control == "random" and real is not None:
            found[i] = (random_from_real(real, s, knobs, tokenizer, pairs), status)
            save_direction(p, found[i][0])
    todo = [i for i, (d, _) in enumerate(found) if d is None]
    made = extract_many(model, knobs, tokenizer, pairs, [wanted[i][1] for i in todo], chunk_tokens) if todo \
        else []
    for i, ext in zip(todo, made, strict=True):
        save_direction(wanted[i][0], ext.direction)
        found[i] = (ext.direction, found[i][1])
    return found
