"""V checked before use: its held-out separation against the controls', with intervals.

The separation score of a V on one held-out pair (prompt, hack, clean) is the share of that pair's gradient
difference d = g_hack − g_clean, pooled over modules, that the one-sided gate would remove: sqrt(Σ_m
‖relu(V_m d_m)‖²) / sqrt(Σ_m ‖d_m‖²) (subspace.capture; the measure proj/cin applies to the training
gradient). Pairs of one prompt are not independent, so the pairs' scores are averaged per held-out prompt
and the prompts are the units: a V's score is the mean over held-out prompts with its t-interval, and the
real V against each control is the per-prompt paired difference with its t-interval and t-test, Holm-
adjusted over the controls compared (stats.py). The real V beats a control when its difference is positive
with Holm-adjusted p < stats.ALPHA; it passes the check when it beats every control that could be built.
Undecided (None) with fewer than 2 held-out prompts. docs/preregistration.md ("V checked before use") states
the rule.
`ordering` asks the same of the direction monitor's score of each held-out completion (monitors.py: the
completion's NLL gradient summed along V's rows, subspace.along): how well it ranks the held-out hacks above
the cleans, per V. Its unit is again the held-out prompt: the within-prompt AUC (each hack of a prompt
against each clean of it), t-interval over prompts, the real V against each control paired per prompt and
Holm-adjusted. Beside it the pooled AUC over every held-out completion, what a monitor's one threshold
faces across prompts, with a percentile interval from resampling whole prompts (stats.cluster_bootstrap),
and the balanced accuracy at the best cut of those same rows (optimistic: chosen on them).
Deliberately not here: extracting V or the controls (direction.py, controls.py), refusing a run
(resolve.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from projected_grpo import stats
from projected_grpo.hack.probe import auc, auc_interval, best_threshold
from projected_grpo.hack.subspace import capture

# the controls a real V is checked against, in the order they are printed (docs/preregistration.md)
CHECKED = ("random", "energy", "within", "shuffled", "nonhack")


def _per_prompt(values: Tensor, groups: Sequence[int]) -> dict[int, float]:
    """Mean of values (H,) per group id."""
    sums: dict[int, list[float]] = {}
    for v, g in zip(values.tolist(), groups):
        sums.setdefault(g, []).append(v)
    return {g: sum(vs) / len(vs) for g, vs in sums.items()}


def _interval(iv: stats.Interval) -> list:
    return [iv.mean, iv.lo, iv.hi]


def separation(D_held: Mapping[str, Tensor], groups: Sequence[int], real: Mapping[str, Tensor],
               controls: Mapping[str, Mapping[str, Tensor]], unavailable: Mapping[str, str] | None = None
               ) -> dict:
    """D_held[module] (H, R): held-out pair differences; groups: each pair's prompt id (H,); real and each
    control V: module -> (K, R). Returns a JSON-able record:
      n_pairs, n_prompts; scores: name -> [mean, lo, hi] ("real" and each control; lo, hi None under 2
      prompts);
      vs: control -> {diff: [mean, lo, hi] of real − control, p, p_holm, beats (None: undecided)};
      unavailable: control -> why it could not be built; passed: beats every control (None: undecided)."""
    H = len(groups)
    out = {"n_pairs": H, "n_prompts": len(set(groups)), "scores": {}, "vs": {},
           "unavailable": dict(unavailable or {}), "passed": None}
    if H == 0:
        return out
    per = {name: _per_prompt(capture(D_held, V), groups) for name, V in {"real": real, **controls}.items()}
    out["scores"] = {name: _interval(stats.t_interval(list(v.values()))) for name, v in per.items()}
    out["vs"], out["passed"] = _versus(per, list(controls))
    return out


def _versus(per: Mapping[str, Mapping[int, float]], controls: Sequence[str]) -> tuple[dict, bool | None]:
    """The real V against each control on per-prompt values (per[name]: prompt -> value): {control: {diff:
    [mean, lo, hi] of real − control, p, p_holm, beats}} with Holm over `controls`, and passed (beats every
    one; None: undecided or no control)."""
    names = [c for c in CHECKED if c in controls] + sorted(set(controls) - set(CHECKED))
    pairs = {c: stats.paired(per["real"], per[c]) for c in names}
    out = {}
    for c, p_holm in zip(names, stats.holm([pairs[c].p for c in names])):
        iv = pairs[c].interval
        beats = None if p_holm is None else bool(iv.mean > 0 and p_holm < stats.ALPHA)
        out[c] = {"diff": _interval(iv), "p": pairs[c].p, "p_holm": p_holm, "beats": beats}
    verdicts = [v["beats"] for v in out.values()]
    return out, (None if not verdicts or None in verdicts else all(verdicts))


def ordering(scores: Mapping[str, Tensor], labels: Tensor, groups: Sequence[int], seed: int = 0,
             n_boot: int = 2000) -> dict:
    """scores[name] (N,): a score of each of N held-out completions, high = hack-like ("real" and each
    control); labels (N,) bool, True for a hack; groups: each completion's prompt id (N,), every prompt
    holding both labels. Returns a JSON-able record:
      n_completions, n_prompts;
      auc: name -> {within: [mean, lo, hi] of the per-prompt AUCs (t-interval; lo, hi None under 2 prompts),
        pooled: [AUC, lo, hi] over all N (percentile interval of n_boot resamples of whole prompts, drawn
        with `seed`; None under 2 prompts), bacc: balanced accuracy at the pooled scores' best cut};
      vs: control -> {diff: [mean, lo, hi] of real − control within-prompt AUC, p, p_holm, beats};
      passed: the real V beats every control (None: undecided)."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        rows.setdefault(g, []).append(i)
    at = {g: torch.tensor(r) for g, r in rows.items()}
    if any(labels[r].all() or not labels[r].any() for r in at.values()):
        raise ValueError("ordering: every prompt needs a hack and a clean completion")
    out = {"n_completions": len(groups), "n_prompts": len(rows), "auc": {}, "vs": {}, "passed": None}
    per = {}
    for name, x in scores.items():
        x = x.double()
        per[name] = {g: auc(x[r], labels[r]) for g, r in at.items()}
        out["auc"][name] = {"within": _interval(stats.t_interval(list(per[name].values()))),
                            "pooled": auc_interval(x, labels, groups, seed, n_boot),
                            "bacc": best_threshold(x, labels)[1]}
    out["vs"], out["passed"] = _versus(per, [n for n in scores if n != "real"])
    return out


def _fmt(x: list) -> str:
    mean, lo, hi = x
    return f"{mean:.3f}" + ("" if lo is None else f" [{lo:.3f}, {hi:.3f}]")


def lines(check: Mapping) -> list[str]:
    """The check as printed by extract-direction, at a run's start and in reports: one line per V."""
    if not check or not check.get("n_pairs"):
        return ["V_hack held-out check: no held-out pairs (proj.heldout_frac 0, or a single prompt): "
                "V is used unchecked"]
    out = [f"V_hack held-out separation (one-sided capture of held-out hack − clean gradients, mean over "
           f"{check['n_prompts']} held-out prompts / {check['n_pairs']} pairs, 95% t-interval):",
           f"  real V      {_fmt(check['scores']['real'])}"]
    order = [c for c in CHECKED if c in check["vs"]] + sorted(set(check["vs"]) - set(CHECKED))
    for c in order:  # CHECKED order (a stored check comes back with its keys sorted)
        v = check["vs"][c]
        d = v["diff"]
        word = {True: "beats", False: "does NOT beat", None: "undecided vs"}[v["beats"]]
        p = "n/a" if v["p_holm"] is None else f"{v['p_holm']:.3g}"
        ci = "" if d[1] is None else f" [{d[1]:+.3f}, {d[2]:+.3f}]"
        out.append(f"  {c + ' V':<11} {_fmt(check['scores'][c])}; real − control {d[0]:+.3f}{ci}, Holm p "
                   f"{p}: real V {word} it")
    out += [f"  {c + ' V':<11} not built: {why}" for c, why in check.get("unavailable", {}).items()]
    return out


def verdict(check: Mapping) -> tuple[bool | None, str]:
    """(passed, one line): passed None when undecided."""
    if not check or not check.get("n_pairs"):
        return None, "V_hack unchecked (no held-out pairs)"
    failed = [c for c, v in check["vs"].items() if v["beats"] is False]
    undecided = [c for c, v in check["vs"].items() if v["beats"] is None]
    if failed:
        return False, (f"V_hack does NOT beat the {', '.join(failed)} control(s) on held-out pairs: its "
                       "separation of hack from clean is no better than theirs")
    if undecided or check["passed"] is None:
        return None, (f"V_hack check undecided ({', '.join(undecided) or 'no control'}: too few held-out "
                      "prompts)")
    return True, f"V_hack beats every control on held-out pairs ({', '.join(check['vs'])})"
