"""The run's own config sections: the optimizer (OptimCfg) and the run's bookkeeping (RunCfg: steps, seed,
directory, checkpoints, eval, trackers, threads). Part of the one typed config (config.py's `Config`)."""

from __future__ import annotations

from dataclasses import dataclass

from projected_grpo.configio import check_positive as _positive
from projected_grpo.errors import UserError


@dataclass(frozen=True)
class OptimCfg:
    lr: float = 1e-2
    """peak AdamW learning rate for the knobs"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay on the knobs"""
    eps: float = 1e-8
    """AdamW epsilon"""
    warmup_steps: int = 0
    """linear learning-rate warmup steps"""
    min_lr_frac: float = 0.1
    """cosine decay floor as a fraction of lr"""
    clip_norm: float = 1.0
    """global grad-norm clip over main and quarantine knobs (0 = no clipping)"""

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps")
        _positive(self, "weight_decay", "warmup_steps", "clip_norm", allow_zero=True)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(f"config: OptimCfg.betas={self.betas!r} must each be in [0, 1)")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise UserError(f"config: OptimCfg.min_lr_frac={self.min_lr_frac!r} must be in [0, 1]")


# run.report_to's choices: the trackers of run/trackers.py (a test keeps the two lists equal)
REPORT_TO = ("tensorboard", "wandb", "trackio")


@dataclass(frozen=True)
class RunCfg:
    steps: int = 4
    """optimizer steps"""
    seed: int = 0
    """seed for model init, prompt order, pool draws and sampling"""
    dir: str = ""
    """run directory (empty = runs/<model.source>-<arm>-s<seed>-<time>)"""
    resume: bool = False
    """continue from the latest checkpoint in `dir`"""
    checkpoint_every: int = 2
    """checkpoint every N steps (and always at the end)"""
    eval_every: int = 0
    """every N steps (0 = never), greedy samples of the deployed model (quarantine zeroed) on the
    environment's eval problems (its train problems where it has none): eval/* metrics"""
    report_to: tuple[str, ...] = ()
    """also send each step's metrics to: `tensorboard` (RUN_DIR/tb), `wandb` (WANDB_MODE=offline works with
    no network), `trackio` (local); metrics.jsonl is always written (run/trackers.py)"""
    threads: int = 1
    """torch intra-op CPU threads (0 = torch's default). 1 suits tiny models: measured here, sampling the
    1.2M-parameter organism took 1 s with 1 thread and 15-40 s with 2 while the sandbox workers were busy.
    A study runs cores // threads runs at once (study/launch.py), so 1 uses every core there; a single
    SmolLM2 run on an idle machine is faster with one per core (2 on 2 cores: docs/usage.md)"""

    def __post_init__(self) -> None:
        _positive(self, "steps", "checkpoint_every")
        _positive(self, "threads", allow_zero=True)
        _positive(self, "eval_every", allow_zero=True)
        if bad := [t for t in self.report_to if t not in REPORT_TO] or len(set(self.report_to)) < len(
                self.report_to):
            raise UserError(f"config: RunCfg.report_to={self.report_to!r}: {bad or 'repeated'}; each must be "
                            f"one of {list(REPORT_TO)}, once")
