"""Retiring finished rows from the decode batch (rollout.retire) against decoding every row to the end.

In one process, on a preset's model and sampling settings (rollout.sample_dtype, share_prefix, the preset's
group size and token limit), `generate` is called on the same batches of the environment's first training
prompts with retire off and on, alternately (the order flipped every round, so load falls on both alike),
and the CPU time of each call is taken. The untrained model writes long answers; a trained one often stops
early, and how early decides the gain, so `--stop-at-newline` also ends a row at its first newline token
(an emulation of shorter answers, not the environment's stop rule). It also counts the rows that came out
bit-equal both ways (the same uniforms are drawn either way: rows differ only where a kernel rounds a row
differently in a smaller batch).

    PYTHONPATH=src .venv/bin/python benchmarks/retire.py [--preset smollm2-math-cpu] [--model smollm2]
        [--rounds 2] [--batches 4] [--stop-at-newline]   (any `--section.field VALUE` changes the preset)

Last line: `RESULT speedup=<off / on, medians> mean_len=<tokens> max_len=<tokens> rows_equal=<k>/<n>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from projected_grpo import presets
from projected_grpo.run import setup
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.sample import SAMPLE_DTYPES, concrete_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-math-cpu")
    ap.add_argument("--model", default="smollm2", help="a model directory ('' for the preset's own source)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=4, help="batches of prompts_per_step prompts per round")
    ap.add_argument("--stop-at-newline", action="store_true", help="also end a row at its first newline")
    opt, overrides = ap.parse_known_args()
    model_arg = ["--model", opt.model] if opt.model else []
    cfg, _ = presets.parse(["--preset", opt.preset, *model_arg, *overrides], prog="retire")
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    model, tok = setup.load_model(cfg)
    env = setup.make_env(cfg)
    B, G = cfg.rollout.prompts_per_step, cfg.rollout.G_s
    problems = env.problem_sets()["train"][:B * opt.batches]
    table = setup.prompt_table(env, tok, problems)
    eos = [tok.eos_token_id] + (tok.encode("\n", add_special_tokens=False) if opt.stop_at_newline else [])
    dtype = SAMPLE_DTYPES[concrete_dtype(cfg.rollout.sample_dtype, cfg.model.device)]
    print(f"{opt.preset}: {len(problems)} prompts in batches of {B} x {G} samples x "
          f"{cfg.rollout.max_new_tokens} tokens, sample dtype {dtype or 'the model'}, stop ids {eos}, "
          f"{torch.get_num_threads()} thread(s)", flush=True)
    secs: dict[bool, list[float]] = {False: [], True: []}
    lens, equal, rows = [], 0, 0
    for r in range(opt.rounds):
        for b in range(opt.batches):
            ids = [table[p.id][1] for p in problems[b * B:(b + 1) * B]]
            out = {}
            for retire in (False, True) if (r + b) % 2 == 0 else (True, False):
                t0 = time.process_time()
                out[retire] = generate(model, ids, G, max_new_tokens=cfg.rollout.max_new_tokens,
                                       temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                       seed=1000 * r + b, eos_id=eos, pad_id=tok.pad_token_id,
                                       share_prefill=cfg.rollout.share_prefix, sample_dtype=dtype,
                                       retire=retire)
                secs[retire].append(time.process_time() - t0)
            off, on = out[False], out[True]
            lens += [len(c) for c in on.completion_ids]
            equal += sum(torch.equal(a, c) and torch.equal(x, y) for a, c, x, y in
                         zip(off.completion_ids, on.completion_ids, off.logp, on.logp))
            rows += len(on.completion_ids)
        print(f"round {r}: off {statistics.median(secs[False][-opt.batches:]):.3f} s, on "
              f"{statistics.median(secs[True][-opt.batches:]):.3f} s per batch (CPU)", flush=True)
    off_s, on_s = statistics.median(secs[False]), statistics.median(secs[True])
    print(f"RESULT speedup={off_s / on_s:.3f} mean_len={sum(lens) / len(lens):.1f} max_len={max(lens)} "
          f"rows_equal={equal}/{rows}")


if __name__ == "__main__":
    main()
