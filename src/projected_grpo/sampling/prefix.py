"""Prefix-shared scoring: each group's prompt is run once, its keys/values shared by the group's completions.

The packed forward (score.forward_logprobs) recomputes a prompt in every row that holds it: G times per
group, in the training forward, its backward and the reference forward. Here the distinct prompts run once
(one row per (prompt, source): a group's students and teacher rows get separate prompt rows, so each
prompt row's knob gradient comes from one source and the per-source split stays exact), with a KV cache
and grad; every layer's keys/values are then gathered to the completion rows with a differentiable index
(the gradients of all rows sharing a prompt add up in it), and the completions run on top of them. The
first completion token is scored from the prompt's last position. Same log-probs and gradients as the
packed forward up to fp32 rounding (tests/test_prefix.py), at prompt cost once per prompt.
Not here: per-sequence knob gradients (a shared prompt row has none: Capture.rows refuses), models with
sliding-window or recurrent cache layers (`supported` says no; `scoring` then falls back to the packed
forward), sampling (generate.generate).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from projected_grpo.knobs.checkpointing import recomputing
from projected_grpo.objective.logprobs import entropy_from_logits, token_logprobs
from projected_grpo.sampling.kv_cache import with_cache
from projected_grpo.sampling.pack import (
    Ids,
    SeqBatch,
    as_ids,
    left_pad,
    length_buckets,
    pack,
    position_ids_from_mask,
)
from projected_grpo.sampling.score import accepts_logits_to_keep, forward_logprobs


@dataclass
class PrefixBatch:
    """N prompt+completion sequences over M <= N distinct prompt rows (M prefixes, P = longest prompt).

    prefix_ids      (M, P) long, left-padded; prefix_mask (M, P) long: 1 on real prompt tokens.
    prefix_student  (M,) bool: the source of every sequence that shares the prefix row.
    owner           (N,) long: each sequence's prefix row.
    completion_ids  (N, T) long, right-padded; completion_mask (N, T) float: 1 on real completion tokens.
    """

    prefix_ids: Tensor
    prefix_mask: Tensor
    prefix_student: Tensor
    owner: Tensor
    completion_ids: Tensor
    completion_mask: Tensor

    @property
    def T(self) -> int:
        return self.completion_mask.shape[1]

    def to(self, device: torch.device | str) -> PrefixBatch:
        return PrefixBatch(*(t.to(device) for t in (self.prefix_ids, self.prefix_mask, self.prefix_student,
                                                    self.owner, self.completion_ids, self.completion_mask)))


def pack_prefix(prompt_ids: Sequence[Ids], completion_ids: Sequence[Ids], pad_id: int,
                is_student: Sequence[bool] | Tensor) -> PrefixBatch:
    """Lay out N (prompt (T_p,), completion (T_c,)) id rows with one prefix row per distinct (prompt, source).

    Prompts are told apart by their ids' values (not by tensor identity). Prefix rows are in order of first
    appearance; rows are checked as pack() checks them."""
    pack([p[-1:] for p in prompt_ids], completion_ids, pad_id)  # pack's checks, on 1-token prompts: cheap
    flags = [bool(s) for s in (is_student.tolist() if isinstance(is_student, Tensor) else is_student)]
    if len(flags) != len(prompt_ids):
        raise ValueError(f"pack_prefix: {len(prompt_ids)} rows but {len(flags)} is_student flags")
    rows: dict[tuple[tuple[int, ...], bool], int] = {}
    owner = [rows.setdefault((tuple(as_ids(p).tolist()), s), len(rows)) for p, s in zip(prompt_ids, flags)]
    keys = list(rows)
    p_ids, p_mask = left_pad([k[0] for k in keys], max(len(k[0]) for k in keys), pad_id)
    T = max(len(c) for c in completion_ids)
    c_ids = torch.full((len(completion_ids), T), pad_id, dtype=torch.long)
    for i, c in enumerate(completion_ids):
        c_ids[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
    lens = torch.tensor([len(c) for c in completion_ids])
    c_mask = (torch.arange(T)[None, :] < lens[:, None]).float()
    return PrefixBatch(p_ids, p_mask, torch.tensor([k[1] for k in keys]), torch.tensor(owner), c_ids, c_mask)


# --- KV caches that a checkpointed replay leaves alone ---------------------------------------------


class _PrefixLayer(DynamicLayer):
    """Keeps one layer's keys and values of the prompt forward (graph attached); returns them unchanged."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not recomputing():  # a checkpointed replay recomputes them for its own backward only
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _SharedLayer(DynamicLayer):
    """One layer's prompt keys/values (M, H, P, D) in front of the completion rows' own: each call gathers
    them to the N rows (index_select: its backward adds the rows' gradients into the shared prompt) and
    concatenates the new ones, storing nothing, so a checkpointed replay computes the same. The gather
    inside the call means that under checkpointing the (N, H, P, D) copy is recomputed, not kept."""

    def __init__(self, keys: Tensor, values: Tensor, owner: Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self._k, self._v, self._owner = keys, values, owner
        self.keys, self.values = keys, values  # for get_seq_length: the prompt width P

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return (torch.cat([self._k.index_select(0, self._owner), key_states], -2),
                torch.cat([self._v.index_select(0, self._owner), value_states], -2))


class _ReplaySafeCache(DynamicCache):
    replay_safe = True  # knobs/checkpointing.py keeps it in a checkpointed forward


def supported(model) -> bool:
    """Whether prefix-shared scoring applies: a transformers model whose cache layers are all plain
    full-attention DynamicLayers (no sliding window, no linear-attention state)."""
    if getattr(model, "config", None) is None:
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def _cache(model, layers: list[DynamicLayer]) -> _ReplaySafeCache:
    cache = _ReplaySafeCache(config=model.config)
    if len(cache.layers) != len(layers) and layers:
        raise RuntimeError(f"prefix cache: {len(layers)} layers for a model with {len(cache.layers)}")
    cache.layers = layers or [_PrefixLayer() for _ in cache.layers]
    return cache


# --- scoring -------------------------------------------------------------------------------------


def prefix_logprobs(model, batch: PrefixBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                    capture=None, buckets: int = 1) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (N, T) of the completion tokens (and detached entropies (N, T) when
    `with_entropy`), as score.forward_logprobs gives on the packed batch; 0 outside completion_mask.

    capture: the open `Knobs.capture(is_student)` of this forward, if any; its is_student must be the
    sequences' sources (batch.prefix_student[batch.owner]). The prompt rows' forward runs under its
    `rows(prefix_student)`, so their knob gradients are split by source too.
    buckets: the completions run in at most this many forwards of like-length rows (pack.length_buckets),
    each padded to its own longest row instead of all to the batch's: the same log-probs and gradients up
    to fp32 rounding, without the padded positions' work (rollout.buckets). 1: one forward of all N rows,
    as before it existed."""
    N, T = batch.completion_ids.shape
    owner = batch.owner
    if capture is not None and not torch.equal(capture.is_student.to(owner.device),
                                               batch.prefix_student[owner]):
        raise ValueError("prefix_logprobs: the capture's is_student differs from the batch's sources; pack "
                         "the batch with the same is_student the capture was opened with")
    # 1. the prompts, once per (prompt, source), with grad and a cache; only the last position's logits
    cache = _cache(model, [])
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    with contextlib.nullcontext() if capture is None else capture.rows(batch.prefix_student):
        out = model(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                    position_ids=position_ids_from_mask(batch.prefix_mask), use_cache=True,
                    **with_cache(model, cache), **keep)
    first = out.logits[:, -1:].index_select(0, owner)  # (N, 1, V): predicts completion token 0
    real = batch.completion_mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=real.device)
    logp = [token_logprobs(first, batch.completion_ids[:, :1], temperature=temperature)]  # (N, 1)
    entropy = [_entropy(first, temperature)] if with_entropy else []
    # 2. the completions but their last token (it predicts nothing) on the prompts' keys/values, in buckets
    # of like length (one bucket: all rows in order); each bucket's (n, T_b - 1) results padded to T - 1
    if T > 1:
        lens = batch.completion_mask.sum(1).long().tolist()
        groups = length_buckets(lens, buckets)
        start = batch.prefix_mask.sum(1)  # (M,) real prompt length = the completion's first position
        parts, ent_parts = [], []
        for rows in groups:
            idx = torch.tensor(rows, device=owner.device)
            o = owner.index_select(0, idx)
            Tb = max(lens[i] for i in rows)  # T itself for one bucket (pack_prefix pads to the longest)
            if Tb == 1:  # one-token completions: scored from the prompt's last position alone
                parts.append(torch.zeros((len(rows), T - 1), device=owner.device))
                ent_parts += parts[-1:] if with_entropy else []
                continue
            shared = _cache(model, [_SharedLayer(layer.keys, layer.values, o) for layer in cache.layers])
            ids = batch.completion_ids.index_select(0, idx)[:, :Tb]
            c_mask = batch.completion_mask.index_select(0, idx)[:, :Tb - 1].to(batch.prefix_mask.dtype)
            pos = start.index_select(0, o)[:, None] + torch.arange(Tb - 1, device=o.device)
            sources = batch.prefix_student.index_select(0, o)  # = capture.is_student[idx]
            with contextlib.nullcontext() if capture is None else capture.rows(sources):
                out = model(input_ids=ids[:, :Tb - 1],
                            attention_mask=torch.cat([batch.prefix_mask.index_select(0, o), c_mask], 1),
                            position_ids=pos, use_cache=True, **with_cache(model, shared))
            pad = (0, T - Tb)  # (n, Tb - 1) -> (n, T - 1): the padded positions are masked to 0 below
            parts.append(F.pad(token_logprobs(out.logits, ids[:, 1:], temperature=temperature), pad))
            if with_entropy:
                ent_parts.append(F.pad(_entropy(out.logits, temperature), pad))
        back = torch.tensor([i for rows in groups for i in rows], device=owner.device).argsort()
        logp.append(torch.cat(parts).index_select(0, back))  # the buckets' rows back in batch order
        if with_entropy:
            entropy.append(torch.cat(ent_parts).index_select(0, back))
    # where, not multiply: a masked inf reads 0
    logp_out = torch.where(real, torch.cat(logp, 1), zero)
    return logp_out, torch.where(real, torch.cat(entropy, 1), zero) if with_entropy else None


def _entropy(logits: Tensor, temperature: float) -> Tensor:
    """A metric: no graph (the loss's backward never frees an unused branch's saved logits)."""
    with torch.no_grad():
        return entropy_from_logits(logits, temperature=temperature)


# --- the scoring forward of the training step, chosen once ------------------------------------------


class Scoring(NamedTuple):
    """pack(prompt_ids, completion_ids, pad_id, is_student) -> batch (with .completion_mask, .T, .to);
    logprobs(model, batch, *, temperature, with_entropy=False, capture=None) -> (logp, entropy)."""

    name: str
    pack: Callable
    logprobs: Callable


def _packed_logprobs(model, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                     capture=None) -> tuple[Tensor, Tensor | None]:
    return forward_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)


SCORINGS: dict[str, Scoring] = {
    "packed": Scoring("packed", lambda prompts, completions, pad_id, is_student: pack(prompts, completions,
                                                                                       pad_id),
                      _packed_logprobs),
    "prefix": Scoring("prefix", pack_prefix, prefix_logprobs),
}


def scoring(model, share_prefix: bool, buckets: int = 1) -> Scoring:
    """The training step's scoring forward (rollout.share_prefix): prefix-shared when asked and the model
    supports it, its completions in up to `buckets` like-length forwards (rollout.buckets), else packed (said
    on stderr when asked for but unsupported)."""
    if share_prefix and not supported(model):
        print(f"rollout.share_prefix: {type(model).__name__} has cache layers other than full attention "
              "(sliding window, linear attention) or no transformers config; scoring with the packed "
              "forward", file=sys.stderr)
    if not (share_prefix and supported(model)):
        return SCORINGS["packed"]
    chosen = SCORINGS["prefix"]
    return chosen if buckets == 1 else chosen._replace(logprobs=functools.partial(chosen.logprobs,
                                                                                  buckets=buckets))
