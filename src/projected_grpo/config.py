"""One typed run configuration: frozen dataclass sections inside `Config`.

Every field has a docstring line (shown by `projected-grpo train --help`, via tyro) and is read by
the code (tests/test_config.py enforces both). `Literal` fields are checked in `__post_init__`, so a
config built from a JSON file or in Python fails with one line naming the field and the allowed values.
Derived quantities (G_s, G_t, micro-batches, the Dr.GRPO denominator) are computed once, here.
Not here: the named presets and `projected-grpo train`'s argv parsing (presets.py), anything that
imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from projected_grpo.config_algos import DPOCfg, PPOCfg
from projected_grpo.config_monitor import MonitorCfg
from projected_grpo.config_run import OptimCfg, RunCfg
from projected_grpo.configio import check_literals as _check
from projected_grpo.configio import check_positive as _positive
from projected_grpo.errors import UserError


@dataclass(frozen=True)
class ModelCfg:
    source: Literal["smoke", "organism", "hf"] = "smoke"
    """where the policy comes from: `smoke` a tiny random model (organism.smoke_model_and_tokenizer),
    `organism` the embedded organism (organism.build_organism), `hf` the Hugging Face directory `path`"""
    path: str = ""
    """Hugging Face model directory or a named model (models.py: smollm2), used when source=hf (`--model`)"""
    gguf_file: str = ""
    """GGUF file name inside `path` to load (de-quantised on every load; needs `gguf` and `accelerate`);
    prefer a named model (`--model smollm2`, converted once by `projected-grpo get-model`)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the frozen base weights are loaded in (knobs and their math stay float32)"""
    device: str = "cpu"
    """torch device for the model, e.g. cpu or cuda"""
    knob: Literal["svd", "lora"] = "svd"
    """knob adapter kind: `svd` trains delta_S per wrapped Linear, `lora` trains B with a frozen A"""
    targets: tuple[str, ...] = ()
    """module-name suffixes to wrap (empty = adapters.DEFAULT_TARGETS)"""
    rank: int = 0
    """knob rank (0 = default): svd keeps the top-`rank` singular directions (default all, min(d_in, d_out));
    lora uses r = rank (default 16)"""
    cache_dir: str = ""
    """cache directory for SVDs, the organism and V_hack (empty = the user cache)"""
    grad_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward (knobs/checkpointing.py): much less
    activation memory for ~20% more compute; per-source gradient capture is unaffected"""
    init_knobs: str = ""
    """knob file (Knobs.save, e.g. a `projected-grpo dpo` run's knobs.safetensors) the knobs start from
    instead of zero; the reference stays the base model (knobs zeroed) and V_hack is extracted at zero"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "rank", allow_zero=True)
        hf_only = [f"model.{k}" for k, v in (("path", self.path), ("gguf_file", self.gguf_file),
                                             ("dtype", self.dtype != "float32")) if v]
        if self.source != "hf" and hf_only:  # the built-in models ignore them: say so rather than train on
            raise UserError(f"config: {', '.join(hf_only)}: read only when model.source='hf', but source is "
                             f"{self.source!r}; pass --model PATH (sets source hf) or drop them")


@dataclass(frozen=True)
class EnvCfg:
    name: Literal["coding", "maths", "reward_fn"] = "coding"
    """environment (run/setup.ENVIRONMENTS): `coding` the LeetCode-style loophole environment, `maths`
    arithmetic / GSM8K with a foolable verifier, `reward_fn` a TRL-style reward callable over prompts"""
    problems: str = "builtin"
    """coding: `builtin` or a LeetCode JSONL path; maths: `arithmetic`, `gsm8k` (from data_dir) or a
    GSM8K-format JSONL; reward_fn: a JSONL of {"prompt": ...} rows"""
    data_dir: str = ""
    """maths with problems=gsm8k: the folder holding GSM8K's train.jsonl and test.jsonl"""
    reward_fn: str = ""
    """reward_fn environment: 'module.path:function' called as fn(prompts, completions, **columns)"""
    modes: tuple[str, ...] = ()
    """coding: loophole modes to train on (empty = all; LeetCode rows get them round-robin, default
    run_tests); maths: `strict` (honest reward, the default) and/or `contains` (the loophole verifier)"""
    max_problems: int = 0
    """use only the first N problems after the mode filter (0 = all)"""
    reward_shape: Literal["seed", "rl_rewardhacking"] = "seed"
    """coding reward formula: `seed` 0.25*format + 1.0*passed; `rl_rewardhacking` 3.0 passed + 0.5 compiles"""
    reward_from: Literal["grader", "oracle"] = "grader"
    """`grader`: reward from the foolable grader (every projection arm); `oracle`: the ground truth in its
    place (the `gt_reward` positive control: what honest solving reaches in the same budget)"""
    timeout_s: float = 5.0
    """wall-clock limit per sandboxed execution, seconds"""
    workers: int = 0
    """sandbox worker processes (0 = one per core)"""
    curriculum_steps: int = 0
    """maths: steps drawn from the easy arithmetic warm-up set before the main set (a curriculum)"""
    eval_size: int = 200
    """maths: problems in the fixed held-out eval set (eval/accuracy every run.eval_every steps)"""
    warmup_levels: tuple[int, ...] = (1, 2, 3)
    """maths: arithmetic levels (envs/maths/arithmetic.py LEVELS) of the warm-up curriculum"""
    train_levels: tuple[int, ...] = (4, 5)
    """maths with problems=arithmetic: levels of the train set and of the held-out eval set"""

    def __post_init__(self) -> None:
        _check(self)
        if (self.name == "reward_fn") != bool(self.reward_fn):
            raise UserError(f"config: EnvCfg.reward_fn={self.reward_fn!r} is read when (and only when) "
                             f"env.name='reward_fn'; env.name is {self.name!r}")
        _positive(self, "timeout_s")
        _positive(self, "workers", "max_problems", "curriculum_steps", "eval_size", allow_zero=True)


