"""Named presets (configs, not code paths) and every command's argv -> (Config, options).

smoke: seconds on a CPU. demo: the embedded organism, calibrated (docs/findings.md). fast / full: the original
study's Qwen3-4B settings (model from --model). smollm2-cpu / smollm2-gpu / smollm2-math-cpu:
SmolLM2-135M-Instruct (`--model smollm2` after `projected-grpo get-model smollm2`). `parse` reads a command
line in two tyro passes: the command's options (a dataclass extending `Base`: --preset, --config, --model,
...), then every Config field as `--section.field VALUE` on top of the chosen preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from projected_grpo.config import (
    Config,
    EnvCfg,
    LossCfg,
    ModelCfg,
    OptimCfg,
    PoolCfg,
    ProjCfg,
    RolloutCfg,
    RunCfg,
    replace,
    resolve_auto,
)
from projected_grpo.errors import UserError

# --- presets: named values, not code paths ---------------------------------------------------------

# Seconds on a CPU: 12 problems (2 per mode), a 2-prompt x 4-sample group, 4 steps.
SMOKE = Config(env=EnvCfg(max_problems=12), pool=PoolCfg(n_hack=1, n_clean=1),
               proj=ProjCfg(pairs_per_problem=1))

# The embedded organism (organism/build.py's OrganismConfig) on all six loophole modes. Pure student GRPO
# (mix 0): teacher rows in the groups made the positive control fail (docs/findings.md 7); the pool still
# supplies V_hack's (hack, clean) pairs. 300 steps: the budget at which every mode's hack rate rises under
# `none`, chosen by a rule written down before the run (findings 1.7). Wall time: docs/benchmarks.md.
DEMO = Config(
    model=ModelCfg(source="organism"),
    rollout=RolloutCfg(prompts_per_step=4, group_size=8, mix=0.0, max_new_tokens=128),
    pool=PoolCfg(n_hack=2, n_clean=1, n_buggy=1),
    optim=OptimCfg(lr=0.1, betas=(0.9, 0.99), warmup_steps=3),
    run=RunCfg(steps=300, checkpoint_every=50),
)

# The demo as first calibrated (findings sections 1-6): half of each group from the teacher pool (2 hack,
# 1 clean, 1 buggy template rows per problem, advantage-weighted imitation), 100 steps.
DEMO_POOL = replace(DEMO, rollout={"mix": 0.5}, run={"steps": 100, "checkpoint_every": 25})

# The maths organism (organism/maths.py) trained honestly: the strict verifier, the arithmetic curriculum
# (level-1 problems for the first 10 steps, then level 2), greedy held-out accuracy on 200 level-2 problems
# every 10 steps. LoRA knobs at lr 0.01 with 16 prompts per step and 1000 train problems: the calibration
# that kept every seed rising (the probes: docs/findings.md 3.1).
MATH_DEMO = Config(
    model=ModelCfg(source="organism", knob="lora"),
    env=EnvCfg(name="maths", problems="arithmetic", modes=("strict",), curriculum_steps=10, eval_size=200,
               max_problems=1000, warmup_levels=(1,), train_levels=(2,)),
    rollout=RolloutCfg(prompts_per_step=16, group_size=8, mix=0.0, max_new_tokens=24),
    proj=ProjCfg(pairs_per_problem=1),
    optim=OptimCfg(lr=0.01, betas=(0.9, 0.99), warmup_steps=2),
    run=RunCfg(steps=300, checkpoint_every=100, eval_every=10),
)

# The original rl-rewardhacking study's Qwen3-4B settings; model from --model. As the study
# has them: gradient clip norm 10 and a cosine that decays to 0 in both; `full` mixes half its
# group from the teacher pool and uses AdamW's default betas (0.9, 0.99 as the study writes them).
FAST = Config(
    model=ModelCfg(source="hf", dtype="bfloat16", device="cuda"),
    rollout=RolloutCfg(prompts_per_step=4, group_size=8, mix=0.125, max_new_tokens=512, micro_prompts=1),
    pool=PoolCfg(n_hack=2, n_clean=2),
    optim=OptimCfg(lr=3e-3, betas=(0.5, 0.9), warmup_steps=3, clip_norm=10.0, min_lr_frac=0.0),
    run=RunCfg(steps=60, checkpoint_every=20),
)

FULL = Config(
    model=ModelCfg(source="hf", dtype="bfloat16", device="cuda"),
    rollout=RolloutCfg(prompts_per_step=43, group_size=6, mix=0.5, max_new_tokens=1024, micro_prompts=1),
    loss=LossCfg(beta=1e-3),
    pool=PoolCfg(n_hack=2, n_clean=2),
    optim=OptimCfg(lr=1e-3, betas=(0.9, 0.99), warmup_steps=10, clip_norm=10.0, min_lr_frac=0.0),
    run=RunCfg(steps=200, checkpoint_every=25),
)

# SmolLM2-135M-Instruct (`projected-grpo get-model smollm2`; its ChatML template formats every prompt) on
# the code loophole environment. CPU: a smoke of the mechanics on a real model, one problem per loophole
# mode, one group of 3 students + 1 teacher row per step. Students sampled through the packed forward, its
# projections, attention, RMSNorm and rotary in sampling/gemv.py's kernels (rollout.sample_dtype auto): from
# bf16 weights where the CPU has bf16 units (AVX-512 or AMX; sample/kl ~1e-3, the ratio bf16 leaves
# uncorrected), else from fp32 ones (sample/kl ~1e-10, fp32 rounding; sampling at 0.63 of the machine's
# roofline against 0.19 for the model's own forward on an AVX2 CPU). Before 2026-11-28 fp32 on every CPU:
# `--rollout.sample-dtype float32` reruns those runs. Step 13.7 s on one thread of a 2-core AVX2 CPU, of which
# sampling 3.5 s; 8.3 s with `--run.threads 2` on both cores, idle otherwise; on a 2-core AVX-512 CPU with
# bf16 units 12.1 s and 7.1 s (sampling 2.0 s) against fp32's 12.3 and 8.6 (docs/benchmarks.md [58]).
SMOLLM2_CPU = Config(
    model=ModelCfg(source="hf", path="smollm2"),
    env=EnvCfg(max_problems=6),
    rollout=RolloutCfg(prompts_per_step=1, group_size=4, mix=0.25, max_new_tokens=96, sample_dtype="auto"),
    pool=PoolCfg(n_hack=1, n_clean=1),
    proj=ProjCfg(pairs_per_problem=1),
    run=RunCfg(steps=3, checkpoint_every=3),
)

# GPU: all 48 built-in problems, FAST's group shape and optimiser (uncalibrated for SmolLM2: a starting
# point), float32 (135M parameters: 0.5 GB; knobs and weights in one dtype, exact merges).
SMOLLM2_GPU = Config(
    model=ModelCfg(source="hf", path="smollm2", device="cuda"),
    rollout=RolloutCfg(prompts_per_step=8, group_size=8, mix=0.125, max_new_tokens=256),
    pool=PoolCfg(n_hack=2, n_clean=2),
    optim=OptimCfg(lr=3e-3, betas=(0.5, 0.9), warmup_steps=3),
    run=RunCfg(steps=60, checkpoint_every=20, threads=0),
)

# SmolLM2-135M-Instruct trained honestly on arithmetic (maths environment, strict verifier), sized for a real
# experiment on a CPU: 4 prompts x a group of 8 per step, answers within 32 tokens, the students sampled
# from bf16 weights where the CPU has bf16 kernels (AVX-512 or AMX), else from packed fp32 ones
# (rollout.sample_dtype auto, sampling/packed.py: bf16 without those kernels: 2.4x the step; sample/kl
# logs the ratio that bf16 leaves uncorrected). Padding costs nothing it need not: finished rows leave the
# decode batch (rollout.retire: sampling 1.05-1.34x faster) and the training forward runs the completions in
# like-length buckets (rollout.buckets: 1.10-1.28x), more as answers shorten. Before 2026-11-27 this preset
# sampled bf16 on every CPU and padded both: `--rollout.sample-dtype bfloat16 --rollout.no-retire
# --rollout.buckets 1` reruns those runs as they ran.
# SVD knobs of rank 16 (low-rank: trained unmerged, no W_eff held; 3360 knob values, so V_hack's per-pair
# gradients stay small: LoRA r16's are 2.5M per pair), held-out accuracy on 50 problems of the training
# levels every 10 steps. Levels 1-2 and lr 0.1 are where the honest reward trains it (docs/findings.md
# 8.7-8.9: on level 3 almost no sample is solved; at lr 3e-3 the knobs barely move SmolLM2's singular values).
# Step time, untrained (answers near 32 tokens; shorter answers later make steps ~1.4x faster): 11.4 s on one
# thread of a 2-core AVX2 CPU, 6.7 s with `--run.threads 2` on both (idle otherwise); on a 2-core AVX-512 CPU
# with bf16 units ~10 s on one thread (sampling 3.8 s), ~8.6 s on two. Sampling at 0.68 of the machine's
# roofline in fp32 (AVX2), 0.45 of bf16's (AVX-512: 1.85x fp32's tokens/s there) (docs/benchmarks.md).
SMOLLM2_MATH_CPU = Config(
    model=ModelCfg(source="hf", path="smollm2", knob="svd", rank=16),
    env=EnvCfg(name="maths", problems="arithmetic", modes=("strict",), curriculum_steps=10, eval_size=50,
               max_problems=200, warmup_levels=(1, 2), train_levels=(1, 2)),
    rollout=RolloutCfg(prompts_per_step=4, group_size=8, mix=0.0, max_new_tokens=32, sample_dtype="auto",
                       retire=True, buckets=4),
    proj=ProjCfg(pairs_per_problem=1),
    optim=OptimCfg(lr=0.1, betas=(0.9, 0.99), warmup_steps=3),
    run=RunCfg(steps=200, checkpoint_every=25, eval_every=10),
)

PRESETS: dict[str, Config] = {"smoke": SMOKE, "demo": DEMO, "demo-pool": DEMO_POOL, "fast": FAST,
                              "full": FULL, "smollm2-cpu": SMOLLM2_CPU, "smollm2-gpu": SMOLLM2_GPU,
                              "math-demo": MATH_DEMO, "smollm2-math-cpu": SMOLLM2_MATH_CPU}


# --- argv: every command -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Base:
    """Where a command's Config starts. Any `--section.field VALUE` after these options changes one field of
    it (every field is listed by `--help`)."""

    preset: str = "smoke"
    """named preset to start from: smoke, demo, fast, full, smollm2-cpu, smollm2-gpu, smollm2-math-cpu,
    math-demo (presets.PRESETS)"""
    config: str = ""
    """a config JSON file to start from instead of a preset (e.g. a run's config.json)"""
    model: str = ""
    """a Hugging Face model directory (sets model.source=hf and model.path)"""


@dataclass(frozen=True, kw_only=True)
class TrainOpts(Base):
    """projected-grpo train: one GRPO run."""

    arm: str = ""
    """projection arm: none, erase, route, erase_bounded (sets proj.arm)"""
    run_dir: str = ""
    """run directory (sets run.dir)"""
    resume: bool = False
    """continue the run in --run-dir from its latest checkpoint (sets run.resume)"""


def parse(argv: list[str], prog: str, opts_cls: type[Base] = TrainOpts, forbid: tuple[str, ...] = ()):
    """(Config, options) from argv: the command's options (`opts_cls`), then tyro overrides of any Config
    field on top of the preset (or --config file). `forbid`: Config flags the command sets itself (refused).
    Bad values raise UserError naming the flag; --help prints the options, then every Config field."""
    import tyro

    if "-h" in argv or "--help" in argv:
        try:
            tyro.cli(opts_cls, args=["--help"], prog=prog)
        except SystemExit:
            pass
        print("\nConfig fields (on top of the preset; the defaults shown are the smoke preset's):")
        tyro.cli(Config, default=SMOKE, args=["--help"], prog=prog)
    opts, rest = tyro.cli(opts_cls, args=argv, prog=prog, return_unknown_args=True)
    if bad := [a for a in rest if a.partition("=")[0] in forbid]:
        raise UserError(f"{prog}: {bad}: set by the command itself, not an option here")
    if opts.preset not in PRESETS:
        raise UserError(f"--preset {opts.preset!r} is not one of {list(PRESETS)}")
    cfg = Config.from_json(opts.config) if opts.config else PRESETS[opts.preset]
    sections: dict[str, dict] = {}
    if opts.model:
        sections["model"] = {"source": "hf", "path": opts.model}
    for flag, (section, field_) in (("arm", ("proj", "arm")), ("run_dir", ("run", "dir")),
                                    ("resume", ("run", "resume"))):
        if getattr(opts, flag, None):
            sections.setdefault(section, {})[field_] = getattr(opts, flag)
    try:
        cfg = replace(cfg, **sections)
    except ValueError as e:
        raise UserError(str(e)) from e
    return resolve_auto(tyro.cli(Config, default=cfg, args=rest, prog=prog)), opts
