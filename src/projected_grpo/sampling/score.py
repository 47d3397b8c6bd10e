"""The scoring forward: per-token log-probs (and entropy) of packed completions under a model.

`forward_logprobs` is the packed scoring forward (the training step's when rollout.share_prefix is off;
sampling/prefix.py shares each group's prompt otherwise), and V_hack's pair gradients and the organism's
warm-up use it too. Only the last T + 1 positions' logits are materialised where the model allows it.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from projected_grpo.objective.logprobs import entropy_from_logits, token_logprobs
from projected_grpo.sampling.pack import SeqBatch, position_ids_from_mask


def accepts_logits_to_keep(model) -> bool:
    """Whether `model.forward` takes `logits_to_keep` (materialise only the last logits)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def completion_logits(model, batch: SeqBatch) -> Tensor:
    """(N, T, V) logits predicting the T completion tokens, from one forward over (N, L).

    Only the last T + 1 positions are materialised (`logits_to_keep`, when the model supports it);
    the final position predicts past the sequence and is dropped.
    """
    T = batch.T
    keep = {"logits_to_keep": T + 1} if accepts_logits_to_keep(model) else {}
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False, **keep)
    return out.logits[:, -(T + 1):-1]  # (N, T, V)


def forward_logprobs(model, batch: SeqBatch, *, temperature: float = 1.0,
                     with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of the completion tokens under softmax(logits / temperature).

    Returns logp (N, T) and, when `with_entropy`, the per-token entropy (N, T) of the same tempered
    distribution (detached: a metric); both are 0 outside batch.completion_mask. Gradients flow to logp
    when called with grad on.
    """
    logits = completion_logits(model, batch)  # (N, T, V), a view: the chunked functions never copy it
    targets = batch.input_ids[:, -batch.T:]  # (N, T)
    real = batch.completion_mask.to(logits.device) > 0
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    # where, not multiply: a masked position must read 0 even if its value were inf
    logp = torch.where(real, token_logprobs(logits, targets, temperature=temperature), zero)
    entropy = None
    if with_entropy:  # a metric: no graph (the loss's backward never frees an unused branch's saved logits)
        with torch.no_grad():
            entropy = torch.where(real, entropy_from_logits(logits, temperature=temperature), zero)
    return logp, entropy