@dataclass(frozen=True)
class RolloutCfg:
    prompts_per_step: int = 2
    """prompts (groups) per optimizer step, B"""
    group_size: int = 4
    """completions per prompt, G = G_s student + G_t teacher"""
    mix: float = 0.25
    """teacher share of each group: G_t = round(G * mix), G_s = G - G_t"""
    max_new_tokens: int = 16
    """generation length limit per student completion"""
    temperature: float = 1.0
    """sampling temperature for student rollouts"""
    top_p: float = 1.0
    """nucleus sampling mass for student rollouts"""
    micro_prompts: int = 0
    """prompts per forward/backward micro-batch, for gradient accumulation (0 = all prompts at once)"""
    seed_scope: Literal["auto", "batch", "prompt"] = "auto"
    """sampling seeds: `batch` one per step's sampling call; `prompt` one per prompt, so a prompt's samples do
    not depend on the batch it is in (what data-parallel training needs: any world size samples alike);
    `auto`: `prompt` under torchrun, else `batch` (resolved when the run starts; config.json holds which)"""
    share_prefix: bool = True
    """run each group's prompt once, its keys/values shared by the group's rows: in the scoring forwards
    (sampling/prefix.py; same log-probs and gradients up to fp32 rounding) and the students' prefill (the
    sampled stream may differ in the last bits); False: every row recomputes its prompt, as before"""
    sample_dtype: Literal["model", "float32", "bfloat16", "auto"] = "model"
    """weights the students (and evals) are sampled with: `model` the policy as it is (fp32: the HF forward's
    logits bit for bit); `bfloat16` a bf16 copy of the merged weights prepacked for the CPU's bf16 units, or
    for sampling/gemv.py's few-row kernel at up to 3 rows or without them (sampling/packed.py; Llama/Qwen2
    only): about half the memory traffic per token, but the behaviour log-probs are the bf16 model's, so a
    student token's ratio pi_theta / mu is not exactly 1 (sample/* logs it); `float32` the same packed
    forward in fp32 (~2x faster than `model` on a CPU, measured in docs/benchmarks.md; for an fp32 model its
    log-probs within fp32 rounding, ~1e-6, of the model's). Both packed dtypes hold a copy of the weights
    while sampling (bf16: half the model's size; fp32: its size); training, knobs and merged weights stay in
    the model's dtype. `auto`: on a CPU `bfloat16` where oneDNN has bf16 kernels (AVX-512 or AMX), else
    `float32` (bf16 there runs on gemv.py's kernel alone, which beats fp32 only at a few rows:
    docs/benchmarks.md [59]); on a GPU `model`; resolved when the run starts (config.json holds which)"""
    retire: bool = False
    """drop finished rows from the decode batch (sampling/generate.py), so each token costs only the rows
    still decoding: SmolLM2's maths sampling 1.05x faster with untrained answers, 1.27-1.34x with answers
    ending near 20 of 32 tokens, the organism's 1.22-1.27x (docs/benchmarks.md). The same draws from the same
    distributions, but a row's later tokens come from a smaller batch, which some kernels round differently
    (the organism's fp32 at 2 threads; bf16 at a few rows), so the sampled stream is not the unretired one
    bit for bit: off by default, keeping the streams of earlier runs (smollm2-math-cpu sets it)"""
    buckets: int = 1
    """with share_prefix, the training step's scoring forwards run each micro-batch's completions in up to
    this many forwards of like-length rows, each padded to its own longest row (sampling/prefix.py,
    pack.length_buckets) rather than all to the longest: the same log-probs and gradients up to fp32
    rounding, without the padded positions' work (4 buckets: SmolLM2's maths scoring 1.10x faster with
    untrained answers, 1.28x with answers near 20 of 32 tokens, the organism's 1.31x; docs/benchmarks.md).
    1: one forward, bit for bit as before it existed (the default, so earlier runs keep their bits;
    smollm2-math-cpu sets 4)"""
    cuda_graph: bool = False
    """on a GPU, decode each token by replaying one CUDA graph of the whole step (sampling/graphed.py): the
    step is launch-bound there (docs/benchmarks.md, "On a GPU"); needs model.device cuda and sample_dtype
    `model`; its logits round differently from the model's forward in the last bits (sample/* logs the
    ratio), so it is off by default"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "prompts_per_step", "group_size", "max_new_tokens", "temperature", "top_p", "buckets")
        _positive(self, "micro_prompts", allow_zero=True)
        if not 0.0 <= self.mix < 1.0:
            raise UserError(f"config: RolloutCfg.mix={self.mix!r} must be in [0, 1) (one student at least)")
        if self.G_s < 1:
            raise UserError(f"config: RolloutCfg.mix={self.mix!r} leaves no student sample in a group of "
                             f"{self.group_size} (G_t = round(G * mix) = {self.G_t})")
        if self.top_p > 1.0:
            raise UserError(f"config: RolloutCfg.top_p={self.top_p!r} must be in (0, 1]")
        if self.prompts_per_step % self.micro:
            raise UserError(f"config: RolloutCfg.prompts_per_step={self.prompts_per_step} is not "
                             f"divisible by micro_prompts={self.micro_prompts}")

    @property
    def G_t(self) -> int:
        """Teacher rows per group."""
        return round(self.group_size * self.mix)

    @property
    def G_s(self) -> int:
        """Student samples per group."""
        return self.group_size - self.G_t

    @property
    def micro(self) -> int:
        """Prompts per micro-batch (micro_prompts, or all of them)."""
        return self.micro_prompts or self.prompts_per_step

    @property
    def n_micro(self) -> int:
        """Micro-batches per optimizer step."""
        return self.prompts_per_step // self.micro

    @property
    def dr_grpo_denom(self) -> int:
        """Dr.GRPO constant denominator G * max_new_tokens * prompts per step (docs/losses.md)."""
        return self.group_size * self.max_new_tokens * self.prompts_per_step


@dataclass(frozen=True)
class PoolCfg:
    path: str = ""
    """teacher pool JSONL (`projected-grpo build-pool`); empty = build from templates into the run dir"""
    n_hack: int = 2
    """template pool: hack rows per problem (when path is empty)"""
    n_clean: int = 2
    """template pool: clean rows per problem (when path is empty)"""
    n_buggy: int = 0
    """template pool: honest-but-buggy rows per problem (when path is empty)"""
    missing: Literal["restrict", "error", "students"] = "restrict"
    """prompts with no pool rows while G_t > 0: `restrict` sampling to pooled ones (reported), `error`, or
    `students`: their groups are all G student samples (leave-one-mode-out: the held-out mode has no rows)"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "n_hack", "n_clean", "n_buggy", allow_zero=True)


