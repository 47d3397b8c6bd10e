"""Batched sampling and per-token log-probs: the one way token sequences are built and scored.

`pack` lays out prompt + completion ids (prompts LEFT-padded, completions right-padded) for both
student rollouts and teacher pool rows, so teacher sequences come from stored ids and are never
re-tokenised from text. `generate` samples all prompts x n_samples in one batch with an attention
mask (the seed had none), stops each row at EOS, and returns the behaviour log-probs it sampled
under. `sample_and_grade` is the one path from a model to graded completions (sample, decode, grade
through the environment): students, the deployed view, evals, teacher pools and organism checks use
it, and its `Sample` is the one record of a completion in a group (teacher pool rows become Samples too).
`forward_logprobs` is the packed scoring forward (the training step's when rollout.share_prefix is off;
prefix.py shares each group's prompt otherwise). `step_seed` derives sampling seeds from
(base_seed, step, ...) stably across processes. The decode's KV caches are in kv_cache.py, its
per-token step (a lean one for Llama/Qwen2, else the HF forward) in decode_step.py, its token samplers in
sampling.py.

Not here: the grading itself (envs/), advantages, the teacher pool's storage (pool.py), any optimisation.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo.envs.base import Graded
from projected_grpo.objective.logprobs import entropy_from_logits, token_logprobs
from projected_grpo.run.decode_step import decode_step
from projected_grpo.run.kv_cache import KV_CACHES
from projected_grpo.run.sampling import SAMPLERS, draw

# --- token ids ---------------------------------------------------------------------------------


def encode_prompt(tokenizer, messages: list[dict], **chat_template_kwargs) -> list[int]:
    """Chat-formatted prompt ids ending with the assistant generation header.

    Uses the tokenizer's own chat template (`add_generation_prompt=True`), so the ids are exactly what
    the model sees at deployment. Extra keyword arguments go to the template (e.g. Qwen3's
    `enable_thinking=False`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '?')!r}) has no chat "
            "template; set tokenizer.chat_template (a Jinja string) or use a chat model's tokenizer")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, **chat_template_kwargs)
    return [int(i) for i in ids]


