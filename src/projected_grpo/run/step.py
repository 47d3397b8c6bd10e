"""The optimizer step every loop takes (GRPO, PPO, DPO): project by arm, clip, AdamW, project the update.

The order is the method's (docs/architecture.md, "The data path of one step"): the arm acts on the gradient
after the backward (and after data-parallel ranks summed it) and before clipping, so every rank projects the
same gradient and the clip sees what the optimizer will; `proj.target update` projects the AdamW update
after the step (the Adam bypass). Which of the two the arm acts on is chosen once (`arms_of`).
"""

from __future__ import annotations

import math

import torch

from projected_grpo import config as C
from projected_grpo.knobs import projection


def arms_of(proj: C.ProjCfg) -> tuple[str, str]:
    """(arm on the gradient, arm on the AdamW update): proj.arm where proj.target puts it, else "none"
    (which only measures)."""
    return (proj.arm if proj.target in ("grad", "both") else "none",
            proj.arm if proj.target in ("update", "both") else "none")


def projected_step(cfg: C.Config, opt: torch.optim.Optimizer, knobs, V_hack: dict[str, torch.Tensor], *,
                   split=None, step_taken: bool = True) -> dict[str, torch.Tensor]:
    """Project the knobs' gradient by arm, clip main + quarantine knobs together, purge AdamW's moments in
    span(V) (proj.purge_moments), step (unless `step_taken` is False: a step without signal moves nothing,
    Adam's momentum included), project the update. The caller has set each group's lr. split: the step's
    per-source gradients (a knobs.split.Capture) for proj/cin_student and proj/cin_teacher. Returns detached
    stats: the projection's (proj/*), grad/norm, the knobs' step norms (knob/step, knob/hack_step) and where
    the knob sits along V after `erase_bounded`'s clamp (knob/v_*: projection.bound_drift)."""
    grad_arm, update_arm = arms_of(cfg.proj)
    stats = projection.apply_arm(knobs, V_hack, grad_arm, cfg.proj.gate, split=split)
    stats["grad/norm"] = torch.nn.utils.clip_grad_norm_(knobs.parameters() + knobs.hack_parameters(),
                                                        cfg.optim.clip_norm or math.inf)
    if cfg.proj.purge_moments and cfg.proj.arm != "none":  # Adam bypass: drop hack-ward momentum
        stats |= projection.purge_moments(opt, knobs, V_hack,
                                          "no_gate" if cfg.proj.gate == "no_gate" else "one_sided")
    before, before_hack = projection.snapshot(knobs), projection.snapshot(knobs, "hack")
    if step_taken:
        opt.step()
    stats |= projection.project_update(knobs, before, V_hack, update_arm, cfg.proj.gate)
    stats |= projection.step_norms(knobs, before, before_hack)
    return stats | projection.bound_drift(knobs, V_hack, cfg.proj.arm)  # erase_bounded clamps; all measure


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group's learning rate for this step."""
    for group in opt.param_groups:
        group["lr"] = lr
