"""Token samplers of the decode (`SAMPLERS[name]`): greedy, and temperature / nucleus sampling by inverse CDF.

Each takes the next-token logits of N rows and returns the drawn token and the log-probability it was drawn
with (the behaviour logp the loss and the teacher rows' importance weights read). `draw` splits the rows
over one torch.Generator per prompt when sampling seeds are per prompt (rollout.seed_scope = "prompt").
Not here: the decode loop (generate.generate), the forward (decode_step.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def inverse_cdf(probs: Tensor, gen: torch.Generator) -> Tensor:
    """One token per row of probs (N, V) (non-negative, each row's sum > 0, need not be 1): (N,) long.

    Inverse-CDF sampling in float64: one uniform per row, u = U(0, 1) * row sum, and the first token whose
    cumulative mass exceeds u. The same distribution as torch.multinomial(probs, 1), whose CPU kernel draws
    V exponentials per row (its without-replacement path): 8 x 1024 took 270 us there and 30 us here,
    8 x 49152 11.7 ms and 0.34 ms (1 thread, benchmarks in docs/benchmarks.md). A token of zero mass is
    never drawn: the first index whose CDF exceeds u has mass > 0, and a u that rounds up to the row sum
    takes the first index reaching it (also mass > 0)."""
    cdf = probs.double().cumsum(-1)  # (N, V)
    total = cdf[:, -1:].contiguous()  # (N, 1)
    u = torch.rand(total.shape, dtype=torch.float64, generator=gen, device=probs.device) * total
    tok = torch.searchsorted(cdf, u, right=True)  # (N, 1): first index with cdf > u
    return torch.minimum(tok, torch.searchsorted(cdf, total))[:, 0]


def _greedy(logits: Tensor, temperature: float, top_p: float, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """logits (N, V) fp32 -> token (N,), behaviour logp (N,): 0, the argmax is drawn with probability 1."""
    tok = logits.argmax(-1)
    return tok, torch.zeros(tok.shape, dtype=logits.dtype, device=logits.device)


def _sample(logits: Tensor, temperature: float, top_p: float, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """logits (N, V) fp32 -> token (N,) drawn from softmax(logits / temperature) nucleus-truncated at top_p,
    and its behaviour logp (N,) under that same distribution (the nucleus renormalised)."""
    logp_all = F.log_softmax(logits / temperature, -1)  # (N, V)
    probs = logp_all.exp()
    if top_p < 1.0:
        # nucleus (Holtzman et al. 2019): keep the smallest prefix of sorted tokens with mass >= top_p
        sorted_p, idx = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill((sorted_p.cumsum(-1) - sorted_p) >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tok = inverse_cdf(probs, gen)
    logp = logp_all.gather(-1, tok[:, None])[:, 0]
    return tok, (logp - probs.sum(-1).log()) if top_p < 1.0 else logp  # log(p / nucleus mass)


SAMPLERS: dict[str, Callable[[Tensor, float, float, torch.Generator], tuple[Tensor, Tensor]]] = {
    "greedy": _greedy, "sample": _sample,
}


def draw(pick, logits: Tensor, temperature: float, top_p: float,
         gens: Sequence[torch.Generator]) -> tuple[Tensor, Tensor]:
    """pick's (token (N,), logp (N,)) over logits (N, V): from one Generator, or from one per prompt (the N
    rows split evenly over gens, prompt-major), so a prompt's draws ignore the rows batched with it."""
    if len(gens) == 1:
        return pick(logits, temperature, top_p, gens[0])
    parts = [pick(rows, temperature, top_p, g) for rows, g in zip(logits.chunk(len(gens)), gens)]
    return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])