@dataclass(frozen=True)
class LossCfg:
    algo: Literal["grpo", "ppo"] = "grpo"
    """RL loop of `projected-grpo train`: `grpo` group advantages (run/train.py), `ppo` a value head with
    GAE and several epochs of minibatches per batch (run/ppo.py, section `ppo`)"""
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_std"] = "dr_grpo"
    """advantage estimator, advantages.ADVANTAGES[name]"""
    aggregation: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "dr_grpo"
    """token-loss aggregation, losses.AGGREGATIONS[name]"""
    kl: Literal["k1", "k2", "k3", "k3_ratio"] = "k3"
    """KL estimator to the reference (knobs zeroed), losses.KL_ESTIMATORS[name]"""
    beta: float = 0.0
    """KL coefficient; at 0 the reference forward is skipped and kl/* is not logged"""
    eps_low: float = 0.2
    """PPO clip: ratio floor 1 - eps_low"""
    eps_high: float = 0.2
    """PPO clip: ratio ceiling 1 + eps_high"""
    teacher: Literal["imitation", "importance", "exclude"] = "imitation"
    """teacher rows: `imitation` logp_old = current policy (ratio 1, the original study's), `importance`
    the stored behaviour log-probs give per-token ratios pi/mu, truncated, as loss weights, `exclude`
    baseline only (no loss on teacher tokens); docs/losses.md, objective/teacher.py"""
    is_trunc: float = 2.0
    """importance: truncation cap C of the per-token IS weight min(exp(logp - logp_behaviour), C)"""
    zero_var: Literal["skip", "resample"] = "skip"
    """groups with all-equal rewards: `skip` them, or `resample` their student samples"""
    max_resample: int = 2
    """resample: extra generation tries per step before skipping what is still zero-variance"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "beta", "eps_low", "eps_high", "max_resample", allow_zero=True)
        _positive(self, "is_trunc")


@dataclass(frozen=True)
class ProjCfg:
    arm: Literal["none", "erase", "route", "erase_bounded"] = "none"
    """`none` measure only, `erase` remove the hack-ward part, `route` erase and move it to the quarantine,
    `erase_bounded` erase, and clamp the knob's V-coefficients at their start after every step (no drift
    along V: knobs/projection.bound_drift)"""
    gate: Literal["one_sided", "no_gate", "reverse"] = "one_sided"
    """coefficient on V: relu(c) (one_sided), c (no_gate), 2c (reverse)"""
    target: Literal["grad", "update", "both"] = "grad"
    """project the gradient, the AdamW update, or both (the Adam bypass, docs/architecture.md)"""
    purge_moments: bool = False
    """remove span(V) from AdamW's moment estimates each step"""
    v_path: str = ""
    """V_hack safetensors file; empty = extract from `pairs` (or the environment's built-in pairs) into the
    cache, keyed by model, tokenizer, pairs and the extraction settings below (hack/direction.py)"""
    control: Literal["none", "random", "shuffled", "nonhack", "within", "energy"] = "none"
    """V_hack negative control (`none` = the real V; docs/preregistration.md, "Controls"): `random`
    orthonormal; `shuffled` labels swapped per pair (orientation only: V's own span); `nonhack` clean vs
    clean; `within` hack vs hack and clean vs clean (the label control: another span); `energy` as much of
    the pairs' completion gradients as the real V captures, from their top directions (hack/controls.py)"""
    pairs: str = ""
    """contrastive pairs file (JSON/JSONL: prompt, hack, clean[, ids]); empty = the environment's built-in
    pairs from its hack and clean templates"""
    pairs_per_problem: int = 3
    """extraction: built-in contrastive pairs per problem (hack/pairs.py builtin_pairs)"""
    k: int = 4
    """extraction: top-k singular directions kept per module (every one is used)"""
    heldout_frac: float = 0.25
    """extraction: share of the pairs' prompts held out of the fit (whole prompts) for V's held-out check
    against its controls (hack/check.py)"""
    require_check: bool = False
    """refuse to train when V_hack does not beat its controls on the held-out pairs (else a loud warning)"""
    nll_norm: Literal["mean", "constant"] = "mean"
    """extraction NLL normalisation: per-completion mean or the training loss's constant
    denominator G * max_new_tokens * prompts_per_step (the Dr.GRPO aggregation's, docs/losses.md)"""
    refresh_every: int = 0
    """re-extract V_hack online every N steps under ablate_quarantine() (0 = never)"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "k", "pairs_per_problem")
        _positive(self, "refresh_every", allow_zero=True)
        if self.purge_moments and self.gate == "reverse":
            raise UserError("config: ProjCfg.purge_moments needs gate in ['one_sided', 'no_gate'], "
                             "got 'reverse'")
        if not 0.0 <= self.heldout_frac < 1.0:
            raise UserError(f"config: ProjCfg.heldout_frac={self.heldout_frac!r} must be in [0, 1)")


@dataclass(frozen=True)
class Config:
    model: ModelCfg = field(default_factory=ModelCfg)
    """policy model and knob adapter"""
    env: EnvCfg = field(default_factory=EnvCfg)
    """problems, grader and sandbox"""
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    """prompts, group size, student/teacher mix, sampling"""
    pool: PoolCfg = field(default_factory=PoolCfg)
    """teacher pool"""
    loss: LossCfg = field(default_factory=LossCfg)
    """advantages, clip surrogate, KL, teacher handling, zero-variance groups"""
    proj: ProjCfg = field(default_factory=ProjCfg)
    """hack direction and projection arm"""
    monitor: MonitorCfg = field(default_factory=MonitorCfg)
    """a monitor of each rollout and the intervention acting on it (penalty, screen, advantage, inoculation;
    config_monitor.py)"""
    optim: OptimCfg = field(default_factory=OptimCfg)
    """AdamW, warmup + cosine, clipping"""
    run: RunCfg = field(default_factory=RunCfg)
    """steps, seed, run directory, checkpoints, logging"""
    ppo: PPOCfg = field(default_factory=PPOCfg)
    """PPO with a critic (loss.algo ppo): epochs, minibatches, GAE, value loss, entropy bonus"""
    dpo: DPOCfg = field(default_factory=DPOCfg)
    """DPO on (prompt, chosen, rejected) pairs: `projected-grpo dpo`, or a pass before RL (dpo.before)"""

    def __post_init__(self) -> None:
        # the smoke model's 512-token vocabulary turns LeetCode's long prompts into more positions than it has
        if self.model.source == "smoke" and self.env.name == "coding" and self.env.problems != "builtin":
            raise UserError("config: model.source='smoke' is built for the built-in coding problems; set "
                            "env.problems='builtin' or use another model")
        if self.loss.algo == "ppo" and self.monitor.intervention in ("screen", "advantage"):
            raise UserError(f"config: monitor.intervention={self.monitor.intervention!r} acts on GRPO's "
                            "group advantages; PPO (loss.algo ppo) takes penalty or inoculation")
        every = self.monitor.direction_every
        if self.monitor.kind == "direction" and every > 1 and self.run.checkpoint_every % every:
            raise UserError(f"config: monitor.direction_every={every} needs run.checkpoint_every (now "
                            f"{self.run.checkpoint_every}) to be a multiple of it: a run resumed from a "
                            "checkpoint re-scores the held-out pairs at its first step, as the unbroken run "
                            "did")
        device, dtype = self.model.device, self.rollout.sample_dtype
        own = dtype in ("model", "auto")  # "auto" is "model" on a GPU
        off = [f"{k} is {v!r}" for k, v, ok in (("model.device", device, device.startswith("cuda")),
                                                ("rollout.sample_dtype", dtype, own)) if not ok]
        if self.rollout.cuda_graph and off:
            raise UserError("config: rollout.cuda_graph replays the model's own weights on a GPU "
                            f"(model.device cuda, rollout.sample_dtype 'model'), but {' and '.join(off)}")
        if self.dpo.before and self.model.init_knobs:
            raise UserError("config: dpo.before starts the knobs from the DPO pass; model.init_knobs="
                            f"{self.model.init_knobs!r} would be a second start: set one of them")

    def to_dict(self) -> dict:
        """Plain JSON-able nested dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "config") -> Config:
        """Inverse of `to_dict`; unknown sections or fields, or a wrong type, fail naming them and `where`."""
        from projected_grpo.configio import config_from_dict

        return config_from_dict(cls, d, where)

    @classmethod
    def from_json(cls, path: str) -> Config:
        """A config JSON file (e.g. a run's config.json); errors name the file and the field."""
        from projected_grpo.configio import config_from_json

        return config_from_json(cls, path)


def resolve_auto(cfg: Config) -> Config:
    """cfg with rollout.seed_scope "auto" made concrete: "prompt" under torchrun (WORLD_SIZE > 1), else
    "batch"; any other value unchanged. Every command's parse and every run's start apply it, so config.json
    records the seeds a run drew."""
    if cfg.rollout.seed_scope != "auto":
        return cfg
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return replace(cfg, rollout={"seed_scope": "prompt" if world > 1 else "batch"})


def replace(cfg: Config, **sections: dict) -> Config:
    """`cfg` with some fields of some sections changed: `replace(cfg, run={"steps": 3})`."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kw)
                                       for name, kw in sections.items()})


def diff(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """'section.field: a -> b' per field differing between a and b, except the dotted names in `ignore`."""
    da, db = a.to_dict(), b.to_dict()
    return [f"{s}.{k}: {da[s][k]!r} -> {db[s][k]!r}" for s in da for k in da[s]
            if da[s][k] != db[s][k] and f"{s}.{k}" not in ignore]
