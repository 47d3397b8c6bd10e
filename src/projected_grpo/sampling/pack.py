"""Token ids in, padded tensors out: chat-formatted prompt ids, completion ids, and the packed layout.

`pack` lays out prompt + completion ids (prompts LEFT-padded, completions right-padded) for both
student rollouts and teacher pool rows, so teacher sequences come from stored ids and are never
re-tokenised from text. Every forward of the project (sampling's prefill, the scoring forward, the
prefix-shared forward, V_hack's pair gradients, the organism's warm-up) reads this one layout. Token ids
travel from sampling to here as (T,) torch.long CPU tensors (`as_ids`); the tokenizer helpers below return
the tokenizer's int lists, made tensors once where a prompt table is built. `length_buckets` splits rows into
like-length buckets that pad least (the prefix-shared scoring forward's rollout.buckets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# One sequence's token ids: a (T,) torch.long CPU tensor (a plain int sequence is accepted too, e.g. in tests)
Ids = Tensor | Sequence[int]

# --- token ids ---------------------------------------------------------------------------------


def as_ids(ids: Ids) -> Tensor:
    """`ids` as a (T,) torch.long CPU tensor: a tensor that already is one is returned itself (not a copy),
    so the rows that share a prompt share its tensor; an int sequence becomes a new one."""
    if isinstance(ids, Tensor) and ids.dtype == torch.long and ids.dim() == 1 and ids.device.type == "cpu":
        return ids
    out = torch.as_tensor(ids, dtype=torch.long).cpu()
    if out.dim() != 1:
        raise ValueError(f"token ids must be one sequence (1-D), got shape {tuple(out.shape)}")
    return out


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


def left_pad(rows: Sequence[Ids], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """(N, width) ids and mask with each row (T_i,) right-aligned (left padding)."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def pack(prompt_ids: Sequence[Ids], completion_ids: Sequence[Ids], pad_id: int) -> SeqBatch:
    """Lay out N (prompt (T_p,), completion (T_c,)) id rows as one SeqBatch (prompts left-, completions
    right-padded)."""
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
    p_ids, p_mask = left_pad(prompt_ids, P, pad_id)
    c_ids = torch.full((len(completion_ids), T), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completion_ids), T), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        c_ids[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        c_mask[i, :len(c)] = 1
    return SeqBatch(input_ids=torch.cat([p_ids, c_ids], 1), attention_mask=torch.cat([p_mask, c_mask], 1),
                    completion_mask=c_mask.float())


def pad_right(rows: Sequence[Sequence[float] | Tensor | None], T: int, value: float = 0.0) -> Tensor:
    """(N, T) float32 of per-token values (e.g. behaviour log-probs) aligned with SeqBatch.completion_mask; a
    None row (a template teacher row has no behaviour log-probs) is all `value`."""
    out = torch.full((len(rows), T), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        r = torch.as_tensor(r, dtype=torch.float32)
        if r.numel() > T:
            raise ValueError(f"pad_right: row {i} has {r.numel()} values but the batch is only T={T} wide")
        out[i, :r.numel()] = r
    return out


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(N, L) positions counting only attended tokens, so a left-padded row is scored as if unpadded."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def length_buckets(lens: Sequence[int], k: int) -> list[list[int]]:
    """The rows of lengths `lens` (N,) in at most k buckets of like length, so that padding each bucket to its
    own longest row costs the fewest padded positions, sum over buckets of |bucket| * its longest.

    Buckets are runs of the rows sorted by length (an optimal partition is one: moving a row to the bucket of
    its length neighbours never adds padding), found by dynamic programming over the sorted lengths, O(k N²);
    each bucket lists its rows in their original order, buckets from the shortest. k = 1 (or every length
    equal): one bucket of all rows in order. A bucket is never empty; fewer than k come back when more would
    not save a position."""
    N = len(lens)
    if k < 1 or N == 0:
        raise ValueError(f"length_buckets: need k >= 1 and at least one row, got k={k}, {N} rows")
    if k == 1 or len(set(lens)) == 1:
        return [list(range(N))]
    order = sorted(range(N), key=lambda i: (lens[i], i))
    L = [lens[i] for i in order]  # ascending: a bucket of sorted rows a..b-1 costs (b - a) * L[b - 1]
    INF = float("inf")
    # best[j][b]: least cost of the first b sorted rows in j buckets; cut[j][b]: where the last bucket starts
    best = [[INF] * (N + 1) for _ in range(k + 1)]
    cut = [[0] * (N + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for b in range(1, N + 1):
            for a in range(j - 1, b):
                c = best[j - 1][a] + (b - a) * L[b - 1]
                if c < best[j][b]:  # strict: among equal costs the fewest buckets, the earliest cuts
                    best[j][b], cut[j][b] = c, a
    j = min(range(1, k + 1), key=lambda j: (best[j][N], j))
    bounds, b = [], N
    while j > 0:
        a = cut[j][b]
        bounds.append((a, b))
        b, j = a, j - 1
    return [sorted(order[a:b]) for a, b in reversed(bounds)]
