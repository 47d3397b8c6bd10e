"""Batched sampling: every prompt x n_samples in one seeded KV-cache decode, with behaviour log-probs.

`generate` samples all prompts x n_samples in one batch with an attention mask, stops each row at EOS
(optionally retiring finished rows from the batch), and returns the log-probs it sampled under. `step_seed`
derives sampling seeds from (base_seed, step, ...) stably across processes. The decode's KV caches are in
kv_cache.py, its per-token step (a lean one for Llama/Qwen2, else the HF forward) in decode_step.py, the
forward over prepacked weights (prefill and step, sample_dtype fp32 or bf16) in packed.py, its token
samplers in samplers.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo.sampling.decode_step import Decode, decode_step
from projected_grpo.sampling.graphed import graphed_step
from projected_grpo.sampling.kv_cache import KV_CACHES, cache_of, with_cache
from projected_grpo.sampling.pack import Ids, SeqBatch, as_ids, left_pad, pack, position_ids_from_mask
from projected_grpo.sampling.packed import PackedLM
from projected_grpo.sampling.samplers import SAMPLERS, uniforms
from projected_grpo.sampling.score import accepts_logits_to_keep


def step_seed(base_seed: int, step: int, *extra: int | str) -> int:
    """Deterministic 63-bit seed for (base_seed, step, *extra), identical in every process.

    Uses blake2b of the JSON-encoded tuple (nanochat derives sampling seeds from
    hash((step, example_idx, sampling_step)); a cryptographic hash keeps that stable for str parts too,
    which Python's salted hash() does not).
    """
    key = json.dumps([int(base_seed), int(step), *extra]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


@dataclass
class Rollout:
    """N = B * n_samples sampled completions, prompt-major (row b * n_samples + g).

    prompt_ids     list of N (T_p,) torch.long CPU tensors: prompt b's one tensor, repeated n_samples times
                   (shared, never written to).
    completion_ids list of N (T_c,) torch.long CPU tensors: EOS included when emitted, nothing after it.
    logp           list of N (T_c,) float32 CPU tensors: behaviour log-prob of each
                   sampled token under the distribution it was drawn from, as importance weights need
                   it (pool.teacher_importance): log_softmax(logits / temperature) renormalised over
                   the top-p nucleus; 0 for greedy (temperature 0: drawn with probability 1). With
                   top_p = 1 it matches forward_logprobs(..., temperature) on the same policy.
    truncated      (N,) bool: hit max_new_tokens without emitting EOS.
    """

    prompt_ids: list[Tensor]
    completion_ids: list[Tensor]
    logp: list[Tensor]
    truncated: Tensor

    def batch(self, pad_id: int) -> SeqBatch:
        return pack(self.prompt_ids, self.completion_ids, pad_id)

@torch.no_grad()
def generate(model, prompt_ids: Sequence[Ids], n_samples: int, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | Sequence[int],
             eos_id: int | Sequence[int], pad_id: int, kv_cache: str = "preallocated",
             share_prefill: bool = False, lean: bool = True,
             sample_dtype: torch.dtype | None = None, cuda_graph: bool = False,
             retire: bool = False) -> Rollout:
    """Sample n_samples completions for every prompt in ONE batched KV-cache decode.

    Prompts are left-padded with an attention mask and explicit position ids, so a row's logits do
    not depend on what it is batched with (its random draws do: one Generator serves the batch).
    Each row stops at its first EOS (any id in `eos_id`).
    temperature 0 means greedy. Randomness comes only from a private torch.Generator seeded with
    `seed` on the model's device (the global torch RNG is untouched), so the same seed gives the
    same ids on CPU. `seed` may be a list, one per prompt: each prompt's rows then draw from a Generator of
    their own, so its samples are the same whatever it is batched with (rollout.seed_scope = "prompt").
    Call with the model in eval mode (dropout would otherwise perturb sampling).
    Own loop rather than HF `generate`: it takes a Generator, returns the exact sampling log-probs,
    and stays cheap for tiny models. kv_cache: "preallocated" (default; the KV cache and attention mask
    are sized once for prompt + max_new_tokens) or "dynamic" (transformers' own DynamicCache, for a model
    whose cache the preallocated one does not fit); both give the same ids and log-probs, bit for bit.
    share_prefill: run each prompt's prefill once and copy its KV cache and last logits to its n_samples
    rows (instead of n_samples identical prefills): the same distributions, but the prefill's other batch
    shape rounds differently in the last bits, so the sampled stream is not the unshared one bit for bit.
    lean: after the HF prefill, decode with decode_step.lean_step where the model is on its allow-list (the
    same logits bit for bit, less Python per token); False forces the HF forward per token (tests, A/B).
    sample_dtype: None samples the model as it is (everything above); torch.bfloat16 samples a bf16 copy of
    its weights (knobs merged as they are now) through packed.PackedLM, prefill included: about half the
    memory traffic per token, the logits of the model cast to bf16 (not the model's own: the log-probs
    returned are that bf16 model's); torch.float32 the same with fp32 copies laid out for oneDNN (the
    model's logits up to fp32 rounding, not bit for bit); kv_cache and lean then do not apply.
    cuda_graph: decode with graphed.graphed_step (the model on a GPU, sample_dtype None, the preallocated
    cache, a model the lean step supports): one graph launch per token instead of ~25 kernels per layer; its
    logits round differently from the HF forward's in the last bits (graphed.py says why); lean then does not
    apply.
    retire: drop finished rows from the decode batch (their KV cache and mask rows) once at least an eighth of
    it has finished, so that a step costs the rows still decoding (a CPU step's matmuls scale with its rows).
    Every row's uniform is drawn at every token either way (samplers.uniforms), so a row's tokens are those
    of the unretired decode wherever the kernels round a row alike at every batch size (SmolLM2's packed
    fp32 on the CPUs measured); elsewhere (the organism's fp32 at 2 threads, bf16 at a few rows) the same
    distributions, rounded differently, so the sampled stream is not the unretired one bit for bit
    (rollout.retire is off by default for that reason). Not with cuda_graph (a graph's shapes are fixed).
    prompt_ids: B prompts, each (T_p,) torch.long CPU (or a sequence of ints, made a tensor here).
    Returns a Rollout with N = B * n_samples rows.
    """
    if n_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"generate: n_samples ({n_samples}) and max_new_tokens ({max_new_tokens}) "
                         "must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate: temperature must be >= 0 (0 = greedy), got {temperature}; "
                         f"top_p must be in (0, 1], got {top_p}")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("generate: empty prompt; every prompt needs at least one token")
    if eos_id is None or pad_id is None:
        raise ValueError(f"generate: eos_id={eos_id}, pad_id={pad_id}; pass the tokenizer's eos_token_id "
                         "(or [] to never stop early) and a pad id (set tokenizer.pad_token, e.g. to eos)")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"generate: unknown kv_cache {kv_cache!r}; choose one of {sorted(KV_CACHES)}")
    if cuda_graph and (sample_dtype is not None or kv_cache != "preallocated"):
        raise ValueError("generate: cuda_graph decodes the model's own weights in the preallocated KV cache; "
                         f"got sample_dtype={sample_dtype}, kv_cache={kv_cache!r}")
    pick = SAMPLERS["greedy" if temperature == 0 else "sample"]
    device = next(model.parameters()).device
    eos = torch.as_tensor(eos_id, dtype=torch.long, device=device).reshape(-1)  # int or list -> (E,)
    prompts = [as_ids(p) for p in prompt_ids]  # B x (T_p,) long: a prompt given as a tensor is that tensor
    rows = [p for p in prompts for _ in range(n_samples)]  # prompt-major: row b * n_samples + g
    N = len(rows)
    P = max(len(r) for r in rows)
    ids, prompt_mask = left_pad(rows, P, pad_id)
    # the attention mask of every step, preallocated: step t feeds one token and attends to P + t columns
    mask = torch.cat([prompt_mask, torch.ones((N, max_new_tokens), dtype=torch.long)], 1).to(device)
    ids = ids.to(device)
    pos = position_ids_from_mask(mask[:, :P])
    seeds = [int(s) for s in seed] if isinstance(seed, Sequence) else [int(seed)]
    if len(seeds) not in (1, len(prompt_ids)):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts; give one, or one per "
                         "prompt")
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    # inference mode: ~9% less CPU than no_grad for the decode's many small ops (measured on the bench Llama);
    # the returned tensors are copied out of it below, so callers may use them with autograd
    with torch.inference_mode():
        toks = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
        lens = torch.full((N,), max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        # share_prefill: the first of each prompt's rows, then its cache and logits to all of them
        first = torch.arange(0, N, n_samples, device=device) if share_prefill and n_samples > 1 else None
        start = _start_packed if sample_dtype is not None else _start_model
        logits, decode = start(model, ids, mask, pos, first, n_samples, kv_cache=kv_cache, lean=lean,
                               dtype=sample_dtype, cuda_graph=cuda_graph)
        retire = retire and decode.keep_rows is not None
        live = torch.arange(N, device=device)  # (A,): the rows in the decode batch, finished or not
        for t in range(max_new_tokens):
            u = uniforms(gens, N, device)[live]  # every row's draw, so retiring never shifts another's
            tok, lp = pick(logits.float(), temperature, top_p, u)
            was_done = done[live]
            tok = tok.masked_fill(was_done, pad_id)  # finished rows not yet retired decode pad, then dropped
            toks[live, t], logps[live, t] = tok, lp
            hit = ~was_done & torch.isin(tok, eos)
            lens[live[hit]] = t + 1
            done[live[hit]] = True
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            pos = pos[:, -1:] + 1
            going = ~done[live]
            if retire and len(live) - int(going.sum()) >= max(1, len(live) // 8):
                keep = going.nonzero()[:, 0]
                decode.keep_rows(keep)
                live, tok, pos = live[keep], tok[keep], pos[keep]
            logits = decode(tok, pos, P + t + 1)

    toks, logps, lens = toks.cpu(), logps.cpu(), lens.cpu()
    # each row a copy of its own, not a view of toks: a pickled row (dist.all_gather) carries only itself
    return Rollout(prompt_ids=rows, completion_ids=[toks[i, :lens[i]].clone() for i in range(N)],
                   logp=[logps[i, :lens[i]].clone() for i in range(N)], truncated=~done.cpu())


# Each start: (model, ids (N, P) left-padded, mask (N, P + new) the decode's attention mask, pos (N, P), first
# (M,) the rows to prefill with share_prefill (else None), n_samples, **options) -> (logits (N, V) of the
# first new token, a decode_step.Decode: step(tok (N,), pos (N, 1), n) -> logits (N, V) of the next).

def _start_model(model, ids, mask, pos, first, n_samples, *, kv_cache, lean, dtype, cuda_graph):
    """The model's own forward: the HF prefill into the kv_cache's cache, then decode_step's (lean or HF) or,
    with cuda_graph, graphed.graphed_step."""
    P = ids.shape[1]
    cache = KV_CACHES[kv_cache](model, mask.shape[1])
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    rows = slice(None) if first is None else first
    out = model(input_ids=ids[rows], attention_mask=mask[rows, :P], position_ids=pos[rows], use_cache=True,
                **with_cache(model, cache), **keep)
    logits = out.logits[:, -1]
    if first is not None:
        to_rows = torch.arange(len(first), device=ids.device).repeat_interleave(n_samples)  # (N,)
        cache_of(out).reorder_cache(to_rows)
        logits = logits.index_select(0, to_rows)
    if cuda_graph:
        return logits, Decode(graphed_step(model, cache_of(out), mask))
    return logits, decode_step(model, cache_of(out), mask, keep, lean)  # chosen once: lean or HF


def _start_packed(model, ids, mask, pos, first, n_samples, *, kv_cache, lean, dtype, cuda_graph):
    """packed.PackedLM in `dtype`: its own prefill and KV cache (kv_cache and lean do not apply)."""
    P = ids.shape[1]
    lm = PackedLM(model, rows=ids.shape[0], dtype=dtype)
    rows = slice(None) if first is None else first
    logits = lm.prefill(ids[rows], mask[rows, :P], pos[rows], capacity=mask.shape[1])
    if first is not None:
        to_rows = torch.arange(len(first), device=ids.device).repeat_interleave(n_samples)  # (N,)
        lm.select_rows(to_rows)
        logits = logits.index_select(0, to_rows)
    return logits, lm.stepper(mask)
