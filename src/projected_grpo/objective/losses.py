"""Token losses, KL estimators, loss aggregations, PPO pieces (GAE, value loss, entropy bonus, advantage
whitening, explained variance), DPO.

Pure tensor functions returning `(value, stats)` with stats detached. Token-level pieces return a
per-token loss `loss_tok (N, T)`; exactly one aggregation from `AGGREGATIONS` turns it into the scalar,
so a step's loss is `agg(surrogate + kl_coef * kl - ..., mask, denoms)`. Aggregations are written so
that summing their values over micro-batches gives the whole step's loss (gradient accumulation needs
no extra division): the step-wide counts come in through `Denominators`.
`logp_old` and `logp_ref` are always detached here: no gradient ever reaches them.
Formulas, papers and other frameworks' names: docs/losses.md. Not here: advantages (advantages.py),
log-probs/entropy from logits (logprobs.py), anything reading a config or a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Stats = dict[str, torch.Tensor]


# --- checks ---------------------------------------------------------------------------------------

def _check_mask(mask: torch.Tensor, shape: torch.Size, what: str) -> torch.Tensor:
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{what}: mask shape {tuple(mask.shape)} != loss/logp shape {tuple(shape)} (N, T)")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{what}: mask must hold only 0/1 (or be bool), got values outside {{0, 1}}")
    if not mask.any():
        raise ValueError(f"{what}: mask selects no tokens (all zero, shape {tuple(shape)}); "
                         "skip empty micro-batches in the loop instead of passing them here")
    return mask


def _check_same(what: str, **tensors: torch.Tensor) -> torch.Size:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{what}: shapes must match, got {shapes}")
    return next(iter(tensors.values())).shape


def zero_pad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x at real tokens, exactly 0 at padding.  x, mask: (N, T).  Not x * mask: padding may hold an
    inf (e.g. logp_old = -inf), and inf * 0 = nan would poison every sum over the row. This guards
    values only: a padded position whose loss overflows still gets a nan gradient through the
    nonlinearity that overflowed, so callers pad with finite values (pack.pad_right pads with 0)."""
    return torch.where(mask.bool(), x, x.new_zeros(()))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over tokens where mask is 1.  x, mask: (N, T).  Returns a 0-d tensor."""
    return zero_pad(x, mask).sum() / mask.to(x.dtype).sum()


# --- PPO-clip surrogate ---------------------------------------------------------------------------

def clip_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                   eps_low: float = 0.2, eps_high: float = 0.2) -> tuple[torch.Tensor, Stats]:
    """PPO-clip token loss (Schulman et al. 2017) with asymmetric eps (DAPO "clip-higher", Yu et al.
    2025, arXiv:2503.14476):  loss = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A), r = pi/pi_old per token.

    logp, logp_old, mask: (N, T); adv: (N,) per sequence or (N, T) per token.
    Returns loss_tok (N, T) (unmasked; the aggregation masks) and stats: clip/low_frac (r < 1-eps_low,
    A < 0), clip/high_frac (r > 1+eps_high, A > 0), clip/region_frac (either), ratio/mean, ratio/max, all
    masked token fractions/means.
    """
    shape = _check_same("clip_surrogate", logp=logp, logp_old=logp_old)
    _check_mask(mask, shape, "clip_surrogate")
    if adv.dim() == 1 and adv.shape[0] == shape[0]:
        adv = adv[:, None]  # (N, 1)
    elif tuple(adv.shape) != tuple(shape):
        raise ValueError(f"clip_surrogate: adv must be (N,)={shape[0]} or (N, T)={tuple(shape)}, "
                         f"got {tuple(adv.shape)}")
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"clip_surrogate: need 0 <= eps_low < 1 and eps_high >= 0, "
                         f"got eps_low={eps_low}, eps_high={eps_high}")
    adv = adv.detach()
    ratio = torch.exp(logp - logp_old.detach())  # (N, T)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)  # = -min(r A, clip(r) A)
    with torch.no_grad():
        r = ratio.detach()
        low = (r < 1.0 - eps_low) & (adv < 0)
        high = (r > 1.0 + eps_high) & (adv > 0)
        m = mask.bool()
        stats = {
            "clip/low_frac": masked_mean(low.float(), mask),
            "clip/high_frac": masked_mean(high.float(), mask),
            "clip/region_frac": masked_mean((low | high).float(), mask),
            "ratio/mean": masked_mean(r, mask), "ratio/max": r[m].max(),
        }
    return loss_tok, stats


# --- KL(pi || pi_ref) estimators, http://joschu.net/blog/kl-approx.html ---------------------------
# Uniform signature fn(logp, logp_ref, mask, *, logp_old=None) -> (kl_tok (N, T), stats), all (N, T), so
# the loop picks one by name. Tokens x ~ pi; r = pi_ref / pi, log r = logp_ref - logp.

KLResult = tuple[torch.Tensor, Stats]


def _log_r(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    shape = _check_same(what, logp=logp, logp_ref=logp_ref)
    _check_mask(mask, shape, what)
    return logp_ref.detach() - logp  # (N, T)


def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *,
          logp_old: torch.Tensor | None = None) -> KLResult:
    """k1 = -log r = logp - logp_ref (unbiased, high variance, can be negative)."""
    kl = -_log_r(logp, logp_ref, mask, "kl_k1")
    return kl, {"kl/mean": masked_mean(kl.detach(), mask)}


def kl_k2(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *,
          logp_old: torch.Tensor | None = None) -> KLResult:
    """k2 = (log r)^2 / 2 (biased, low variance, >= 0)."""
    kl = 0.5 * _log_r(logp, logp_ref, mask, "kl_k2") ** 2
    return kl, {"kl/mean": masked_mean(kl.detach(), mask)}


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *,
          logp_old: torch.Tensor | None = None) -> KLResult:
    """k3 = (r - 1) - log r (unbiased, low variance, >= 0; the KL term of GRPO and TRL)."""
    log_r = _log_r(logp, logp_ref, mask, "kl_k3")
    kl = torch.expm1(log_r) - log_r  # expm1 keeps r - 1 accurate near r = 1
    return kl, {"kl/mean": masked_mean(kl.detach(), mask)}


def kl_k3_ratio(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *,
                logp_old: torch.Tensor | None = None) -> KLResult:
    """Importance-weighted k3 for tokens sampled from pi_old: (pi / pi_old) * k3, the gradient flowing
    through the weight too (DeepSeek-V3.2 technical report, DeepSeek-AI 2025, sec. 3.1 "unbiased KL
    estimate", eq. 7). Under pi_old its mean is KL(pi || pi_ref) and its gradient is that KL's gradient,
    even at pi = pi_old, where plain k3's gradient is the *reverse* KL's. logp_old (N, T) required."""
    if logp_old is None:
        raise ValueError("kl_k3_ratio: logp_old (N, T) is required (importance weight pi/pi_old)")
    _check_same("kl_k3_ratio", logp=logp, logp_old=logp_old)
    log_r = _log_r(logp, logp_ref, mask, "kl_k3_ratio")
    w = torch.exp(logp - logp_old.detach())  # (N, T)
    kl = w * (torch.expm1(log_r) - log_r)
    return kl, {"kl/mean": masked_mean(kl.detach(), mask), "kl/is_weight_mean": masked_mean(w.detach(), mask)}


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k3_ratio": kl_k3_ratio}


# --- aggregations: (loss_tok (N, T), mask (N, T), denoms) -> (scalar, stats) ----------------------

@dataclass(frozen=True)
class Denominators:
    """Counts of the whole optimizer step's generation batch (all micro-batches together).

    n_seqs: sequences in the step (B * G, i.e. prompts_per_step * (G_s + G_t)); n_tokens: completion
    tokens (mask sum) in the step; const: Dr.GRPO's G * max_new_tokens * prompts_per_step.
    """

    n_seqs: int
    n_tokens: int
    const: float

    def __post_init__(self):
        if self.n_seqs < 1 or self.n_tokens < 1 or self.const <= 0:
            raise ValueError(f"Denominators must be positive, got {self}")

    @classmethod
    def for_step(cls, mask: torch.Tensor, *, group_size: int, max_new_tokens: int,
                 prompts_per_step: int) -> Denominators:
        """From the step's full mask (N, T) with N = prompts_per_step * group_size, T <= max_new_tokens."""
        N, T = mask.shape
        if N != prompts_per_step * group_size:
            raise ValueError(f"Denominators.for_step: mask has N={N} rows, expected prompts_per_step * "
                             f"group_size = {prompts_per_step} * {group_size} = "
                             f"{prompts_per_step * group_size}")
        if T > max_new_tokens:
            raise ValueError(f"Denominators.for_step: mask has T={T} > max_new_tokens={max_new_tokens}")
        const = float(group_size * max_new_tokens * prompts_per_step)
        n_tokens = int(mask.sum().item())
        if n_tokens == 0:  # the aggregations reject all-zero masks too: there is nothing to train on
            raise ValueError(f"Denominators.for_step: the step's mask (N={N}, T={T}) selects no tokens "
                             "(every completion is empty); skip the step")
        return cls(n_seqs=N, n_tokens=n_tokens, const=const)


def _agg_inputs(loss_tok, mask, denoms, what):
    _check_mask(mask, loss_tok.shape, what)
    if loss_tok.dim() != 2:
        raise ValueError(f"{what}: loss_tok must be (N, T), got {tuple(loss_tok.shape)}")
    m = mask.to(loss_tok.dtype)
    if loss_tok.shape[0] > denoms.n_seqs or m.sum().item() > denoms.n_tokens:
        raise ValueError(f"{what}: micro-batch ({loss_tok.shape[0]} seqs, {int(m.sum().item())} tokens) "
                         f"exceeds the step totals {denoms}; pass the whole step's Denominators")
    return m


def agg_grpo(loss_tok, mask, denoms: Denominators) -> tuple[torch.Tensor, Stats]:
    """GRPO (DeepSeekMath): per-sequence token mean, then mean over the step's n_seqs sequences:
    sum_i [sum_t m l / |y_i|] / n_seqs.  Empty rows contribute 0.  TRL "grpo", verl "seq-mean-token-mean"."""
    m = _agg_inputs(loss_tok, mask, denoms, "agg_grpo")
    per_seq = zero_pad(loss_tok, m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (N,)
    return per_seq.sum() / denoms.n_seqs, {"agg/tokens": m.sum().detach()}


def agg_bnpo(loss_tok, mask, denoms: Denominators) -> tuple[torch.Tensor, Stats]:
    """BNPO: token mean over this micro-batch, weighted by its share of the step's sequences
    (N_mb / n_seqs; = 1/accumulation_steps for equal micro-batches, as TRL "bnpo" does)."""
    m = _agg_inputs(loss_tok, mask, denoms, "agg_bnpo")
    value = zero_pad(loss_tok, m).sum() / m.sum() * (loss_tok.shape[0] / denoms.n_seqs)
    return value, {"agg/tokens": m.sum().detach()}


def agg_dapo(loss_tok, mask, denoms: Denominators) -> tuple[torch.Tensor, Stats]:
    """DAPO (Yu et al. 2025, arXiv:2503.14476) token-level loss: sum m l / n_tokens of the whole
    generation batch. TRL "dapo", verl "token-mean" (with global token count)."""
    m = _agg_inputs(loss_tok, mask, denoms, "agg_dapo")
    return zero_pad(loss_tok, m).sum() / denoms.n_tokens, {"agg/tokens": m.sum().detach()}


def agg_dr_grpo(loss_tok, mask, denoms: Denominators) -> tuple[torch.Tensor, Stats]:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): sum m l / (G * max_new_tokens * prompts_per_step).

    # Dr. GRPO: a constant normaliser removes the per-response 1/|y_i| length bias.
    TRL "dr_grpo", verl "seq-mean-token-sum-norm" (with loss_scale_factor = max_new_tokens)."""
    m = _agg_inputs(loss_tok, mask, denoms, "agg_dr_grpo")
    return zero_pad(loss_tok, m).sum() / denoms.const, {"agg/tokens": m.sum().detach()}


AGGREGATIONS = {"grpo": agg_grpo, "bnpo": agg_bnpo, "dapo": agg_dapo, "dr_grpo": agg_dr_grpo}


# --- PPO pieces: GAE, clipped value loss, entropy bonus --------------------------------

def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor, Stats]:
    """GAE(gamma, lambda) (Schulman et al. 2016, arXiv:1506.02438) over masked tokens:
    delta_t = r_t + gamma V_{t'} - V_t, A_t = delta_t + gamma lam A_{t'}, t' = next token with mask 1
    (V = 0, A = 0 after the last one). Masked-out tokens are skipped (as in verl), and get A = 0.

    rewards, values, mask: (N, T).  Returns adv (N, T), returns = adv + values (N, T), stats; all
    detached: they are regression targets and advantage weights, never differentiated through.
    """
    shape = _check_same("gae", rewards=rewards, values=values)
    _check_mask(mask, shape, "gae")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: need gamma, lam in [0, 1], got gamma={gamma}, lam={lam}")
    rewards, values, m = rewards.detach(), values.detach(), mask.to(values.dtype)
    N, T = shape
    next_value = torch.zeros(N, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * last
        adv[:, t] = a_t * m[:, t]
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)  # carry over masked tokens
        last = torch.where(m[:, t] > 0, a_t, last)
    returns = adv + values * m
    stats = {"adv/mean": masked_mean(adv, mask), "value/returns_mean": masked_mean(returns, mask)}
    return adv, returns, stats


def value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip_range: float = 0.2) -> tuple[torch.Tensor, Stats]:
    """PPO clipped value loss (Schulman et al. 2017 baselines / cleanrl):
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    values, values_old, returns, mask: (N, T).  Returns loss_tok (N, T) and stats value/clip_frac.
    """
    shape = _check_same("value_loss", values=values, values_old=values_old, returns=returns)
    _check_mask(mask, shape, "value_loss")
    if clip_range <= 0:
        raise ValueError(f"value_loss: clip_range must be > 0, got {clip_range}")
    v_old, ret = values_old.detach(), returns.detach()
    v_clip = v_old + torch.clamp(values - v_old, -clip_range, clip_range)
    unclipped, clipped = (values - ret) ** 2, (v_clip - ret) ** 2
    loss_tok = 0.5 * torch.maximum(unclipped, clipped)
    return loss_tok, {"value/clip_frac": masked_mean((clipped > unclipped).float(), mask),
                      "value/mean": masked_mean(values.detach(), mask)}


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, *, coef: float) -> tuple[torch.Tensor, Stats]:
    """Entropy bonus as a loss term: -coef * H_t (minimising it raises entropy).

    entropy, mask: (N, T) (entropy from logprobs.entropy_from_logits).  Returns loss_tok (N, T), stats.
    """
    _check_mask(mask, entropy.shape, "entropy_bonus")
    return -coef * entropy, {"entropy/mean": masked_mean(entropy.detach(), mask)}


def _masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool) -> torch.Tensor:
    m = mask.to(x.dtype)
    n = m.sum()
    var = zero_pad((x - masked_mean(x, mask)) ** 2, mask).sum() / n
    return var * n / (n - 1) if unbiased else var


def whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> tuple[torch.Tensor, Stats]:
    """(x - mean) / sqrt(var + eps) over the masked tokens, Bessel-corrected var, as TRL's `masked_whiten`
    whitens PPO's advantages; 0 at padding.  x, mask: (N, T) -> (N, T) detached, stats adv/raw_std."""
    _check_mask(mask, x.shape, "whiten")
    if int(mask.sum()) < 2:
        raise ValueError("whiten: needs at least 2 masked tokens for an unbiased variance")
    x = x.detach()
    var = _masked_var(x, mask, unbiased=True)
    return zero_pad((x - masked_mean(x, mask)) * torch.rsqrt(var + eps), mask), {"adv/raw_std": var.sqrt()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the masked tokens, population variances (cleanrl's PPO diagnostic):
    1 = the critic predicts the returns, 0 = no better than their mean, < 0 = worse.  NaN when Var(R) = 0
    (undefined).  values, returns, mask: (N, T) -> 0-d tensor, detached."""
    _check_same("explained_variance", values=values, returns=returns)
    _check_mask(mask, values.shape, "explained_variance")
    v, r = values.detach(), returns.detach()
    var_r = _masked_var(r, mask, unbiased=False)
    ev = 1.0 - _masked_var(r - v, mask, unbiased=False) / var_r.clamp_min(torch.finfo(r.dtype).tiny)
    return torch.where(var_r > 0, ev, torch.full_like(ev, float("nan")))


# --- DPO family from sequence log-probs (N,) of chosen / rejected ---------------------------------

def _dpo_margin(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, beta, what):
    _check_same(what, logp_chosen=logp_chosen, logp_rejected=logp_rejected,
                logp_ref_chosen=logp_ref_chosen, logp_ref_rejected=logp_ref_rejected)
    if logp_chosen.dim() != 1:
        raise ValueError(f"{what}: log-probs must be (N,) sequence log-probs, got {tuple(logp_chosen.shape)}")
    if beta <= 0:
        raise ValueError(f"{what}: beta must be > 0, got {beta}")
    h_c = logp_chosen - logp_ref_chosen.detach()  # (N,)
    h_r = logp_rejected - logp_ref_rejected.detach()
    stats = {"dpo/reward_chosen": beta * h_c.detach().mean(),
             "dpo/reward_rejected": beta * h_r.detach().mean(),
             "dpo/accuracy": (h_c > h_r).float().mean()}
    return h_c - h_r, stats


def dpo_sigmoid(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, *, beta: float = 0.1):
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): mean -log sigmoid(beta * h),
    h = (logp_c - logp_ref_c) - (logp_r - logp_ref_r).  All inputs (N,).  Returns (scalar, stats)."""
    h, stats = _dpo_margin(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, beta,
                           "dpo_sigmoid")
    return -F.logsigmoid(beta * h).mean(), stats


def dpo_ipo(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, *, beta: float = 0.1):
    """IPO (Azar et al. 2023, arXiv:2310.12036), tau = beta: mean (h - 1/(2 beta))^2.  Inputs (N,)."""
    h, stats = _dpo_margin(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, beta,
                           "dpo_ipo")
    return ((h - 1.0 / (2.0 * beta)) ** 2).mean(), stats


def dpo_hinge(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, *, beta: float = 0.1):
    """Hinge / SLiC (Zhao et al. 2023, arXiv:2305.10425), as TRL: mean relu(1 - beta * h).  Inputs (N,)."""
    h, stats = _dpo_margin(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, beta,
                           "dpo_hinge")
    return F.relu(1.0 - beta * h).mean(), stats


DPO_LOSSES = {"sigmoid": dpo_sigmoid, "ipo": dpo_ipo, "hinge": dpo_hinge}
