"""Token samplers of the decode (`SAMPLERS[name]`): greedy, and temperature / nucleus sampling by inverse CDF.

Each takes the next-token logits of N rows and one uniform per row, and returns the drawn token and the
log-probability it was drawn with (the behaviour logp the loss and the teacher rows' importance weights read).
`uniforms` draws those uniforms for every row of the decode, from one torch.Generator or one per prompt when
sampling seeds are per prompt (rollout.seed_scope = "prompt"); the decode hands a sampler the rows it still
decodes, so retiring a finished row never shifts another row's draws.
Not here: the decode loop (generate.generate), the forward (decode_step.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row of probs (N, V) (non-negative, each row's sum > 0, need not be 1) given one U(0, 1)
    draw per row u (N, 1) float64: (N,) long.

    Inverse-CDF sampling in float64: u scaled to the row sum, and the first token whose cumulative mass
    exceeds it. The same distribution as torch.multinomial(probs, 1), whose CPU kernel draws
    V exponentials per row (its without-replacement path): 8 x 1024 took 270 us there and 30 us here,
    8 x 49152 11.7 ms and 0.34 ms (1 thread, benchmarks in docs/benchmarks.md). A token of zero mass is
    never drawn: the first index whose CDF exceeds u has mass > 0, and a u that rounds up to the row sum
    takes the first index reaching it (also mass > 0)."""
    cdf = probs.double().cumsum(-1)  # (N, V)
    total = cdf[:, -1:].contiguous()  # (N, 1)
    tok = torch.searchsorted(cdf, u * total, right=True)  # (N, 1): first index with cdf > u
    return torch.minimum(tok, torch.searchsorted(cdf, total))[:, 0]


def _greedy(logits: Tensor, temperature: float, top_p: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """logits (N, V) fp32 -> token (N,), behaviour logp (N,): 0, the argmax is drawn with probability 1 (u
    unused)."""
    tok = logits.argmax(-1)
    return tok, torch.zeros(tok.shape, dtype=logits.dtype, device=logits.device)


def _sample(logits: Tensor, temperature: float, top_p: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """logits (N, V) fp32, u (N, 1) float64 U(0, 1) -> token (N,) drawn from softmax(logits / temperature)
    nucleus-truncated at top_p, and its behaviour logp (N,) under that same distribution (the nucleus
    renormalised)."""
    logp_all = F.log_softmax(logits / temperature, -1)  # (N, V)
    probs = logp_all.exp()
    if top_p < 1.0:
        # nucleus (Holtzman et al. 2019): keep the smallest prefix of sorted tokens with mass >= top_p
        sorted_p, idx = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill((sorted_p.cumsum(-1) - sorted_p) >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tok = inverse_cdf(probs, u)
    logp = logp_all.gather(-1, tok[:, None])[:, 0]
    return tok, (logp - probs.sum(-1).log()) if top_p < 1.0 else logp  # log(p / nucleus mass)


SAMPLERS: dict[str, Callable[[Tensor, float, float, Tensor], tuple[Tensor, Tensor]]] = {
    "greedy": _greedy, "sample": _sample,
}


def uniforms(gens: Sequence[torch.Generator], N: int, device: torch.device) -> Tensor:
    """(N, 1) float64 U(0, 1) draws, one per row of the decode: from one Generator, or the N rows split evenly
    over one per prompt (prompt-major), so a prompt's draws ignore the rows batched with it. Drawn for every
    row at every token, finished or not, so which rows are still decoding never changes a row's draw."""
    n = N // len(gens)
    return torch.cat([torch.rand((n, 1), dtype=torch.float64, generator=g, device=device) for g in gens])
