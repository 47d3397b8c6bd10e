"""`projected-grpo extract-direction`: extract V_hack (direction.py) for a preset's (or --model's) model and
print per module the kept axes, singular values and held-out scores. Settings are the run's own
`--proj.*` fields (k, tau_axis, n_heldout, nll_norm, control, pairs, pairs_per_problem, k_use,
drop_bottom_frac), so a direction extracted here is the one `train` would use with the same flags.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from projected_grpo import presets
from projected_grpo.errors import UserError
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.hack.direction import extract_direction, postprocess, resolve
from projected_grpo.hack.pairs import DETECTORS


@dataclass(frozen=True, kw_only=True)
class ExtractOpts(presets.Base):
    """projected-grpo extract-direction: pairs come from --proj.pairs, a mined --pool, or the environment's
    templates (as train's); `--out` caches the result (reused when its inputs match)."""

    pool: str = ""
    """a graded teacher-pool JSONL to mine pairs from, with --known-modes (the weak detector of LOMO)"""
    known_modes: tuple[str, ...] = ()
    """pool mining: the loophole modes whose detectors may label hacks"""
    detectors: tuple[str, ...] = ("E",)
    """pool mining: a row is a hack when any of these detectors fires (E, C, D)"""
    out: str = ""
    """save (and reuse when it matches) the direction at this .safetensors path"""


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
    s = hack_resolve.extract_settings(cfg)
    if opts.out:
        d, status = resolve(opts.out, s, model, knobs, tok, pairs)
        print(f"cache {opts.out}: {status}")
    else:
        d = extract_direction(model, knobs, tok, pairs, s)
    stats = d.stats
    print(f"V_hack: {stats['n_pairs']} pairs ({stats['n_train']} fit, {s.n_heldout} held out), k={s.k}, "
          f"tau_axis={s.tau_axis}, nll_norm={s.nll_norm}, control={s.control}, knob={cfg.model.knob}")
    width = max(len(n) for n in d.V)
    print(f"{'module':<{width}}  K  heldout  S")
    for n in d.V:
        h = stats["heldout"][n]
        sv = " ".join(f"{x:.3g}" for x in d.S[n].tolist())
        print(f"{n:<{width}}  {d.V[n].shape[0]}  {'n/a' if h is None else f'{h:.2f}':>7}  {sv}")
    scores = [h for h in stats["heldout"].values() if h is not None]
    if scores:
        print(f"held-out score (v1, mean over {len(scores)} modules): {sum(scores) / len(scores):.3f}")
    if shared := stats.get("heldout_shared_prompts", 0):
        print(f"note: {shared} of the {s.n_heldout} held-out pairs share a prompt with fit pairs, so the "
              "held-out score is optimistic; make --proj.n-heldout a multiple of --proj.pairs-per-problem")
    V_used, report = postprocess(d.V, d.S, cfg.proj.k_use, cfg.proj.drop_bottom_frac)
    print(f"as training uses it (proj.k_use={cfg.proj.k_use}, proj.drop_bottom_frac="
          f"{cfg.proj.drop_bottom_frac}): {report['kept_rows']} rows kept in {len(V_used)} modules; "
          f"threshold={report['threshold']}; dropped rows {sum(report['dropped_rows'].values())}; "
          f"dropped modules {report['dropped_modules']}")
    return 0
