"""`projected-grpo extract-direction`: extract V_hack (direction.py) for a preset's (or --model's) model and
print per module the kept axes and singular values, then V's held-out check: its separation of held-out hack
from clean gradients beside every control's, with intervals (hack/check.py), and how much of the pairs'
completion gradients, centred per prompt, each V captures. Settings are the run's own `--proj.*` fields (k,
heldout_frac, nll_norm, control, pairs, pairs_per_problem, require_check), so a direction extracted here is
the one `train` would use with the same flags: without --out it is cached where `train` looks for it
(hack/resolve.v_hack_path), so extracting once ahead (minutes on a real model) serves every later run.
`--controls` and `--seeds` add other controls' directions from the same gradients (direction.extract_many):
a study runs this once per seed before its runs (study/launch.py), so each control is not one more
extraction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from projected_grpo import presets
from projected_grpo.errors import UserError
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.hack.check import CHECKED
from projected_grpo.hack.direction import CONTROLS, SEEDED, ExtractSettings, control_settings, resolve_many
from projected_grpo.hack.pairs import DETECTORS


@dataclass(frozen=True, kw_only=True)
class ExtractOpts(presets.Base):
    """projected-grpo extract-direction: pairs come from --proj.pairs, a mined --pool, or the environment's
    templates (as train's); the result is cached (reused when its inputs match) where `train` reads it, or at
    `--out`."""

    pool: str = ""
    """a graded teacher-pool JSONL to mine pairs from, with --known-modes (the weak detector of LOMO)"""
    known_modes: tuple[str, ...] = ()
    """pool mining: the loophole modes whose detectors may label hacks"""
    detectors: tuple[str, ...] = ("E",)
    """pool mining: a row is a hack when any of these detectors fires (E, C, D)"""
    out: str = ""
    """save (and reuse when it matches) the direction at this .safetensors path instead of the cache `train`
    reads (empty: that cache, keyed by model, tokenizer, pairs and settings)"""
    controls: tuple[str, ...] = ()
    """also extract these controls (random, shuffled, nonhack, within, energy, none) from the same gradients,
    each cached where `train` reads it with that --proj.control (one extraction for a whole study)"""
    seeds: tuple[int, ...] = ()
    """the random seeds the seeded controls among --controls are drawn with (empty: --run.seed); a run with
    another --run.seed reads them only where its model and pairs do not depend on the seed (the cache key
    says)"""
    allow_no_pairs: bool = False
    """exit 0 with a line when there are no pairs (a study's runs in such an environment need no V_hack)"""


def _others(opts: ExtractOpts, s: ExtractSettings, run_seed: int) -> list[ExtractSettings]:
    """The settings --controls and --seeds ask for besides `s` (the run's own), each once."""
    if bad := [c for c in opts.controls if c not in CONTROLS]:
        raise UserError(f"--controls {bad}: known controls are {list(CONTROLS)}")
    seeds = opts.seeds or (run_seed,)
    out = []
    for c in ("none", *opts.controls) if opts.controls else ():  # the real V: the random control's base
        for o in (control_settings(s, c, seed) for seed in seeds):
            if o != s and o not in out:
                out.append(o)
    return out


def main(argv: list[str]) -> int:
    """`projected-grpo extract-direction`: see ExtractOpts."""
    from projected_grpo.run import setup

    cfg, opts = presets.parse(argv, "projected-grpo extract-direction", ExtractOpts)
    if bad := [d for d in opts.detectors if d not in DETECTORS]:
        raise UserError(f"--detectors {bad}: known detectors are {list(DETECTORS)}")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()["train"]
        if opts.pool:
            ids = {i: p_ids for i, (_, p_ids) in setup.prompt_table(env, tok, problems).items()}
            pairs, stats = setup.mined_pairs(opts.pool, tok, problems, ids, opts.known_modes, opts.detectors,
                                       cfg.proj.pairs_per_problem)
            print(f"pool pairs: {stats}")
        else:
            pairs = hack_resolve.v_pairs(cfg, env, problems)
    if not pairs:
        if opts.allow_no_pairs:
            print(f"V_hack: environment {cfg.env.name!r} has no hack and clean templates to pair; nothing to "
                  "extract")
            return 0
        raise UserError(f"environment {cfg.env.name!r} has no hack and clean templates to pair: give "
                        "--proj.pairs FILE or --pool FILE")
    if opts.controls and (opts.out or cfg.proj.v_path):
        raise UserError("--controls caches each control where `train` reads it: drop --out and --proj.v-path")
    s = hack_resolve.extract_settings(cfg)
    path = opts.out or hack_resolve.v_hack_path(cfg, knobs, tok, pairs, s)
    others = _others(opts, s, cfg.run.seed)
    wanted = [(path, s), *((hack_resolve.v_hack_path(cfg, knobs, tok, pairs, o), o) for o in others)]
    with hack_resolve.at_zero(knobs):  # as train's: V_hack is the base model's whatever --model.init-knobs
        (d, status), *found = resolve_many(wanted, model, knobs, tok, pairs)
    print(f"cache {path}: {status}" + ("" if opts.out else " (the one `train` reads with these flags)"))
    for (p, o), (_, st) in zip(wanted[1:], found, strict=True):
        print(f"cache {p}: {st} (--proj.control {o.control}" + (f", seed {o.seed})" if o.control in SEEDED
                                                                   else ")"))
    stats = d.stats
    print(f"V_hack: {stats['n_pairs']} pairs ({stats['n_train']} fit, {stats['n_heldout']} held out from "
          f"{stats['heldout_prompts']} prompts), k={s.k}, heldout_frac={s.heldout_frac}, "
          f"nll_norm={s.nll_norm}, control={s.control}, knob={cfg.model.knob}")
    width = max(len(n) for n in d.V)
    print(f"{'module':<{width}}  K  S")
    for n in d.V:
        print(f"{n:<{width}}  {d.V[n].shape[0]}  {' '.join(f'{x:.3g}' for x in d.S[n].tolist())}")
    chk = stats["check"]
    order = ["real", *CHECKED]
    shown = lambda e: " ".join(f"{n} {e[n]:.3f}" for n in order if n in e)
    print(f"share of the completion gradients (centred per prompt) inside span(V), both signs (the energy "
          f"control is matched on the fit pairs'): fit pairs {shown(chk['energy'])}")
    if "energy_heldout" in chk:
        print(f"  held-out pairs {shown(chk['energy_heldout'])}")
    print(hack_resolve.check_report(cfg, d)[0])  # under --proj.require-check a failed check exits 2
    return 0
