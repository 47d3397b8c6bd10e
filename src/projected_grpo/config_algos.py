"""Config sections of the algorithms beside GRPO: PPO with a critic (run/ppo.py) and DPO (run/dpo.py).

`Config` holds them as its sections `ppo` and `dpo`; `loss.algo` picks the RL loop (grpo or ppo) and
`dpo.before` puts a DPO pass in front of it (the `dpo_then_grpo` arm). Kept apart from config.py only for
its length; the same rules hold: every field has a docstring line and is read as `cfg.ppo.<field>` /
`cfg.dpo.<field>`, and a bad value fails in __post_init__ with one line. Formulas: docs/losses.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from projected_grpo.configio import check_literals, check_positive
from projected_grpo.errors import UserError


@dataclass(frozen=True)
class PPOCfg:
    epochs: int = 4
    """passes over each rollout batch; with more than 1 the ratio moves off 1 and the clip bites"""
    minibatches: int = 2
    """optimizer updates per epoch: the batch's B·G sequences, shuffled (seeded), in this many minibatches"""
    gamma: float = 1.0
    """GAE discount γ per completion token (Schulman et al. 2016)"""
    lam: float = 1.0
    """GAE λ: 1 gives the return minus V (unbiased whatever the critic; verl's default), 0 one-step TD; TRL
    uses 0.95 with a full value model, our critic is a linear probe (docs/losses.md)"""
    vf_coef: float = 0.5
    """coefficient of the clipped value loss"""
    vf_clip: float = 0.2
    """clip range c of the value loss: V may move at most c from V_old per batch before its gradient stops"""
    ent_coef: float = 0.01
    """entropy-bonus coefficient (the loss gets −ent_coef·H per token)"""
    whiten: bool = True
    """normalise the GAE advantages to mean 0, std 1 over each batch's completion tokens (TRL's PPO)"""
    lr: float = 0.0
    """peak AdamW learning rate of the knobs under PPO; 0 = optim.lr / (epochs · minibatches), the same
    total step per batch as GRPO's one update (a preset's lr is tuned for one)"""
    value_lr: float = 1e-2
    """peak AdamW learning rate of the value head (on the policy's warm-up + cosine schedule)"""

    def __post_init__(self) -> None:
        check_literals(self)
        check_positive(self, "epochs", "minibatches", "vf_clip", "value_lr")
        check_positive(self, "vf_coef", "ent_coef", "lr", allow_zero=True)
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise UserError(f"config: PPOCfg.gamma={self.gamma!r}, lam={self.lam!r} must be in [0, 1]")


@dataclass(frozen=True)
class DPOCfg:
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """preference loss, losses.DPO_LOSSES[name]: `sigmoid` DPO (Rafailov 2023), `ipo` (Azar 2023), `hinge`
    SLiC (Zhao 2023)"""
    beta: float = 0.1
    """β of the DPO family (IPO's τ), on summed completion log-probs against the reference (knobs zeroed)"""
    steps: int = 20
    """optimizer steps of `projected-grpo dpo` (and of the pass before RL when `before`)"""
    lr: float = 1e-2
    """peak AdamW learning rate of the DPO steps (optim's betas, warm-up, cosine floor and clipping)"""
    batch_pairs: int = 8
    """pairs per optimizer step, drawn without replacement from a seeded shuffle per epoch of the fit pairs"""
    pairs: str = ""
    """(prompt, chosen = clean, rejected = hack) pairs: empty = V_hack's pairs (proj.pairs, else the
    environment's templates), `pool` = mined from the teacher pool with detector E, else a JSON/JSONL file"""
    heldout_frac: float = 0.25
    """share of the pairs' prompts held out of fitting (chosen by a stable hash): dpo/heldout_* metrics"""
    sample_n: int = 4
    """before and after training, this many samples per train problem with one seed, graded: the sampled
    hack rate the pass changes (dpo/hack_before, dpo/hack_after); 0 = skip"""
    before: bool = False
    """train: first a DPO pass (this section) into <run.dir>/dpo, then the RL loop from its final knobs"""

    def __post_init__(self) -> None:
        check_literals(self)
        check_positive(self, "beta", "steps", "lr", "batch_pairs")
        check_positive(self, "sample_n", allow_zero=True)
        if not 0.0 <= self.heldout_frac < 1.0:
            raise UserError(f"config: DPOCfg.heldout_frac={self.heldout_frac!r} must be in [0, 1)")
