"""`projected-grpo build-organism`: build (or find in the cache, or install from the package) the embedded
organism and print its sampled rates (organism/checks.py). The build itself is organism/build.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time

import torch
import tyro

from projected_grpo.organism import shipped
from projected_grpo.organism.build import (
    OrganismConfig,
    auto_threads,
    build_organism,
    builtin_corpus,
    load_organism,
)
from projected_grpo.organism.checks import format_checks, organism_checks
from projected_grpo.store import write_text_atomic


@dataclasses.dataclass(frozen=True)
class BuildOpts:
    """projected-grpo build-organism: build (or load from the cache) the organism and print its checks."""

    organism: tyro.conf.OmitArgPrefixes[OrganismConfig] = OrganismConfig()
    """what to build (every field enters the cache key)"""
    out: str = ""
    """also copy the built model directory here ("" = leave it only in the cache)"""
    cache_dir: str = ""
    """cache root ("" = $PROJECTED_GRPO_CACHE, else ~/.cache/projected_grpo)"""
    samples: int = 8
    """samples per warm-up problem for the checks at T = 1 (0 skips the checks)"""
    held_out_samples: int = 128
    """samples per held-out problem for the checks (their solve rate is about 1%: 8 would often read 0)"""
    max_new_tokens: int = 128
    """token budget per sampled completion in the checks (the demo preset's)"""
    threads: int = 0
    """torch CPU threads for the warm-up (0 = every core the load average leaves idle: build.auto_threads)"""
    rebuild: bool = False
    """train from scratch even when the package ships this organism, and say whether the result equals the
    shipped weights (into <cache>/organism/<key>-rebuilt)"""
    ship: bool = False
    """maintainers: copy the organism into the package's shipped folder (organism/shipped/<key>/)"""


def main(argv: list[str]) -> int:
    """Entry point of `projected-grpo build-organism`."""
    opts = tyro.cli(BuildOpts, args=argv, prog="projected-grpo build-organism")
    threads = opts.threads or auto_threads()  # once: the build and the checks run on the same count
    torch.set_num_threads(threads)
    cache_dir = opts.cache_dir or None
    path = build_organism(opts.organism, cache_dir=cache_dir, threads=threads, rebuild=opts.rebuild)
    if opts.ship:
        print(f"organism: shipped to {shipped.ship(path, path.name.removesuffix('-rebuilt'))}")
    if opts.out:
        shutil.copytree(path, opts.out, dirs_exist_ok=True)
        print(f"organism: copied to {opts.out}")
    if opts.samples:
        from projected_grpo.envs.coding.env import CodeEnv
        from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS

        model, tokenizer, meta = load_organism(path)
        t0 = time.perf_counter()
        with contextlib.closing(CodeEnv(BUILTIN_PROBLEMS)) as env:
            checks = organism_checks(model, tokenizer, env, builtin_corpus(), frozenset(meta["held_out"]),
                                     n_samples=opts.samples, held_out_samples=opts.held_out_samples,
                                     max_new_tokens=opts.max_new_tokens,
                                     seed=opts.organism.seed)
        print(format_checks(checks))
        for pid, text in checks["examples"].items():
            print(f"--- sample for {pid}:\n{text}")
        write_text_atomic(path / "checks.json", json.dumps(checks, indent=1))
        print(f"checks: {time.perf_counter() - t0:.0f}s, written to {path / 'checks.json'}")
    return 0
