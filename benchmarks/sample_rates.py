"""Sampled hack / solve / format rates of a run's knobs on a fixed draw: the same problems, samples per
problem, temperature and seed for every knob file, so that two checkpoints (or zero knobs) compare on equal
terms.

Usage: PYTHONPATH=src python benchmarks/sample_rates.py RUN_DIR [--ckpt ckpt-000060 | --zero] [--set train]
                                                        [--problems 0] [--n 8] [--seed 0]
Reads RUN_DIR/config.json (model, environment, rollout.temperature / top_p / max_new_tokens), starts the
knobs from the checkpoint's knobs.safetensors (model.init_knobs) or at zero, samples through
sample.sample_and_grade with the deployed view (quarantine zeroed, knobs merged), prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib

import torch

from projected_grpo import config as C
from projected_grpo.run import setup
from projected_grpo.run.row import rates
from projected_grpo.sampling.sample import sample_and_grade


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--ckpt", default="", help="checkpoint directory name in RUN_DIR (default: the latest)")
    ap.add_argument("--zero", action="store_true", help="zero knobs: the base model")
    ap.add_argument("--set", default="train", help="problem set of the environment")
    ap.add_argument("--problems", type=int, default=0, help="first N problems of the set (0 = all)")
    ap.add_argument("--n", type=int, default=8, help="samples per problem")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_dir = pathlib.Path(args.run_dir)
    cfg = C.Config.from_json(str(run_dir / "config.json"))
    ckpt = "zero" if args.zero else args.ckpt or (run_dir / "latest").read_text().strip()
    knobs_file = "" if args.zero else str(run_dir / ckpt / "knobs.safetensors")
    cfg = C.replace(cfg, model={"init_knobs": knobs_file}, dpo={"before": False})
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with contextlib.closing(setup.make_env(cfg)) as env:
        problems = env.problem_sets()[args.set]
        problems = problems[:args.problems] if args.problems else problems
        prompt_ids = {i: ids for i, (_, ids) in setup.prompt_table(env, tok, problems).items()}
        with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
            got = sample_and_grade(model, tok, env, problems, prompt_ids, args.n,
                                   max_new_tokens=cfg.rollout.max_new_tokens,
                                   temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                   seed=args.seed)
    out = rates([s.grade for s in got], "sampled") | {"run_dir": str(run_dir), "knobs": ckpt,
                                                      "set": args.set, "problems": len(problems), "n": args.n,
                                                      "seed": args.seed}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
