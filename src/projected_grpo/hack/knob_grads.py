"""Per-pair knob gradients of the completion NLL: the raw material of V_hack (direction.py).

For every pair and label (hack, clean) we need the gradient, on the main knobs, of that one completion's
NLL. `pair_grads` gets them in batches: a chunk of sequences (both labels of several pairs) is packed,
one forward scores it, and ONE backward of Σ_sequences NLL_sequence yields each sequence's own gradient
through the knob adapters' per-sequence capture (split.py): sequences never mix inside the model, so
row n of the capture is exactly ∂NLL_n/∂knobs. tests/oracles.pair_grads_isolated (one forward +
backward per pair and label) is its test oracle. Both use `torch.autograd.grad`, so no .grad is
touched and extraction may run mid-training (train.py's online V refresh). A sequence that occurs in several
pairs (the same prompt and completion: V_hack's controls reuse the real pairs' completions) is computed once.
Deliberately not here: the SVD, orientation and storage of V_hack (direction.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from projected_grpo.hack.pairs import Pair, encode_pair
from projected_grpo.sampling.pack import pack
from projected_grpo.sampling.score import forward_logprobs

LABELS = ("hack", "clean")

# A chunk's activations for the backward, at most (docs/benchmarks.md [60]): SmolLM2-135M's per-pair gradients
# at 4096 tokens a chunk peaked at 10.8 GB RSS, at 1024 at 4.3 GB (and ran 1.3x faster). On a GPU a quarter of
# its memory instead.
CHUNK_BYTES_CPU = 2.5e9
MAX_CHUNK_TOKENS = 4096


def chunk_tokens_for(model) -> int:
    """The padded tokens a chunk may hold for `model`: MAX_CHUNK_TOKENS, fewer where an estimate of the
    backward's fp32 bytes per token (log-probs over the vocabulary ~4 copies, each layer's saved activations
    ~10 of the hidden width and ~5 of the MLP's, calibrated on SmolLM2: 2.4 MB a token estimated, 2.1-2.6
    measured) would pass the budget (CHUNK_BYTES_CPU; a quarter of the device's memory on a GPU). The
    organism's and the bench models' chunks stay at the maximum, and so does a model without a Hugging Face
    config giving those sizes. A chunk's size changes V_hack's per-pair gradients in the last bits (another
    batch shape; 2e-6 at most on SmolLM2), as the thread count does."""
    c = getattr(model, "config", None)
    text = getattr(c, "text_config", c)
    hidden, layers, vocab = (getattr(text, a, None)
                             for a in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if not (hidden and layers and vocab):
        return MAX_CHUNK_TOKENS
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    per_token = 4 * (4 * vocab + layers * (10 * hidden + 5 * inter))
    device = next(model.parameters()).device
    budget = (torch.cuda.get_device_properties(device).total_memory / 4 if device.type == "cuda"
              else CHUNK_BYTES_CPU)
    return int(max(1, min(MAX_CHUNK_TOKENS, budget // per_token)))


def _nll_mean(logp: Tensor, mask: Tensor, const: float) -> Tensor:
    return -(logp * mask).sum(-1) / mask.sum(-1)  # (N,) length-normalised


def _nll_constant(logp: Tensor, mask: Tensor, const: float) -> Tensor:
    # Dr.GRPO (Liu et al. 2025): token sum / a constant, the metric the dr_grpo training loss uses, so
    # V is not biased toward short completions as the per-completion mean is (docs/losses.md).
    return -(logp * mask).sum(-1) / const  # (N,)


# norm -> fn(logp (N, T), completion_mask (N, T), const) -> per-sequence NLL (N,)
NLL_NORMS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"mean": _nll_mean,
                                                                   "constant": _nll_constant}


def _sequences(tokenizer, pairs: Sequence[Pair]) -> list[tuple[int, str, Tensor, Tensor]]:
    """(pair index, label, prompt ids (T_p,), completion ids (T_c,)) for every pair, hack then clean: 2P
    rows."""
    if not pairs:
        raise ValueError("pair_grads: no pairs")
    out = []
    for i, pair in enumerate(pairs):
        prompt_ids, hack_ids, clean_ids = encode_pair(tokenizer, pair)
        out += [(i, "hack", prompt_ids, hack_ids), (i, "clean", prompt_ids, clean_ids)]
    return out


def _check_finite(nll: Tensor, seqs: Sequence[tuple], pairs: Sequence[Pair]) -> None:
    """Raise on the first non-finite NLL (N,), naming its pair and label; no pair is ever skipped."""
    bad = (~torch.isfinite(nll.detach())).nonzero().flatten().tolist()
    if bad:
        i, label = seqs[bad[0]][:2]
        raise FloatingPointError(f"pair {i} ({pairs[i].source or 'no source'}), {label} completion: NLL is "
                                 f"{nll[bad[0]].item()} ({len(bad)} non-finite in its chunk); fix or "
                                 "remove this pair")


def _not_on_graph(name: str) -> RuntimeError:
    return RuntimeError(f"pair_grads: knob {name} is not on the graph (called under knobs.zeroed()? zero "
                        "the knob values instead)")


def _split_labels(rows: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """rows[name] (2P, R), pairs interleaved hack, clean -> g_hack, g_clean: dict[name, (P, R)]."""
    return ({n: g[0::2].contiguous() for n, g in rows.items()},
            {n: g[1::2].contiguous() for n, g in rows.items()})


def _setup(model, knobs, tokenizer, pairs: Sequence[Pair], norm: str):
    """What both gradient methods start from: the NLL norm, the encoded sequences (hack, clean
    interleaved), module names with their main-knob parameters, the pad id and the model's device."""
    names = list(knobs.modules)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return (NLL_NORMS[norm], _sequences(tokenizer, pairs), names, [knobs.modules[n].delta for n in names],
            pad_id, next(model.parameters()).device)


def _chunks(order: list[int], lengths: list[int], max_seqs: int, max_tokens: int) -> list[list[int]]:
    """Consecutive runs of `order` with at most max_seqs sequences and max_tokens padded tokens (the longest
    length times the count: `order` is sorted by length, so the last one's), one sequence at least."""
    out: list[list[int]] = []
    for j in order:
        if out and len(out[-1]) < max_seqs and lengths[j] * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(j)
        else:
            out.append([j])
    return out


def sequence_grads(model, knobs, prompt_ids: Sequence[Tensor], completion_ids: Sequence[Tensor], pad_id: int,
                   norm: str = "mean", nll_const: float = 1.0, chunk_size: int = 32,
                   chunk_tokens: int | None = None, names: Sequence[str] = ()) -> dict[str, Tensor]:
    """Per module the knob gradient of each sequence's own completion NLL: name -> (N, R) fp32 CPU.

    Row n is ∂NLL_n/∂knobs.modules[name].delta of (prompt_ids[n] (T_p,), completion_ids[n] (T_c,), both
    torch.long) alone, at whatever values the knobs hold. Sequences are packed in chunks of at most
    chunk_size sequences and chunk_tokens padded tokens (one at least; None: chunk_tokens_for(model)),
    sorted by length so a chunk pads little; one backward of Σ_n NLL_n per chunk yields every row through the
    per-sequence capture (split.py). .grad is left untouched; the model runs in eval mode (no dropout). A
    non-finite NLL raises naming the row (`names[n]` when given).
    """
    chunk_tokens = chunk_tokens_for(model) if chunk_tokens is None else chunk_tokens
    if chunk_size < 1 or chunk_tokens < 1:
        raise ValueError(f"sequence_grads: chunk_size and chunk_tokens must be >= 1, got {chunk_size}, "
                         f"{chunk_tokens}")
    nll_fn, modules = NLL_NORMS[norm], list(knobs.modules)
    params, device = [knobs.modules[n].delta for n in modules], next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    rows = {n: torch.empty(len(lengths), knobs.modules[n].knob_dim) for n in modules}  # (N, R)
    order = sorted(range(len(lengths)), key=lambda j: (lengths[j], j))
    was_training = model.training
    model.eval()
    try:
        for idx in tqdm(_chunks(order, lengths, chunk_size, chunk_tokens), desc="per-sequence knob grads",
                        unit="chunk", file=sys.stderr, disable=None, leave=False):
            batch = pack([prompt_ids[j] for j in idx], [completion_ids[j] for j in idx], pad_id).to(device)
            every = torch.ones(len(idx), dtype=torch.bool)  # one source: only per_sequence is read
            with torch.enable_grad(), knobs.capture(every, per_sequence=True) as cap:
                logp, _ = forward_logprobs(model, batch)  # (n, T)
                nll = nll_fn(logp.float(), batch.completion_mask, nll_const)  # (n,)
                bad = (~torch.isfinite(nll.detach())).nonzero().flatten().tolist()
                if bad:
                    j = idx[bad[0]]
                    raise FloatingPointError(f"{names[j] if names else f'sequence {j}'}: NLL is "
                                             f"{nll[bad[0]].item()} ({len(bad)} non-finite in its chunk)")
                if not nll.requires_grad:
                    raise _not_on_graph(modules[0])
                # Σ_n NLL_n: sequences are independent, so capture row n is exactly ∂NLL_n/∂delta.
                # autograd.grad, not backward(): the capture hooks fire all the same and .grad stays as is.
                torch.autograd.grad(nll.sum(), params, allow_unused=True)
            for n in modules:
                if n not in cap.per_sequence:
                    raise _not_on_graph(n)
                rows[n][idx] = cap.per_sequence[n].detach().float().cpu()
    finally:
        model.train(was_training)
    return rows


def pair_grads(model, knobs, tokenizer, pairs: Sequence[Pair], norm: str = "mean", nll_const: float = 1.0,
               chunk_size: int = 32, chunk_tokens: int | None = None
               ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per module knob gradients of the completion NLL: g_hack[name], g_clean[name] (P, R) fp32 CPU.

    Row i is ∂NLL/∂knobs.modules[name].delta of pair i's hack (clean) completion alone, at whatever
    values the knobs hold (typically zero = the base model; not under knobs.zeroed(), which takes them
    off the graph). `knobs` must be an adapters.Knobs (its per-sequence capture is what batches this).
    Sequences are processed in chunks of at most chunk_size sequences and chunk_tokens padded tokens (one
    sequence at least; None: chunk_tokens_for(model)): that bounds activation memory also for a real model's
    long prompts (SmolLM2's V_hack peaked at 21.8 GB RSS with 32 sequences a chunk, 10.8 GB at 4096 tokens).
    Sorted by length so a chunk pads little.
    .grad of every parameter is left untouched; model in eval mode (no dropout) while it runs. A non-finite
    NLL raises naming the pair index and label, before any backward. Sequences repeated across pairs (same
    prompt ids and completion ids) are computed once and copied.
    """
    if chunk_size < 1 or (chunk_tokens is not None and chunk_tokens < 1):
        raise ValueError(f"pair_grads: chunk_size and chunk_tokens must be >= 1, got {chunk_size}, "
                         f"{chunk_tokens}")
    seqs = _sequences(tokenizer, pairs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    first: dict[tuple, int] = {}  # (prompt ids, completion ids) -> its first row
    source = [first.setdefault((tuple(s[2].tolist()), tuple(s[3].tolist())), j) for j, s in enumerate(seqs)]
    distinct = sorted(set(source))
    at = {j: k for k, j in enumerate(distinct)}  # a distinct sequence's row in sequence_grads' output
    names = [f"pair {seqs[j][0]} ({pairs[seqs[j][0]].source or 'no source'}), {seqs[j][1]} completion"
             for j in distinct]
    rows = sequence_grads(model, knobs, [seqs[j][2] for j in distinct], [seqs[j][3] for j in distinct],
                          pad_id, norm, nll_const, chunk_size, chunk_tokens, names)
    index = torch.tensor([at[j] for j in source])
    return _split_labels({n: r[index] for n, r in rows.items()})
