"""V_hack for a run: its pairs, its extraction settings, its cache file, and the cached extraction.

Each function takes the whole `Config` and reads `cfg.proj.*` (and the run's cache root):
  v_pairs          the contrastive pairs: --proj.pairs, else the environment's hack/clean templates
  extract_settings the settings the extraction reads: with the cache key, exactly what changes V
  v_inputs         what decides V besides its control: the runs that can share one extraction
  v_hack_path      --proj.v-path, else the cache file keyed by model, tokenizer, pairs and settings
  resolve_v_hack   the cached direction (extracted on a miss, at zeroed knobs) and its held-out check: said
                   loudly when V does not beat its controls, refused under proj.require_check, and written
                   to the run directory (CHECK_FILE) for the report
docs/architecture.md ("The data path of one step") shows where the loop calls these.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.errors import UserError
from projected_grpo.hack import check, direction, pairs
from projected_grpo.knobs import adapters

# a run directory's record of the held-out check of the V_hack it uses (study/report.py reads it)
CHECK_FILE = "v_hack_check.json"


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
    """The extraction settings of cfg.proj: V_hack's cache key, holding exactly what the extraction reads."""
    return direction.ExtractSettings(
        k=cfg.proj.k, heldout_frac=cfg.proj.heldout_frac, nll_norm=cfg.proj.nll_norm,
        # the loss's constant denominator (G, B, max_new_tokens) is read only by nll_norm "constant": under
        # "mean" it is left out of the key, so a new group size does not re-extract the same V
        nll_const=float(cfg.rollout.dr_grpo_denom) if cfg.proj.nll_norm == "constant" else None,
        control=cfg.proj.control,
        # the seed only draws the seeded controls; the real V and the deterministic controls are seed-free,
        # so every seed shares one cached V
        seed=cfg.run.seed if cfg.proj.control in direction.SEEDED else 0)


def v_inputs(cfg: C.Config) -> str | None:
    """A stable key of what decides the run's V_hack besides proj.control: the model, the environment (its
    pairs), the pairs options, the other extraction settings, and run.seed (the smoke model, the maths
    problems and the knobs are drawn with it). Runs with one key share one extraction (study/launch.py fills
    their cache with one `extract-direction --controls`); a key too fine only costs a cache check. None when
    the run reads its own file (proj.v_path)."""
    if cfg.proj.v_path:
        return None
    d = cfg.to_dict()
    alike = direction.control_settings(extract_settings(cfg), "none", 0)
    return store.stable_hash({"model": d["model"], "env": d["env"], "pairs": cfg.proj.pairs,
                              "pairs_per_problem": cfg.proj.pairs_per_problem, "settings": asdict(alike),
                              "seed": cfg.run.seed})


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


def check_report(cfg: C.Config, found: direction.Direction) -> tuple[str, bool | None]:
    """(the lines to print at a run's start, passed) for the held-out check of the real V in `found`'s stats;
    a failed check is printed as a WARNING block, and refused (UserError) under proj.require_check."""
    chk = found.stats.get("check", {})
    passed, why = check.verdict(chk)
    body = "\n".join(check.lines(chk))
    if passed is False and cfg.proj.require_check:
        raise UserError(f"proj.require_check: {why}\n{body}")
    if passed is False:
        bar = "!" * 100
        return f"{bar}\nWARNING: {why}\n{body}\n{bar}", passed
    return f"{why}\n{body}", passed


def resolve_v_hack(cfg: C.Config, model, knobs, tokenizer, env, problems: Sequence):
    """(V_hack for use (name -> (K, R)), status line): the cached direction, extracted on a miss (slow on a
    real model: a line says so first). Its held-out check is printed (check_report) and, when the run has a
    directory, written there as CHECK_FILE."""
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
    wanted = [(path, settings)]
    if settings.control == "random" and not cfg.proj.v_path:  # drawn from the real V, cached or extracted
        real = direction.control_settings(settings, "none", 0)
        wanted.insert(0, (v_hack_path(cfg, knobs, tokenizer, pair_list, real), real))
    with at_zero(knobs):  # model.init_knobs / dpo.before: still the base model's V_hack (its cache key)
        found, status = direction.resolve_many(wanted, model, knobs, tokenizer, pair_list)[-1]
    text, passed = check_report(cfg, found)
    _log(text)
    if cfg.run.dir and pathlib.Path(cfg.run.dir).is_dir():
        store.write_json_atomic(pathlib.Path(cfg.run.dir) / CHECK_FILE, {
            "v_hack": str(path), "control": cfg.proj.control, "passed": passed,
            "check": found.stats.get("check", {})})
    V = found.V
    line = (f"V_hack {path} ({status}, {time.perf_counter() - t0:.0f} s): {sum(len(v) for v in V.values())} "
            f"rows in {len(V)} modules, control {cfg.proj.control}; held-out check "
            f"{ {True: 'passed', False: 'FAILED', None: 'undecided'}[passed] }")
    return V, line
