"""A tiny arithmetic model, for measuring RL on `--env.name maths --env.problems arithmetic` until the maths
organism is built in: the organism's tokenizer recipe and Llama shape, warmed up (completion-only NLL,
organism/warmup.py) on the maths environment's hand-written completions of its warm-up problems (levels
1-3), two clean for one buggy per problem, so that at T = 1 it answers in the `#### n` format and is right
part of the time. Written as a Hugging Face directory that `--model DIR` loads.

Usage: PYTHONPATH=src python benchmarks/arith_model.py OUT_DIR [--steps 400] [--problems 600]
Then:  projected-grpo train --model OUT_DIR --env.name maths --env.problems arithmetic ...
"""

from __future__ import annotations

import argparse
import pathlib
import random

import torch

from projected_grpo.envs.maths.env import MathEnv
from projected_grpo.organism.build import build_tokenizer, tiny_model
from projected_grpo.organism.warmup import WarmupExample, warmup
from projected_grpo.sampling.pack import encode_completion, encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--problems", type=int, default=600)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (run.threads' note)
    env = MathEnv(problems="arithmetic", modes=("strict",))
    problems = env.problem_sets()["warmup"][:args.problems]
    rng = random.Random(0)
    pairs = []
    for p in problems:  # two clean completions for one buggy: right about 2/3 of the time at best
        clean, buggy = env.templates(p, "clean"), env.templates(p, "buggy")
        pairs += [(p, rng.choice(clean), "clean"), (p, rng.choice(clean), "clean"),
                  (p, rng.choice(buggy), "buggy")]
    texts = [m["content"] for p in problems for m in env.messages(p)] + [t for _, t, _ in pairs]
    tok = build_tokenizer(texts, vocab_size=512)
    model = tiny_model(tok, hidden=64, layers=2, heads=2, seed=0)
    examples = [WarmupExample(tuple(encode_prompt(tok, env.messages(p))), tuple(encode_completion(tok, t)),
                              kind, p.id) for p, t, kind in pairs]
    warmup(model, examples, steps=args.steps, batch_size=16, lr=3e-3, weight_decay=0.0, seed=0,
           pad_id=tok.pad_token_id, log=print)
    out = pathlib.Path(args.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
