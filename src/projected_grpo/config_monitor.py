"""The monitor and intervention config section (`monitor`): which monitor scores each rollout and what acts on
its verdict (hack/monitors.py, objective/interventions.py; docs/interventions.md). Beside config.py as the
PPO and DPO sections are (config_algos.py), with the same rules: a docstring line per field, Literal fields
checked, every field read as `cfg.monitor.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from projected_grpo.configio import check_literals as _check
from projected_grpo.configio import check_positive as _positive
from projected_grpo.errors import UserError


@dataclass(frozen=True)
class MonitorCfg:
    kind: Literal["none", "ground_truth", "degraded", "detector", "probe", "direction"] = "none"
    """monitor scoring every rollout (hack/monitors.py MONITORS; docs/interventions.md): `ground_truth` the
    oracle's exploited flag, `degraded` it at a set accuracy, `detector` the environment's hack detectors,
    `probe` a linear probe on a hidden layer, `direction` V_hack's score of the rollout's knob gradient"""
    intervention: Literal["none", "penalty", "screen", "advantage", "inoculation"] = "none"
    """what acts on the monitor's verdict: `penalty` a flagged rollout's reward minus monitor.penalty,
    `screen` flagged rollouts out of the loss, `advantage` the score folded into the advantage;
    `inoculation` (no monitor) trains under a system prompt naming the loophole acceptable; `none` with a
    monitor: measure it only (monitor/* metrics)"""
    accuracy: float = 0.9
    """degraded: the probability that a flag is the oracle's (each flipped with probability 1 - accuracy)"""
    penalty: float = 2.0
    """penalty: subtracted from a flagged rollout's reward; 2.0 is more than the `seed` reward shape's 1.25
    for a hack, so a flagged hack pays less than an honest failure"""
    coef: float = 1.0
    """advantage: coefficient on the group-centred score subtracted from the advantage"""
    screen_baseline: Literal["drop", "keep"] = "drop"
    """screen: `drop` flagged rows from their group's baseline too (the rl-rewardhacking benchmark's), or
    `keep` them in it"""
    detectors: tuple[str, ...] = ()
    """detector: the environment's detectors whose firing flags a rollout (empty = all of them; coding: E
    loophole code, C its tests pass a stub, D weakened tests; maths: hedge, several numbers in the answer)"""
    layer: int = -1
    """probe: the hidden state read (0 = embeddings, n_layers = the last; negatives count from the end)"""
    probe_pairs: str = ""
    """probe: a pairs file (prompt, hack, clean) of labelled completions, none of whose prompts the run
    trains on; empty = the templates of the environment's probe_problems()"""
    probe_problems: int = 0
    """probe: use the first N of the environment's probe problems (0 = all of them: 200 for maths, one per
    problem for coding); each gives several labelled completions, one forward each, at the build"""
    probe_heldout: float = 0.25
    """probe: share of the labelled prompts held out to choose the threshold and measure AUC and accuracy"""
    probe_l2: float = 0.01
    """probe: L2 penalty of the logistic fit on standardised features (finite weights on separable rows)"""
    direction_every: int = 1
    """direction: re-score V_hack's held-out pairs (threshold and scale) at every N-th step, reusing the last
    ones between (1 = every step, the bench's setting); that pass is most of the monitor's cost (maths
    organism, 494 pairs: 2.97 of a 3.65 s step). run.checkpoint_every must be a multiple, so a resumed run
    re-scores where the unbroken one did"""

    def __post_init__(self) -> None:
        _check(self)
        _positive(self, "penalty", "coef", allow_zero=True)
        _positive(self, "probe_l2")
        _positive(self, "probe_problems", allow_zero=True)
        _positive(self, "direction_every")
        if not 0.0 <= self.accuracy <= 1.0 or not 0.0 < self.probe_heldout < 1.0:
            raise UserError(f"config: MonitorCfg.accuracy={self.accuracy!r} must be in [0, 1] and "
                            f"probe_heldout={self.probe_heldout!r} in (0, 1)")
        acting = self.intervention in ("penalty", "screen", "advantage")
        if acting and self.kind == "none":
            raise UserError(f"config: monitor.intervention={self.intervention!r} acts on a monitor's "
                            "verdict; set monitor.kind (ground_truth, degraded, detector, probe, direction)")
        if self.intervention == "inoculation" and self.kind != "none":
            raise UserError(f"config: monitor.intervention='inoculation' changes the prompt, not a verdict; "
                            f"monitor.kind={self.kind!r} would only be measured: set it to 'none'")
