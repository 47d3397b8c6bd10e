"""Per-token log-probs and entropies from logits, chunked so no full fp32 (N, T, V) copy ever exists.

`log_softmax(logits.float()).gather(...)` allocates an fp32 (N, T, V) tensor (and keeps it for
backward): 4.9 GB for N*T = 8192 tokens at V = 151936. Here each chunk of token rows is upcast to fp32,
reduced (gather - logsumexp, or the entropy sum) and dropped; a custom autograd Function recomputes the
chunk's softmax in backward instead of saving it, so what is kept for backward is the logits themselves
(already alive) plus an fp32 (N, T) logsumexp. Inputs may be bf16/fp16/fp32; outputs are fp32.
Not here: the model forward, sampling, or any loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Default chunk: enough token rows that one fp32 chunk is ~4 MiB (2**20 floats), so a chunk's temporaries
# stay in cache from one op to the next and below glibc's mmap threshold (a fresh mapping, page-faulted in,
# per op otherwise): at SmolLM2's vocabulary, 16 x 31 tokens, forward + backward + entropy ~3x faster than
# with 128 MiB chunks, the same bits (benchmarks/logprob_chunk.py, docs/benchmarks.md).
CHUNK_ELEMENTS = 2**20


def _blocks(N: int, T: int, V: int, chunk: int | None) -> Iterator[tuple[slice, slice]]:
    """(n-slice, t-slice) views covering (N, T) with at most `chunk` token rows each.

    Slicing along N and T (not flattening) keeps the blocks views even for non-contiguous logits,
    e.g. `logits[:, :-1]`, where a flatten would copy the whole tensor.
    """
    rows = max(1, CHUNK_ELEMENTS // max(V, 1)) if chunk is None else chunk
    if rows < 1:
        raise ValueError(f"chunk must be >= 1 token rows, got {chunk}")
    if T <= rows:
        step_n = max(1, rows // max(T, 1))
        for n0 in range(0, N, step_n):
            yield slice(n0, min(N, n0 + step_n)), slice(0, T)
    else:
        for n0 in range(N):
            for t0 in range(0, T, rows):
                yield slice(n0, n0 + 1), slice(t0, min(T, t0 + rows))


def _tempered(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A block of logits as fp32 over the temperature: at temperature 1 no division (x / 1 is x, bit for bit),
    and for fp32 logits no copy, a pass over the block fewer each (the chunk is only read)."""
    x = chunk.float()
    return x if temperature == 1.0 else x / temperature


def _check(logits: torch.Tensor, what: str) -> None:
    if logits.dim() != 3:
        raise ValueError(f"{what}: logits must be (N, T, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{what}: logits must be floating point, got {logits.dtype}")


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk):
        N, T, V = logits.shape
        logp = torch.empty(N, T, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        for n, t in _blocks(N, T, V, chunk):
            x = _tempered(logits[n, t], temperature)  # (n, t, V) fp32, this chunk only
            lse[n, t] = torch.logsumexp(x, dim=-1)
            logp[n, t] = x.gather(-1, targets[n, t].unsqueeze(-1)).squeeze(-1) - lse[n, t]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp):
        logits, targets, lse = ctx.saved_tensors
        N, T, V = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(N, T, V, ctx.chunk):
            # d logp_y / d x_v = (1[v = y] - softmax(x)_v) / temperature
            p = torch.exp(_tempered(logits[n, t], ctx.temperature) - lse[n, t].unsqueeze(-1))  # (n, t, V)
            g = p.mul_(-grad_logp[n, t].unsqueeze(-1))  # -p * grad, in place: the same bits, a pass fewer
            g.scatter_add_(-1, targets[n, t].unsqueeze(-1), grad_logp[n, t].unsqueeze(-1).float())
            grad[n, t] = g if ctx.temperature == 1.0 else g / ctx.temperature  # cast to logits' dtype here
        return grad, None, None, None


def _p_times(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """p * x with 0 where p = 0: a -inf logit (a masked token) has p = 0 and counts 0, not 0 * -inf = nan."""
    return torch.where(p > 0, p * x, p.new_zeros(()))


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, chunk):
        N, T, V = logits.shape
        ent = torch.empty(N, T, dtype=torch.float32, device=logits.device)
        for n, t in _blocks(N, T, V, chunk):
            x = _tempered(logits[n, t], temperature)
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            p = torch.exp(x - lse)
            ent[n, t] = lse.squeeze(-1) - _p_times(p, x).sum(-1)  # H = lse - E_p[x]
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.chunk = temperature, chunk
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ent):
        (logits,) = ctx.saved_tensors
        N, T, V = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for n, t in _blocks(N, T, V, ctx.chunk):
            x = _tempered(logits[n, t], ctx.temperature)
            p = torch.softmax(x, dim=-1)
            mean_x = _p_times(p, x).sum(-1, keepdim=True)
            # dH/dx_v = -p_v (x_v - E_p[x]) / temperature
            g = -_p_times(p, x - mean_x) * grad_ent[n, t].unsqueeze(-1)
            grad[n, t] = (g / ctx.temperature).to(logits.dtype)
        return grad, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk: int | None = None) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], equal to `log_softmax(logits.float() / temperature,
    -1).gather(-1, targets[..., None])[..., 0]` (fp32 math), computed `chunk` token rows at a time.

    logits: (N, T, V) any float dtype; targets: (N, T) int64 in [0, V).  Returns logp (N, T) fp32,
    differentiable w.r.t. logits. chunk: token rows per fp32 block (default ~2**20 / V rows).
    """
    _check(logits, "token_logprobs")
    N, T, V = logits.shape
    if tuple(targets.shape) != (N, T):
        raise ValueError(f"token_logprobs: targets shape {tuple(targets.shape)} != logits (N, T) = {(N, T)}")
    if targets.dtype != torch.long:
        raise TypeError(f"token_logprobs: targets must be int64 token ids, got {targets.dtype}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= V):
        raise ValueError(f"token_logprobs: target ids must lie in [0, {V}), got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    return _TokenLogprob.apply(logits, targets, float(temperature), chunk)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk: int | None = None) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits / temperature), chunked like token_logprobs.

    logits: (N, T, V) any float dtype.  Returns (N, T) fp32, differentiable (for an entropy bonus).
    """
    _check(logits, "entropy_from_logits")
    if temperature <= 0:
        raise ValueError(f"entropy_from_logits: temperature must be > 0, got {temperature}")
    return _Entropy.apply(logits, float(temperature), chunk)
