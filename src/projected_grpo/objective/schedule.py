"""The learning-rate schedule: linear warm-up, then cosine decay to a floor (nanoGPT's get_lr).

One function for every optimiser in the project (the GRPO loop and the organism's warm-up), so a
schedule is written and tested once. Pure: a float of (step, peak, total, warmup, floor_frac).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, total: int, warmup: int, floor_frac: float) -> float:
    """Learning rate at 0-based `step` of `total`: peak * (step + 1) / warmup for step < warmup, then
    peak * (floor_frac + (1 - floor_frac) * (1 + cos(pi * (step - warmup) / span)) / 2) with
    span = max(1, total - warmup), so it starts at peak and would reach floor_frac * peak at step = total."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    return peak * (floor_frac + (1 - floor_frac) * (1 + math.cos(math.pi * (step - warmup) / span)) / 2)
