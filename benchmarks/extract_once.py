"""V_hack of every control of one seed: one extraction per control (as each run did) against one pass.

Loads a preset's model and V_hack pairs as `extract-direction` does, then times, side by side in this one
process, (a) `direction.extract` once per setting (the real V and each --controls entry: what a study's runs
paid when each extracted its own V) and (b) one `direction.extract_many` over the same settings (what a
study pays now, once per seed), and (c) a `random` control drawn from the real V (`random_from_real`, no
gradients). Sides alternate over --rounds; the figure is each side's median. Every V of (b) and (c) is
checked equal, to the bit, to its own extraction in (a).

    PYTHONPATH=src .venv/bin/python benchmarks/extract_once.py --preset demo [--controls random shuffled
        nonhack within energy] [--rounds 2] [--pairs-per-problem 2]

Last line: `RESULT separate_s=<(a)> once_s=<(b)> speedup=<(a)/(b)> random_from_real_s=<(c)> settings=<n>
bitwise_equal=<True|False>`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from projected_grpo import config as C
from projected_grpo import presets
from projected_grpo.hack import direction
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.run import setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--controls", nargs="*", default=["random", "shuffled", "nonhack", "within", "energy"])
    ap.add_argument("--pairs-per-problem", type=int, default=2, help="2: every control can be built")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = C.replace(presets.PRESETS[args.preset], proj={"pairs_per_problem": args.pairs_per_problem})
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with contextlib.closing(setup.make_env(cfg)) as env:
        pairs = hack_resolve.v_pairs(cfg, env, env.problem_sets()["train"])
    real = hack_resolve.extract_settings(cfg)
    settings = [real, *(direction.control_settings(real, c, cfg.run.seed) for c in args.controls)]
    times: dict[str, list[float]] = {"separate": [], "once": [], "random_from_real": []}
    equal = True
    with hack_resolve.at_zero(knobs):
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            own = [direction.extract(model, knobs, tok, pairs, s).direction for s in settings]
            times["separate"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            many = [e.direction for e in direction.extract_many(model, knobs, tok, pairs, settings)]
            times["once"].append(time.perf_counter() - t0)
            r = direction.control_settings(real, "random", cfg.run.seed)
            t0 = time.perf_counter()
            drawn = direction.random_from_real(own[0], r, knobs, tok, pairs)
            times["random_from_real"].append(time.perf_counter() - t0)
            for a, b in [*zip(own, many), (direction.extract(model, knobs, tok, pairs, r).direction, drawn)]:
                equal &= a.meta == b.meta and all(torch.equal(a.V[n], b.V[n]) and torch.equal(a.S[n], b.S[n])
                                                  for n in a.V)
    med = {k: statistics.median(v) for k, v in times.items()}
    names = ", ".join(s.control for s in settings)
    print(f"{args.preset}: {len(pairs)} pairs, {len(settings)} settings ({names}), {args.rounds} rounds, "
          f"{args.threads} thread(s); seconds per round: "
          + "; ".join(f"{k} {', '.join(f'{x:.2f}' for x in v)}" for k, v in times.items()))
    print(f"RESULT separate_s={med['separate']:.2f} once_s={med['once']:.2f} "
          f"speedup={med['separate'] / med['once']:.2f} random_from_real_s={med['random_from_real']:.4f} "
          f"settings={len(settings)} bitwise_equal={equal}")


if __name__ == "__main__":
    main()
