"""A linear probe on the policy's hidden state: features, the logistic fit, its threshold, AUC.

The `probe` monitor (monitors.py) scores a rollout by a logistic regression on one layer's hidden state,
averaged over the completion's tokens, fitted once before training on labelled (hack / not hack)
completions of prompts the run does not train on (docs/interventions.md). Here:
  hidden_features   (N, D) mean hidden state at a layer over each completion's tokens: one no-grad forward
  fit_logistic      L2-regularised logistic regression by Newton's method in float64 on standardised
                    features: deterministic, no learning rate, no seed (a library would do too; none of the
                    project's dependencies has one, and it is 20 lines)
  best_threshold    the cut of held-out scores with the best balanced accuracy
  auc               the held-out ROC AUC (Mann-Whitney, ties count half)
  auc_interval      the AUC with a percentile interval from resampling whole prompts (stats.cluster_bootstrap)
  split_groups      fit / held-out rows by whole prompt (seeded)
Shapes: N rows, D hidden size, T completion tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from projected_grpo import stats
from projected_grpo.sampling.pack import SeqBatch, position_ids_from_mask
from projected_grpo.sampling.score import accepts_logits_to_keep


@torch.no_grad()
def hidden_features(model, batch: SeqBatch, layer: int) -> Tensor:
    """(N, D) float32: hidden_states[layer] (0 = embeddings, n_layers = the last; negatives from the end)
    averaged over each row's completion tokens (the last T columns of the packed layout, masked).
    One forward with output_hidden_states; only the last position's logits are made where the model allows."""
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False,
                output_hidden_states=True, **keep)
    n = len(out.hidden_states)
    if not -n <= layer < n:
        raise IndexError(f"layer {layer}: the model has hidden states 0..{n - 1} (0 the embeddings)")
    h = out.hidden_states[layer][:, -batch.T:].float()  # (N, T, D)
    m = batch.completion_mask.to(h.device)[..., None]  # (N, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


@dataclass(frozen=True)
class LinearProbe:
    """logit(x) = ((x - mean) / std) @ w + b, for features x (N, D)."""

    mean: Tensor
    std: Tensor
    w: Tensor
    b: Tensor

    def logits(self, x: Tensor) -> Tensor:
        """(N,) float32 logits of features x (N, D)."""
        z = (x.double().to(self.w.device) - self.mean) / self.std
        return (z @ self.w + self.b).float()


def fit_logistic(x: Tensor, y: Tensor, l2: float, iters: int = 100, tol: float = 1e-10) -> LinearProbe:
    """L2-regularised logistic regression of labels y (N,) bool on features x (N, D), by Newton's method.

    Features are standardised with the fit rows' mean and std (a constant feature's std is taken as 1);
    loss = mean_n [log(1 + e^z_n) - y_n z_n] + l2 / 2 * ||w||^2 (the bias is not penalised), so separable
    rows (templates usually are) still give finite weights. float64 throughout; stops when the Newton step's
    norm is below tol, or after iters steps.
    """
    if x.dim() != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"fit_logistic: need x (N, D) and y (N,); got {tuple(x.shape)}, {tuple(y.shape)}")
    if l2 <= 0:
        raise ValueError(f"fit_logistic: l2 must be > 0 (separable rows have no finite optimum), got {l2}")
    if y.all() or not y.any():
        raise ValueError("fit_logistic: the fit rows need both labels")
    x = x.double()
    mean, std = x.mean(0), x.std(0, correction=0)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))
    z = torch.cat([(x - mean) / std, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # (N, D + 1): bias column
    t = y.double()
    reg = torch.full((z.shape[1],), l2, dtype=x.dtype)
    reg[-1] = 0.0
    theta = torch.zeros(z.shape[1], dtype=x.dtype)
    for _ in range(iters):
        p = torch.sigmoid(z @ theta)  # (N,)
        grad = z.T @ (p - t) / len(t) + reg * theta
        hess = (z.T * (p * (1 - p))) @ z / len(t) + torch.diag(reg)
        step = torch.linalg.solve(hess, grad)
        theta = theta - step
        if float(step.norm()) < tol:
            break
    return LinearProbe(mean, std, theta[:-1], theta[-1])


def best_threshold(scores: Tensor, labels: Tensor) -> tuple[float, float]:
    """(threshold, balanced accuracy): flag = score > threshold, the cut with the best balanced accuracy
    (mean of the hit rates on each label) over the midpoints between adjacent distinct scores and the two
    ends; among equals the highest, the one that flags fewest rows: where no cut beats chance (the rows
    anti-ordered) the monitor flags nothing rather than everything. scores (N,), labels (N,) bool with both
    labels present."""
    if labels.all() or not labels.any():
        raise ValueError("best_threshold: the rows need both labels")
    s = scores.double()
    u = torch.unique(s)  # sorted
    cuts = torch.cat([u[:1] - 1, (u[1:] + u[:-1]) / 2, u[-1:] + 1])  # (C,)
    flags = s[None, :] > cuts[:, None]  # (C, N)
    tpr = (flags & labels).sum(1) / labels.sum()
    tnr = (~flags & ~labels).sum(1) / (~labels).sum()
    bacc = (tpr + tnr) / 2
    i = int((bacc == bacc.max()).nonzero().max())  # the last maximum: the highest cut
    return float(cuts[i]), float(bacc[i])


def auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC: P(score of a positive > score of a negative), ties counting 1/2. scores (N,), labels (N,)."""
    if labels.all() or not labels.any():
        raise ValueError("auc: the rows need both labels")
    pos, neg = scores[labels].double(), scores[~labels].double()
    return float(((pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()).mean())


def auc_interval(scores: Tensor, labels: Tensor, groups: Sequence, seed: int = 0, n: int = 2000
                 ) -> list[float | None]:
    """[AUC, lo, hi] of scores (N,) against labels (N,) bool, the interval (stats.LEVEL, percentile) from n
    resamples of whole groups (prompts: rows of one prompt are not independent) drawn with `seed`; lo, hi
    None under 2 groups. A resample whose rows lack a label (a group may hold one label only) counts as
    AUC 0.5, chance: the interval widens rather than drops it."""
    ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    at = [torch.tensor([j for j, g in enumerate(groups) if ids[g] == i]) for i in range(len(ids))]

    def pooled(drawn: list[int]) -> float:
        r = torch.cat([at[i] for i in drawn])
        return 0.5 if labels[r].all() or not labels[r].any() else auc(scores[r], labels[r])

    ci = stats.cluster_bootstrap(list(range(len(at))), pooled, n, seed) if len(at) > 1 else (None, None)
    return [auc(scores, labels), *ci]


def split_groups(groups: Sequence[str], heldout_frac: float, seed: int) -> tuple[list[int], list[int]]:
    """(fit rows, held-out rows): the distinct groups (prompts) shuffled with `seed`, the last
    ceil-ish round(heldout_frac * groups) of them (one at least, one left to fit) held out whole."""
    distinct = sorted(set(groups))
    if len(distinct) < 2:
        raise ValueError(f"split_groups: need 2 prompts at least to hold one out, got {len(distinct)}")
    random.Random(seed).shuffle(distinct)
    n_held = min(len(distinct) - 1, max(1, round(heldout_frac * len(distinct))))
    held = set(distinct[len(distinct) - n_held:])
    return [i for i, g in enumerate(groups) if g not in held], [i for i, g in enumerate(groups) if g in held]
