"""What padding costs and skipping it saves: rollout.retire (sampling) and rollout.buckets (scoring).

In one process, on a preset's model, knobs and sampling settings (rollout.sample_dtype, share_prefix, its
group size and token limit), for batches of the environment's first training prompts, alternately (the
order flipped every batch, so load falls on all sides alike), CPU time of:
  sampling  `generate` with finished rows decoded to the end (retire off) and retired (on);
  scoring   the training step's forward + backward (prefix-shared, knob gradients split by source, a
            REINFORCE-shaped loss with advantages +-1) on the retired side's samples, all completions in one
            forward (buckets 1) and in up to --buckets like-length forwards.
The untrained model writes long answers; a trained one often stops early, and how early decides the gain, so
`--stop-at-newline` also ends a row at its first newline token (an emulation of shorter answers, not the
environment's stop rule). It also counts the rows sampled bit-equal both ways (the same uniforms are drawn
either way: rows differ only where a kernel rounds a row differently in a smaller batch) and the largest
difference between the two scorings' log-probs.

    PYTHONPATH=src .venv/bin/python benchmarks/ragged.py [--preset smollm2-math-cpu] [--model smollm2]
        [--rounds 2] [--batches 4] [--buckets 4] [--stop-at-newline]   (`--section.field VALUE` as anywhere)

Last line: `RESULT sample_speedup=<off / on> score_speedup=<1 bucket / k> mean_len=<tokens> max_len=<tokens>
rows_equal=<k>/<n>` (medians of CPU seconds per batch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from projected_grpo import presets
from projected_grpo.run import setup
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.prefix import scoring
from projected_grpo.sampling.sample import SAMPLE_DTYPES, concrete_dtype


def score_step(model, knobs, score, pad_id: int, prompts: list, completions: list) -> torch.Tensor:
    """The training step's scoring forward and backward on these rows; returns the detached log-probs."""
    student = torch.ones(len(completions), dtype=torch.bool)
    batch = score.pack(prompts, completions, pad_id, student)
    adv = torch.tensor([1.0, -1.0] * (len(completions) // 2) + [1.0] * (len(completions) % 2))
    for p in knobs.parameters():
        p.grad = None
    with knobs.capture(student) as cap:
        logp, _ = score.logprobs(model, batch, temperature=1.0, with_entropy=True, capture=cap)
        (-(adv * logp.sum(1)).sum()).backward()
    return logp.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-math-cpu")
    ap.add_argument("--model", default="smollm2", help="a model directory ('' for the preset's own source)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=4, help="batches of prompts_per_step prompts per round")
    ap.add_argument("--buckets", type=int, default=4, help="the scoring side's rollout.buckets")
    ap.add_argument("--stop-at-newline", action="store_true", help="also end a row at its first newline")
    opt, overrides = ap.parse_known_args()
    model_arg = ["--model", opt.model] if opt.model else []
    cfg, _ = presets.parse(["--preset", opt.preset, *model_arg, *overrides], prog="ragged")
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    torch.manual_seed(0)
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with torch.no_grad():  # knobs away from zero, as after a step
        for p in knobs.parameters():
            p.normal_(0.0, 1e-3)
    env = setup.make_env(cfg)
    B, G = cfg.rollout.prompts_per_step, cfg.rollout.G_s
    problems = env.problem_sets()["train"][:B * opt.batches]
    table = setup.prompt_table(env, tok, problems)
    eos = [tok.eos_token_id] + (tok.encode("\n", add_special_tokens=False) if opt.stop_at_newline else [])
    dtype = SAMPLE_DTYPES[concrete_dtype(cfg.rollout.sample_dtype, cfg.model.device)]
    scores = {1: scoring(model, True, 1), opt.buckets: scoring(model, True, opt.buckets)}
    print(f"{opt.preset}: {len(problems)} prompts in batches of {B} x {G} samples x "
          f"{cfg.rollout.max_new_tokens} tokens, sample dtype {dtype or 'the model'}, stop ids {eos}, "
          f"scoring {scores[opt.buckets].name} in 1 or {opt.buckets} buckets, {torch.get_num_threads()} "
          "thread(s)", flush=True)
    secs: dict[str, list[float]] = {"off": [], "on": [], "one": [], "buckets": []}
    lens, equal, rows, diff = [], 0, 0, 0.0
    for r in range(opt.rounds):
        for b in range(opt.batches):
            ids = [table[p.id][1] for p in problems[b * B:(b + 1) * B]]
            flip = (r + b) % 2 == 1
            out = {}
            for retire in (True, False) if flip else (False, True):
                t0 = time.process_time()
                with torch.no_grad(), knobs.merged():
                    out[retire] = generate(model, ids, G, max_new_tokens=cfg.rollout.max_new_tokens,
                                           temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                           seed=1000 * r + b, eos_id=eos, pad_id=tok.pad_token_id,
                                           share_prefill=cfg.rollout.share_prefix, sample_dtype=dtype,
                                           retire=retire)
                secs["on" if retire else "off"].append(time.process_time() - t0)
            got = out[True]
            logp = {}
            for k in (opt.buckets, 1) if flip else (1, opt.buckets):
                t0 = time.process_time()
                logp[k] = score_step(model, knobs, scores[k], tok.pad_token_id, got.prompt_ids,
                                     got.completion_ids)
                secs["one" if k == 1 else "buckets"].append(time.process_time() - t0)
            diff = max(diff, float((logp[1] - logp[opt.buckets]).abs().max()))
            lens += [len(c) for c in got.completion_ids]
            equal += sum(torch.equal(a, c) and torch.equal(x, y) for a, c, x, y in
                         zip(out[False].completion_ids, got.completion_ids, out[False].logp, got.logp))
            rows += len(got.completion_ids)
        last = {k: statistics.median(v[-opt.batches:]) for k, v in secs.items()}
        print(f"round {r}: sampling off {last['off']:.3f} / on {last['on']:.3f} s, scoring 1 bucket "
              f"{last['one']:.3f} / {opt.buckets} {last['buckets']:.3f} s per batch (CPU)", flush=True)
    med = {k: statistics.median(v) for k, v in secs.items()}
    print(f"largest |logp difference| between the scorings: {diff:.2e}")
    print(f"RESULT sample_speedup={med['off'] / med['on']:.3f} "
          f"score_speedup={med['one'] / med['buckets']:.3f} mean_len={sum(lens) / len(lens):.1f} "
          f"max_len={max(lens)} rows_equal={equal}/{rows}")


if __name__ == "__main__":
    main()
