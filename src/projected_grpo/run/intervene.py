"""A run's monitor and intervention (docs/interventions.md): built once at setup, applied to every step.

  open_monitor  the monitor of cfg.monitor.kind (hack/monitors.py), or None; writes RUN_DIR/monitor.json
  verdict       the monitor's scores and flags of a step's groups, (B, G) each (zeros without a monitor)
  rewards       the rollout step's rewards after the intervention (penalty: flagged rows lose monitor.penalty)
  advantages    the loop's advantages and loss rows after the intervention (screen, advantage)
  rates         the monitor's precision and recall against the oracle on the step's student rows (logged only)
The interventions are chosen by name from tables (REWARD_STAGES, ADVANTAGE_STAGES); their math is
objective/interventions.py. Ground truth reaches this module only for the ground_truth and degraded monitors
(through monitors.view) and for logging (`rates`), never a probe's or a direction's score.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from projected_grpo import config as C
from projected_grpo import store
from projected_grpo.hack import monitors
from projected_grpo.objective import interventions as I
from projected_grpo.objective.advantages import ADVANTAGES
from projected_grpo.sampling.sample import Sample

MONITOR_FILE = "monitor.json"


@dataclasses.dataclass
class Verdict:
    """A monitor's verdict on a step's groups: scores (B, G) float32 in [0, 1], flags (B, G) bool, and its
    stats (monitor/threshold ...)."""

    scores: Tensor
    flags: Tensor
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def cat(parts: Sequence[Verdict]) -> Verdict:
        """The verdicts of consecutive groups as one (stats: the first part's, equal on every rank)."""
        return Verdict(torch.cat([p.scores for p in parts]), torch.cat([p.flags for p in parts]),
                       dict(parts[0].stats))


def open_monitor(cfg: C.Config, model, knobs, tokenizer, env, sets: dict[str, list],
                 prompt_ids: dict[str, Tensor], V_hack: dict[str, Tensor],
                 run_dir: pathlib.Path | None) -> monitors.Monitor | None:
    """The run's monitor (None for monitor.kind none), its build's report written to run_dir/monitor.json
    (when run_dir is given: rank 0). trained prompts: those of the train and warm-up sets."""
    trained = {tuple(prompt_ids[p.id].tolist()) for stage in ("train", "warmup") for p in sets.get(stage, [])}
    monitor = monitors.build(monitors.MonitorInputs(cfg, model, knobs, tokenizer, env, sets["train"], trained,
                                                    V_hack))
    if monitor is not None and run_dir is not None:
        store.write_json_atomic(run_dir / MONITOR_FILE, {"kind": monitor.name, "labels": monitor.labels,
                                                         "intervention": cfg.monitor.intervention,
                                                         **monitor.report})
        print(f"monitor {monitor.name} ({monitor.labels} labels), intervention {cfg.monitor.intervention}",
              file=sys.stderr)
    return monitor


def verdict(monitor: monitors.Monitor, groups: Sequence[Sequence[Sample]], rows: Sequence[int],
            step: int) -> Verdict:
    """The monitor's verdict on `groups` (B lists of G Samples), group j being the step's group rows[j]
    (its index in the global batch: a degraded monitor's draws are per (step, b * G + g))."""
    G = len(groups[0])
    flat = [s for g in groups for s in g]
    ids = [b * G + g for b in rows for g in range(G)]
    scores, flags, stats = monitor.score(monitors.view(flat, monitor.reads, step, ids))
    return Verdict(scores.reshape(len(groups), G).float(), flags.reshape(len(groups), G), stats)


def _same_rewards(cfg: C.Config, rewards: Tensor, v: Verdict) -> tuple[Tensor, dict]:
    return rewards, {}


def _penalised(cfg: C.Config, rewards: Tensor, v: Verdict) -> tuple[Tensor, dict]:
    return I.penalty(rewards, v.flags, cfg.monitor.penalty)


# monitor.intervention -> its effect on the rollout step's rewards (B, G)
REWARD_STAGES: dict[str, Callable[[C.Config, Tensor, Verdict], tuple[Tensor, dict]]] = {
    "none": _same_rewards, "penalty": _penalised, "screen": _same_rewards, "advantage": _same_rewards,
    "inoculation": _same_rewards}


def rewards(cfg: C.Config, r: Tensor, v: Verdict | None) -> tuple[Tensor, dict[str, float]]:
    """The rewards (B, G) the advantages are computed from, and the stats (monitor/penalised_frac). v is None
    only without a monitor (config_monitor.py: an intervention acting on a verdict needs one)."""
    out, stats = REWARD_STAGES[cfg.monitor.intervention](cfg, r, v)
    return out, {k: float(x) for k, x in stats.items()}


def _plain(cfg: C.Config, r: Tensor, v: Verdict) -> tuple[Tensor, Tensor, dict]:
    adv, stats = ADVANTAGES[cfg.loss.advantage](r)
    return adv, torch.ones_like(r, dtype=torch.bool), stats


def _screened(cfg: C.Config, r: Tensor, v: Verdict) -> tuple[Tensor, Tensor, dict]:
    _, stats = ADVANTAGES[cfg.loss.advantage](r)  # reward/* of every row, as docs/metrics.md defines them
    adv, keep, s_stats = I.screen(r, v.flags, cfg.loss.advantage, cfg.monitor.screen_baseline)
    return adv, keep, {**stats, **I.adv_stats(adv), **s_stats}


def _modified(cfg: C.Config, r: Tensor, v: Verdict) -> tuple[Tensor, Tensor, dict]:
    adv, stats = ADVANTAGES[cfg.loss.advantage](r)
    adv, m_stats = I.advantage(adv, v.scores, cfg.monitor.coef)
    return adv, torch.ones_like(r, dtype=torch.bool), {**stats, **I.adv_stats(adv), **m_stats}


# monitor.intervention -> (rewards, verdict) -> (adv (B, G), rows kept in the loss (B, G), stats)
ADVANTAGE_STAGES: dict[str, Callable[[C.Config, Tensor, Verdict], tuple[Tensor, Tensor, dict]]] = {
    "none": _plain, "penalty": _plain, "screen": _screened, "advantage": _modified, "inoculation": _plain}


def advantages(cfg: C.Config, r: Tensor, v: Verdict | None) -> tuple[Tensor, Tensor, dict]:
    """(adv (B, G), rows kept in the loss (B, G) bool, stats) of the step's rewards under the intervention
    (v None: no monitor); a group whose advantages are all 0 teaches nothing (the loop skips it)."""
    return ADVANTAGE_STAGES[cfg.monitor.intervention](cfg, r, v)


def rates(groups: Sequence[Sequence[Sample]], v: Verdict) -> dict[str, float]:
    """monitor/precision, monitor/recall (each only when defined), monitor/flagged_frac over the student rows
    of `groups` (the logged comparison with the oracle; the monitor never sees it)."""
    student = torch.tensor([[s.student for s in g] for g in groups])  # (B, G)
    truth = torch.tensor([[s.grade.exploited for s in g] for g in groups])  # (B, G)
    return {k: float(x) for k, x in I.precision_recall(v.flags[student], truth[student]).items()}