def prompt_text_and_ids(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """The chat-formatted prompt (text, ids) exactly as training encodes it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, encode_prompt(tokenizer, messages)


def encode_completion(tokenizer, text: str, eos: bool = True) -> list[int]:
    """Completion ids for `text`: no special tokens added, then `tokenizer.eos_token_id` when `eos`.

    The closing token is `tokenizer.eos_token_id` (for chat models such as Qwen this is the end-of-turn
    `<|im_end|>`), the same id `generate` is normally given as `eos_id`, so a teacher completion ends
    exactly as a finished student completion does.
    """
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if eos:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos_token_id; set "
                             "tokenizer.eos_token or call encode_completion(..., eos=False)")
        ids.append(int(tokenizer.eos_token_id))
    return ids


# --- packing -----------------------------------------------------------------------------------


@dataclass
class SeqBatch:
    """N prompt+completion sequences of length L = P + T (P = longest prompt, T = longest completion).

    input_ids       (N, L) long: prompt left-padded in the first P columns, completion right-padded
                    in the last T columns.
    attention_mask  (N, L) long: 1 on real prompt and completion tokens, 0 on padding.
    completion_mask (N, T) float: 1 on real completion tokens (the last T columns), 0 on padding.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor

    @property
    def T(self) -> int:
        """Completion width: the last T columns of input_ids hold the completions."""
        return self.completion_mask.shape[1]

    def to(self, device: torch.device | str) -> SeqBatch:
        return SeqBatch(self.input_ids.to(device), self.attention_mask.to(device),
                        self.completion_mask.to(device))


def _left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """(N, width) ids and mask with each row right-aligned (left padding)."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def pack(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
         pad_id: int) -> SeqBatch:
    """Lay out N (prompt, completion) id lists as one SeqBatch (prompts left-, completions right-padded)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"pack: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if not prompt_ids:
        raise ValueError("pack: no sequences")
    if pad_id is None:
        raise ValueError("pack: pad_id is None; set tokenizer.pad_token (e.g. to its eos token)")
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if len(p) == 0 or len(c) == 0:
            raise ValueError(f"pack: row {i} has an empty {'prompt' if len(p) == 0 else 'completion'}; every "
                             "row needs >= 1 prompt token and >= 1 completion token (the EOS at least)")
    P = max(len(p) for p in prompt_ids)
    T = max(len(c) for c in completion_ids)
    p_ids, p_mask = _left_pad(prompt_ids, P, pad_id)
    c_ids = torch.full((len(completion_ids), T), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completion_ids), T), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        c_ids[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        c_mask[i, :len(c)] = 1
    return SeqBatch(input_ids=torch.cat([p_ids, c_ids], 1), attention_mask=torch.cat([p_mask, c_mask], 1),
                    completion_mask=c_mask.float())


def pad_right(rows: Sequence[Sequence[float] | Tensor], T: int, value: float = 0.0) -> Tensor:
    """(N, T) float32 of per-token values (e.g. behaviour log-probs) aligned with SeqBatch.completion_mask."""
    out = torch.full((len(rows), T), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.float32)
        if r.numel() > T:
            raise ValueError(f"pad_right: row {i} has {r.numel()} values but the batch is only T={T} wide")
        out[i, :r.numel()] = r
    return out


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(N, L) positions counting only attended tokens, so a left-padded row is scored as if unpadded."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- sampling ----------------------------------------------------------------------------------


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

    prompt_ids     list of N prompt id lists (prompt b repeated n_samples times).
    completion_ids list of N id lists: EOS included when emitted, nothing after it.
    logp           list of N float32 CPU tensors (len(completion_ids[i]),): behaviour log-prob of each
                   sampled token under the distribution it was drawn from, as importance weights need
                   it (pool.teacher_importance): log_softmax(logits / temperature) renormalised over
                   the top-p nucleus; 0 for greedy (temperature 0: drawn with probability 1). With
                   top_p = 1 it matches forward_logprobs(..., temperature) on the same policy.
    truncated      (N,) bool: hit max_new_tokens without emitting EOS.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logp: list[Tensor]
    truncated: Tensor

    def batch(self, pad_id: int) -> SeqBatch:
        return pack(self.prompt_ids, self.completion_ids, pad_id)


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def generate(model, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | Sequence[int],
             eos_id: int | Sequence[int], pad_id: int, kv_cache: str = "preallocated",
             share_prefill: bool = False, lean: bool = True) -> Rollout:
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
    Returns a Rollout with N = len(prompt_ids) * n_samples rows.
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
    pick = SAMPLERS["greedy" if temperature == 0 else "sample"]
    device = next(model.parameters()).device
    eos = torch.as_tensor(eos_id, dtype=torch.long, device=device).reshape(-1)  # int or list -> (E,)
    rows = [list(p) for p in prompt_ids for _ in range(n_samples)]  # prompt-major: row b * n_samples + g
    N = len(rows)
    P = max(len(r) for r in rows)
    ids, prompt_mask = _left_pad(rows, P, pad_id)
    # the attention mask of every step, preallocated: step t feeds one token and attends to P + t columns
    mask = torch.cat([prompt_mask, torch.ones((N, max_new_tokens), dtype=torch.long)], 1).to(device)
    ids = ids.to(device)
    pos = position_ids_from_mask(mask[:, :P])
    seeds = [int(s) for s in seed] if isinstance(seed, Sequence) else [int(seed)]
    if len(seeds) not in (1, len(prompt_ids)):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts; give one, or one per "
                         "prompt")
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}

    # inference mode: ~9% less CPU than no_grad for the decode's many small ops (measured on the bench Llama);
    # the returned tensors are copied out of it below, so callers may use them with autograd
    with torch.inference_mode():
        toks = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
        lens = torch.full((N,), max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        cache = KV_CACHES[kv_cache](model, P + max_new_tokens)
        if share_prefill and n_samples > 1:  # the first of each prompt's rows, then its cache to all of them
            first = torch.arange(0, N, n_samples, device=device)
            out = model(input_ids=ids[first], attention_mask=mask[first, :P], position_ids=pos[first],
                        past_key_values=cache, use_cache=True, **keep)
            to_rows = torch.arange(len(first), device=device).repeat_interleave(n_samples)  # (N,)
            out.past_key_values.reorder_cache(to_rows)
            logits = out.logits[:, -1].index_select(0, to_rows)
        else:
            out = model(input_ids=ids, attention_mask=mask[:, :P], position_ids=pos, past_key_values=cache,
                        use_cache=True, **keep)
            logits = out.logits[:, -1]
        step = decode_step(model, out.past_key_values, mask, keep, lean)  # chosen once: lean or HF
        for t in range(max_new_tokens):
            tok, lp = draw(pick, logits.float(), temperature, top_p, gens)
            tok = tok.masked_fill(done, pad_id)  # finished rows keep decoding pad; their outputs are dropped
            toks[:, t], logps[:, t] = tok, lp
            hit = ~done & torch.isin(tok, eos)
            lens[hit] = t + 1
            done |= hit
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            pos = pos[:, -1:] + 1
            logits = step(tok, pos, P + t + 1)

    toks, logps, lens = toks.cpu(), logps.cpu(), lens.cpu()
    return Rollout(prompt_ids=rows, completion_ids=[toks[i, :lens[i]].tolist() for i in range(N)],
                   logp=[logps[i, :lens[i]].clone() for i in range(N)], truncated=~done.cpu())


# --- sample -> decode -> grade: the one path -----------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One graded completion of a group, student or teacher: what the loss packs and the metrics count.

    prompt_ids / completion_ids: token ids exactly as packed (EOS included when emitted or stored).
    text: the decoded completion the environment graded. logp_behaviour: per completion token, the
    log-prob it was sampled under (None for template teacher rows). truncated: hit max_new_tokens.
    student: sampled live by the policy (False: a frozen teacher pool row).
    """

    problem_id: str
    mode: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logp_behaviour: list[float] | None
    truncated: bool
    student: bool
    grade: Graded


def sample_and_grade(model, tokenizer, env, problems: Sequence, prompt_ids: Mapping[str, list[int]],
                     n_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                     seed: int | Sequence[int], clock: dict[str, float] | None = None,
                     share_prefill: bool = False) -> list[Sample]:
    """Sample `n_samples` completions of every problem in one batch, decode, grade with `env`.

    Returns B * n_samples Samples, prompt-major (problem b's samples are rows b * n .. b * n + n - 1).
    seed: one for the batch, or one per problem (generate).
    The caller chooses the model's view (knobs.merged() / ablate_quarantine()) and no_grad. `clock`, when
    given, accumulates seconds under "generate" and "grade". share_prefill: generate's.
    """
    t0 = time.perf_counter()
    ro = generate(model, [prompt_ids[p.id] for p in problems], n_samples, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, seed=seed, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, share_prefill=share_prefill)
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
    owners = [p for p in problems for _ in range(n_samples)]
    grades = env.grade(texts, owners)
    if clock is not None:
        clock["generate"] = clock.get("generate", 0.0) + t1 - t0
        clock["grade"] = clock.get("grade", 0.0) + time.perf_counter() - t1
    return [Sample(problem_id=p.id, mode=p.mode, prompt_ids=ro.prompt_ids[i],
                   completion_ids=ro.completion_ids[i], text=texts[i], logp_behaviour=ro.logp[i].tolist(),
                   truncated=bool(ro.truncated[i]), student=True, grade=grades[i])
            for i, p in enumerate(owners)]


# --- scoring -----------------------------------------------------------------------------------


def completion_logits(model, batch: SeqBatch) -> Tensor:
    """(N, T, V) logits predicting the T completion tokens, from one forward over (N, L).

    Only the last T + 1 positions are materialised (`logits_to_keep`, when the model supports it);
    the final position predicts past the sequence and is dropped.
    """
    T = batch.T
    keep = {"logits_to_keep": T + 1} if _accepts_logits_to_keep(model) else {}
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
