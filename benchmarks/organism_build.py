"""The organism's warm-up on one torch thread against two: speed and whether the weights are the same bytes.

Builds the default organism's inputs as `build_organism` does (tokenizer, initial model, warm-up examples),
then runs the first --steps warm-up steps (the build's optimizer, schedule and batches; warmup.py) on each
thread count in --threads, side by side in this one process, and compares the weights they end at to the bit.
The order of the sides alternates over --rounds; the figure is each side's median seconds per step. Run it
on an idle machine: a second thread on a busy core stalls the warm-up (build.auto_threads).

    PYTHONPATH=src .venv/bin/python benchmarks/organism_build.py [--steps 40] [--rounds 2] [--threads 1 2]

The whole build is `projected-grpo build-organism --rebuild --samples 0 --threads N`, whose last line says
whether it equals the shipped weights byte for byte.

Last line: `RESULT s_per_step_<n>=<median> ... speedup=<first / last> bitwise_equal=<True|False>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from projected_grpo.organism.build import OrganismConfig, _with_extras, seeded_warmup, warmup_inputs
from projected_grpo.organism.warmup import builtin_corpus, held_out_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()

    cfg = OrganismConfig()
    corpus = builtin_corpus().base
    held_out = held_out_ids(corpus, cfg.holdout_per_mode)
    full = _with_extras(cfg, corpus, held_out)
    times: dict[int, list[float]] = {n: [] for n in args.threads}
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(args.rounds):
        for n in (args.threads if r % 2 == 0 else args.threads[::-1]):
            tok, model, examples = warmup_inputs(cfg, full, held_out)  # a fresh model (tokenizer cached)
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            seeded_warmup(cfg, model, examples, tok.pad_token_id, steps=args.steps)  # as build_organism
            times[n].append((time.perf_counter() - t0) / args.steps)
            print(f"round {r}: {n} thread(s) {times[n][-1]:.3f} s/step", flush=True)
            weights[n] = {k: v.clone() for k, v in model.state_dict().items()}
    first = weights[args.threads[0]]
    equal = all(torch.equal(first[k], w[k]) for w in weights.values() for k in first)
    med = {n: statistics.median(t) for n, t in times.items()}
    cols = " ".join(f"s_per_step_{n}={m:.3f}" for n, m in med.items())
    print(f"RESULT {cols} speedup={med[args.threads[0]] / med[args.threads[-1]]:.2f} bitwise_equal={equal}")


if __name__ == "__main__":
    main()
