"""The knobs folded into a plain Hugging Face model: W + ΔW written into a copy of the base model, saved with
`save_pretrained`, so stock `AutoModelForCausalLM` loads it with no knob code (run/export.py's `export`
command; the quarantine knob only on request, for analysis)."""

from __future__ import annotations

import copy
import pathlib

import torch

from projected_grpo.knobs.adapters import Knobs, parent_module, wide
from projected_grpo.store import atomic_dir


def export(knobs: Knobs, out_dir: str | pathlib.Path, include_quarantine: bool = False,
           tokenizer=None) -> None:
    """Fold knobs into W (W + U·diag(δS[+δS_hack])·Vh, or W + (B[+B_hack])·A) on a deep copy and
    `save_pretrained` a plain checkpoint that stock `AutoModelForCausalLM` loads. Needs memory for a
    second copy of the model. `out_dir` must not exist or be empty; written via a temp dir + rename."""
    out = pathlib.Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export target {out} is not empty; choose a new directory")
    # never deep-copy an active capture or the W_eff caches (a copy of the weights each)
    saved = {n: (m.capture, m._eff, m._pinned) for n, m in knobs.modules.items()}
    for m in knobs.modules.values():
        m.capture = m._eff = m._pinned = None
    try:
        plain = copy.deepcopy(knobs.model)
    finally:
        for n, m in knobs.modules.items():
            m.capture, m._eff, m._pinned = saved[n]
    with torch.no_grad():
        for n in knobs.modules:
            parent, attr = parent_module(plain, n)
            km = getattr(parent, attr)
            coef = km.delta + km.delta_hack if include_quarantine else km.delta
            W = km.base.weight
            W.copy_((wide(W) + km.delta_weight(coef).to(wide(W))).to(W.dtype))
            setattr(parent, attr, km.base)
    for p in plain.parameters():
        p.requires_grad_(True)
    with atomic_dir(out) as tmp:
        plain.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
