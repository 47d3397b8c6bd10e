"""`projected-grpo extract-direction`: extract V_hack (direction.py) from a model and print per module
the kept axes, singular values and held-out scores, optionally cached at --out and post-processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from projected_grpo.hack.direction import ExtractSettings, extract_direction, postprocess, resolve


@dataclass(frozen=True)
class ExtractOpts:
    """Extract V_hack and print per-module kept axes, singular values and held-out scores."""

    settings: ExtractSettings = ExtractSettings()
    preset: Literal["smoke"] | None = None
    """smoke: a tiny random model and tokenizer (organism.smoke_model_and_tokenizer), CPU, seconds"""
    model: str | None = None
    """a local Hugging Face model directory (used instead of --preset)"""
    knob: Literal["svd", "lora"] = "svd"
    """knob adapter kind the direction lives in"""
    pairs: str | None = None
    """a .json/.jsonl pairs file (keys prompt, hack, clean); default: the built-in pairs"""
    pool: str | None = None
    """a graded teacher-pool JSONL (built-in problems) to mine pairs from, with --known-modes"""
    known_modes: tuple[str, ...] = ()
    """pool mining: the loophole modes whose detectors may label hacks (leave-one-mode-out)"""
    detectors: tuple[str, ...] = ("E",)
    """pool mining: a row is a hack when any of these detectors fires (E, C, D)"""
    per_problem: int = 2
    """built-in / pool pairs per problem"""
    k_use: int | None = None
    """post-processing: keep the top k_use rows per module"""
    drop_bottom_frac: float = 0.0
    """post-processing: global noise floor quantile over all modules' singular values"""
    out: str | None = None
    """save (and reuse when it matches) the direction at this .safetensors path"""
    device: str = "cpu"
    """torch device for the model"""


def main(argv: list[str]) -> int:
    """`projected-grpo extract-direction`: see ExtractOpts."""
    import tyro

    from projected_grpo.hack.pairs import pairs_from_source
    from projected_grpo.knobs.adapters import wrap

    opts = tyro.cli(ExtractOpts, args=argv, prog="projected-grpo extract-direction",
                    config=(tyro.conf.OmitArgPrefixes,))
    if (opts.preset is None) == (opts.model is None):
        raise SystemExit("extract-direction: give exactly one of --preset smoke or --model DIR")
    if opts.preset == "smoke":
        from projected_grpo.organism.build import smoke_model_and_tokenizer

        torch.set_num_threads(1)  # a model this small gains nothing from threads; shared cores only spin
        model, tokenizer = smoke_model_and_tokenizer()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(opts.model, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(opts.model, local_files_only=True)
    model.to(opts.device)
    knobs = wrap(model, kind=opts.knob)
    pairs = pairs_from_source(tokenizer, opts.pairs, opts.pool, opts.known_modes, opts.detectors,
                              opts.per_problem)
    s = opts.settings
    if opts.out:
        d, status = resolve(opts.out, s, model, knobs, tokenizer, pairs)
        print(f"cache {opts.out}: {status}")
    else:
        d = extract_direction(model, knobs, tokenizer, pairs, s)
    stats = d.stats
    print(f"V_hack: {stats['n_pairs']} pairs ({stats['n_train']} fit, {s.n_heldout} held out), k={s.k}, "
          f"tau_axis={s.tau_axis}, norm={s.norm}, control={s.control}, knob={opts.knob}")
    width = max(len(n) for n in d.V)
    print(f"{'module':<{width}}  K  heldout  S")
    for n in d.V:
        h = stats["heldout"][n]
        sv = " ".join(f"{x:.3g}" for x in d.S[n].tolist())
        print(f"{n:<{width}}  {d.V[n].shape[0]}  {'n/a' if h is None else f'{h:.2f}':>7}  {sv}")
    scores = [h for h in stats["heldout"].values() if h is not None]
    if scores:
        print(f"held-out score (v1, mean over {len(scores)} modules): {sum(scores) / len(scores):.3f}")
    if shared := stats.get("heldout_shared_prompts", 0):  # absent from files written before it existed
        print(f"note: {shared} of the {s.n_heldout} held-out pairs share a prompt with fit pairs, so the "
              f"held-out score is optimistic; make --n-heldout a multiple of --per-problem")
    if opts.k_use is not None or opts.drop_bottom_frac > 0:
        V_used, report = postprocess(d.V, d.S, opts.k_use, opts.drop_bottom_frac)
        print(f"post-processing (k_use={opts.k_use}, drop_bottom_frac={opts.drop_bottom_frac}): "
              f"{report['kept_rows']} rows kept in {len(V_used)} modules; threshold={report['threshold']}; "
              f"dropped rows {sum(report['dropped_rows'].values())}; "
              f"dropped modules {report['dropped_modules']}")
    return 0
