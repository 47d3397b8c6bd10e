"""V_hack for a run: its pairs, its extraction settings, its cache file, and the cached extraction.

Each function takes the whole `Config` and reads `cfg.proj.*` (and the run's cache root):
  v_pairs          the contrastive pairs: --proj.pairs, else the environment's hack/clean templates
  extract_settings the settings the extraction reads: with the cache key, exactly what changes V
  v_hack_path      --proj.v-path, else the cache file keyed by model, tokenizer, pairs and settings
  resolve_v_hack   the cached direction (extracted on a miss, at zeroed knobs), post-processed for use
docs/architecture.md ("The data path of one step") shows where the loop calls these.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from collections.abc import Sequence

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.errors import UserError
from projected_grpo.hack import direction, pairs
from projected_grpo.knobs import adapters


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def at_zero(knobs: adapters.Knobs):
    """Context: every knob (main and quarantine) set to exactly zero, its values restored on exit. For work
    defined at the base model whatever the knobs start from (V_hack's extraction, whose cache key names the
    model, not knob values)."""
    saved = {w: {n: v.clone() for n, v in knobs.values(w).items()} for w in ("main", "hack")}
    try:
        for w in saved:
            for v in knobs.values(w).values():
                v.zero_()
        yield knobs
    finally:
        for w, values in saved.items():
            for n, v in knobs.values(w).items():
                v.copy_(values[n])


def extract_settings(cfg: C.Config) -> direction.ExtractSettings:
    """The extraction settings of cfg.proj (with the loss's constant denominator): V_hack's cache key."""
    return direction.ExtractSettings(
        k=cfg.proj.k, tau_axis=cfg.proj.tau_axis, n_heldout=cfg.proj.n_heldout, nll_norm=cfg.proj.nll_norm,
        nll_const=float(cfg.rollout.dr_grpo_denom), control=cfg.proj.control,
        # the seed only draws the controls; the real V is seed-free, so every seed shares one cached V
        seed=cfg.run.seed if cfg.proj.control != "none" else 0)


def v_pairs(cfg: C.Config, env, problems: Sequence) -> list[pairs.Pair]:
    """V_hack's contrastive pairs: cfg.proj.pairs, else the environment's templates of `problems` ([] when
    no problem has both a hack and a clean template, e.g. a plain reward callable's prompts)."""
    if cfg.proj.pairs:
        return pairs.load_pairs_file(cfg.proj.pairs)
    if not any(env.templates(p, "hack") and env.templates(p, "clean") for p in problems):
        return []
    return pairs.builtin_pairs(env, problems, cfg.proj.pairs_per_problem)


def v_hack_path(cfg: C.Config, knobs, tokenizer, pair_list, settings) -> pathlib.Path:
    """cfg.proj.v_path, else the cache file keyed by everything the extraction depends on."""
    if cfg.proj.v_path:
        return pathlib.Path(cfg.proj.v_path)
    key = store.stable_hash(direction.cache_meta(settings, knobs, tokenizer, pair_list))
    return store.cache_root(cfg.model.cache_dir or None) / "v_hack" / f"{key}.safetensors"


def resolve_v_hack(cfg: C.Config, model, knobs, tokenizer, env, problems: Sequence):
    """(V_hack post-processed for use (name -> (K, R)), status line): the cached direction, extracted on a
    miss (slow on a real model: a line says so first)."""
    settings = extract_settings(cfg)
    pair_list = [] if cfg.proj.v_path else v_pairs(cfg, env, problems)
    if not pair_list and not cfg.proj.v_path:
        if cfg.proj.arm != "none":
            raise UserError(f"proj.arm={cfg.proj.arm!r} needs V_hack, but environment {env.name!r} has no "
                            "hack and clean templates to pair: give --proj.pairs FILE or --proj.v-path FILE")
        return {}, "V_hack: none (no pairs in this environment; arm none measures nothing, proj/* read 0)"
    path = v_hack_path(cfg, knobs, tokenizer, pair_list, settings)
    if not path.exists():
        _log(f"V_hack: extracting from {len(pair_list)} pairs into {path} (first use of these inputs)")
    t0 = time.perf_counter()
    with at_zero(knobs):  # model.init_knobs / dpo.before: still the base model's V_hack (its cache key)
        found, status = direction.resolve(path, settings, model, knobs, tokenizer, pair_list)
    V, report = direction.postprocess(found.V, found.S, cfg.proj.k_use, cfg.proj.drop_bottom_frac)
    line = (f"V_hack {path} ({status}, {time.perf_counter() - t0:.0f} s): {sum(len(v) for v in V.values())} "
            f"rows in {len(V)} modules, dropped {report['dropped_modules']}")
    return V, line
