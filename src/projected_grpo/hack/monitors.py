"""Monitors: a score in [0, 1] and a flag per rollout, from only what each monitor is allowed to read.

A monitor sees a step's rollouts as `Rollouts`: token ids always, and from the grades only what it names in
`reads` ("oracle": the ground truth's exploited flag; "detectors": the environment's hack detectors).
`view` builds that object from the step's Samples, so the probe and direction monitors (reads = {}) never
receive a grade: the no-cheat rule (docs/architecture.md) holds by construction, and
tests/test_monitors.py checks it with grades that raise when read. `labels` says what the monitor needs
labelled at train time (docs/interventions.md):
  ground_truth  the oracle's exploited flag (an upper bound)                           per-sample
  degraded      the oracle's flag, each flipped with probability 1 - monitor.accuracy  per-sample
  detector      any of the environment's hack detectors (coding: E, C, D; maths: hedge) per-sample
  probe         a logistic probe on one layer's hidden state (hack/probe.py), fitted   per-sample (other
                before training on labelled completions of prompts the run does not    prompts)
                train on, its threshold from their held-out rows
  direction     V_hack's own score: the rollout's per-sequence NLL gradient on the     pairs
                knobs (hack/knob_grads.sequence_grads) projected on V_hack's rows and
                summed, thresholded each step on V_hack's held-out pairs scored alike
`MONITORS[name](MonitorInputs)` builds one; a monitor the environment cannot serve is refused in one line.
Shapes: N rollouts.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from projected_grpo import config as C
from projected_grpo.errors import UserError
from projected_grpo.hack import knob_grads, pairs, probe, resolve
from projected_grpo.hack.subspace import along
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.pack import as_ids, encode_completion, encode_prompt, pack
from projected_grpo.sampling.sample import Sample

Scored = tuple[Tensor, Tensor, dict[str, float]]  # scores (N,) float32 in [0, 1], flags (N,) bool, stats


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, eq=False)
class Rollouts:
    """N rollouts as a monitor sees them. rows: each one's index in the step (b * G + g over the global
    batch), so per-row draws do not depend on how the step is sharded. prompt_ids / completion_ids: the
    samples' own (T_p,) / (T_c,) torch.long tensors. oracle / detectors: per rollout the ground truth's
    exploited flag / the environment's detector flags, or None for a monitor that does not read them."""

    step: int
    rows: tuple[int, ...]
    prompt_ids: tuple[Tensor, ...]
    completion_ids: tuple[Tensor, ...]
    oracle: tuple[bool, ...] | None = None
    detectors: tuple[Mapping[str, bool], ...] | None = None

    def __len__(self) -> int:
        return len(self.rows)


def view(samples: Sequence[Sample], reads: frozenset[str], step: int, rows: Sequence[int]) -> Rollouts:
    """The Rollouts of `samples` for a monitor reading `reads`: a grade is touched only for those fields."""
    unknown = set(reads) - {"oracle", "detectors"}
    if unknown:
        raise ValueError(f"view: unknown reads {sorted(unknown)}")
    return Rollouts(step, tuple(rows), tuple(s.prompt_ids for s in samples),
                    tuple(s.completion_ids for s in samples),
                    tuple(bool(s.grade.exploited) for s in samples) if "oracle" in reads else None,
                    tuple(dict(s.grade.extras) for s in samples) if "detectors" in reads else None)


class Monitor(abc.ABC):
    """Base of the monitors: name, reads, labels, report (what the build measured, for monitor.json) and
    score(rollouts) -> (scores (N,) in [0, 1], flags (N,) bool, stats)."""

    name = ""
    reads: frozenset[str] = frozenset()
    labels = ""
    report: dict = {}

    @abc.abstractmethod
    def score(self, r: Rollouts) -> Scored:
        """(scores (N,) in [0, 1], flags (N,) bool, detached stats) of the step's rollouts."""


class GroundTruth(Monitor):
    name, reads, labels = "ground_truth", frozenset({"oracle"}), "per-sample"

    def score(self, r: Rollouts) -> Scored:
        flags = torch.tensor(r.oracle, dtype=torch.bool)
        return flags.float(), flags, {}


class Degraded(Monitor):
    """The oracle's flag, flipped where a seeded uniform draw of (seed, step, row) is >= accuracy."""

    name, reads, labels = "degraded", frozenset({"oracle"}), "per-sample"

    def __init__(self, accuracy: float, seed: int):
        self.accuracy, self.seed = accuracy, seed
        self.report = {"accuracy": accuracy}

    def score(self, r: Rollouts) -> Scored:
        u = torch.tensor([step_seed(self.seed, r.step, "degraded", row) / 2**63 for row in r.rows],
                         dtype=torch.float64)
        flags = torch.tensor(r.oracle, dtype=torch.bool) ^ (u >= self.accuracy)
        return flags.float(), flags, {}


class Detector(Monitor):
    """Flag = any of the chosen detectors fired; score = the fraction of them that fired."""

    name, reads, labels = "detector", frozenset({"detectors"}), "per-sample"

    def __init__(self, keys: Mapping[str, str]):
        """keys: detector name -> its key in a grade's extras."""
        self.keys = list(keys.values())
        self.report = {"detectors": list(keys)}

    def score(self, r: Rollouts) -> Scored:
        fired = torch.tensor([[bool(x[k]) for k in self.keys] for x in r.detectors], dtype=torch.bool)
        return fired.float().mean(1), fired.any(1), {}


def _features(model, knobs, seqs: Sequence[tuple[Tensor, Tensor]], pad_id: int, layer: int,
              chunk: int) -> Tensor:
    """(N, D) hidden_features of (prompt ids (T_p,), completion ids (T_c,)) rows, `chunk` rows per no-grad
    forward."""
    device, out = next(model.parameters()).device, []
    with torch.no_grad(), knobs.merged():
        for i in range(0, len(seqs), chunk):
            part = seqs[i:i + chunk]
            batch = pack([p for p, _ in part], [c for _, c in part], pad_id).to(device)
            out.append(probe.hidden_features(model, batch, layer).cpu())
    return torch.cat(out)


class Probe(Monitor):
    """score = sigmoid(logit - threshold), flag = logit > threshold: the fitted probe on the rollout's
    hidden state under the current knobs (the policy as it samples)."""

    name, reads, labels = "probe", frozenset(), "per-sample (other prompts)"

    def __init__(self, model, knobs, pad_id: int, layer: int, lin: probe.LinearProbe, threshold: float,
                 chunk: int, report: dict):
        self.model, self.knobs, self.pad_id, self.layer, self.chunk = model, knobs, pad_id, layer, chunk
        self.lin, self.threshold, self.report = lin, threshold, report

    def score(self, r: Rollouts) -> Scored:
        x = _features(self.model, self.knobs, list(zip(r.prompt_ids, r.completion_ids)), self.pad_id,
                      self.layer, self.chunk)
        logit = self.lin.logits(x)
        return torch.sigmoid(logit - self.threshold), logit > self.threshold, {}


class Direction(Monitor):
    """raw = sum over modules and V_hack rows of V_m · g_m, g the rollout's per-sequence NLL gradient on the
    main knobs at their current values (the quantity V_hack's pairs are differences of: a hack-like
    completion's raw is high). At every `every`-th step the held-out pairs' hack and clean completions are
    scored in the same pass (threshold = their best balanced-accuracy cut, scale = the std of their raw
    scores), reused until the next; score = sigmoid((raw - threshold) / scale), flag = raw > threshold."""

    name, reads, labels = "direction", frozenset(), "pairs"

    def __init__(self, model, knobs, V_hack: dict[str, Tensor],
                 heldout: list[tuple[Tensor, Tensor, bool]], pad_id: int, norm: str, nll_const: float,
                 report: dict, every: int = 1):
        self.model, self.knobs, self.pad_id, self.norm, self.nll_const = model, knobs, pad_id, norm, nll_const
        self.V = {n: v.detach().float().cpu() for n, v in V_hack.items()}
        self.heldout, self.report, self.every = heldout, report, every
        self.labels_h = torch.tensor([y for _, _, y in heldout], dtype=torch.bool)
        self.calibration: tuple[float, float] | None = None  # (threshold, scale) in use

    def raw(self, prompt_ids: Sequence[Tensor], completion_ids: Sequence[Tensor]) -> Tensor:
        """(N,) float64 of N (prompt (T_p,), completion (T_c,)) rows: sum over modules (the knobs' order)
        and rows of V_hack of V_m · g_m."""
        g = knob_grads.sequence_grads(self.model, self.knobs, prompt_ids, completion_ids, self.pad_id,
                                      self.norm, self.nll_const)
        return along(g, self.V)

    def score(self, r: Rollouts) -> Scored:
        stats: dict[str, float] = {}
        if r.step % self.every == 0 or self.calibration is None:
            h_p, h_c = [p for p, _, _ in self.heldout], [c for _, c, _ in self.heldout]
            raw = self.raw([*r.prompt_ids, *h_p], [*r.completion_ids, *h_c])
            x, h = raw[:len(r)], raw[len(r):]
            threshold, bacc = probe.best_threshold(h, self.labels_h)
            self.calibration = (threshold, max(float(h.std()), 1e-12))
            stats["monitor/heldout_bacc"] = bacc
        else:  # between re-scorings: the rollouts alone, against the last threshold and scale
            x = self.raw(r.prompt_ids, r.completion_ids)
        threshold, scale = self.calibration
        return (torch.sigmoid((x - threshold) / scale).float(), x > threshold,
                {"monitor/threshold": threshold, **stats})


# --- building a monitor for a run ------------------------------------------------------------------------


@dataclass
class MonitorInputs:
    """What a monitor's build may use: the run's config, model, knobs, tokenizer, environment, its train
    problems and the prompt ids of every problem it trains on (train and warm-up sets), and V_hack."""

    cfg: C.Config
    model: object
    knobs: object
    tokenizer: object
    env: object
    train_problems: list
    trained_prompts: set[tuple[int, ...]]
    V_hack: dict[str, Tensor] = field(default_factory=dict)


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _needs_oracle(inp: MonitorInputs, name: str) -> None:
    if not getattr(inp.env, "ground_truth", True):
        raise UserError(f"monitor.kind={name}: environment {inp.env.name!r} has no ground truth to read")


def _ground_truth(inp: MonitorInputs) -> Monitor:
    _needs_oracle(inp, "ground_truth")
    return GroundTruth()


def _degraded(inp: MonitorInputs) -> Monitor:
    _needs_oracle(inp, "degraded")
    return Degraded(inp.cfg.monitor.accuracy, inp.cfg.run.seed)


def _detector(inp: MonitorInputs) -> Monitor:
    have = dict(getattr(inp.env, "detectors", {}))
    if not have:
        raise UserError(f"monitor.kind=detector: environment {inp.env.name!r} has no hack detectors")
    if missing := [d for d in inp.cfg.monitor.detectors if d not in have]:
        raise UserError(f"monitor.detectors={list(inp.cfg.monitor.detectors)}: {missing} not among "
                        f"environment {inp.env.name!r}'s detectors {list(have)}")
    return Detector({d: have[d] for d in inp.cfg.monitor.detectors or have})


def probe_rows(inp: MonitorInputs) -> list[tuple[str, Tensor, Tensor, bool]]:
    """(prompt group, prompt ids (T_p,), completion ids (T_c,), is hack) of the probe's labelled completions:
    monitor.probe_pairs (hack and clean of each pair), else the templates of the environment's
    probe_problems() (the first monitor.probe_problems of them, 0: all; hack: True; clean and buggy: False).
    A prompt the run trains on is refused."""
    tok, cfg, out = inp.tokenizer, inp.cfg, []
    if cfg.monitor.probe_pairs:
        for p in pairs.load_pairs_file(cfg.monitor.probe_pairs):
            prompt_ids, hack, clean = pairs.encode_pair(tok, p)
            group = str(prompt_ids.tolist())  # the ids as a list's text: "[1, 2, ...]"
            out += [(group, prompt_ids, hack, True), (group, prompt_ids, clean, False)]
        where = f"monitor.probe_pairs={cfg.monitor.probe_pairs!r}"
    else:
        if not hasattr(inp.env, "probe_problems"):
            raise UserError(f"monitor.kind=probe: environment {inp.env.name!r} has no problems outside the "
                            "run's for the probe's labelled completions; give --monitor.probe-pairs FILE")
        for prob in inp.env.probe_problems()[:cfg.monitor.probe_problems or None]:
            prompt_ids = as_ids(encode_prompt(tok, inp.env.messages(prob)))
            for kind, label in (("hack", True), ("clean", False), ("buggy", False)):
                out += [(prob.id, prompt_ids, as_ids(encode_completion(tok, t)), label)
                        for t in inp.env.templates(prob, kind)]
        where = f"environment {inp.env.name!r}'s probe problems"
    if shared := sum(tuple(p.tolist()) in inp.trained_prompts for _, p, _, _ in out):
        raise UserError(f"monitor.kind=probe: {shared} labelled completions of {where} have a prompt the run "
                        "trains on; the probe must be fitted on other prompts")
    return out


def _probe(inp: MonitorInputs) -> Monitor:
    cfg, pad = inp.cfg, _pad_id(inp.tokenizer)
    layer, rows = cfg.monitor.layer, probe_rows(inp)
    y = torch.tensor([label for *_, label in rows], dtype=torch.bool)
    if y.all() or not y.any():
        raise UserError("monitor.kind=probe: the labelled completions need hack and non-hack rows")
    chunk = max(1, cfg.rollout.micro * cfg.rollout.group_size)
    with resolve.at_zero(inp.knobs):  # fitted at the base model, as V_hack is extracted: the same on resume
        try:
            x = _features(inp.model, inp.knobs, [(p, c) for _, p, c, _ in rows], pad, layer, chunk)
        except IndexError as e:
            raise UserError(f"monitor.layer={layer}: {e}") from e
    fit, held = probe.split_groups([g for g, *_ in rows], cfg.monitor.probe_heldout, cfg.run.seed)
    if y[held].all() or not y[held].any() or y[fit].all() or not y[fit].any():
        raise UserError(f"monitor.probe_heldout={cfg.monitor.probe_heldout}: the fit or held-out rows lack "
                        "a label")
    lin = probe.fit_logistic(x[fit], y[fit], cfg.monitor.probe_l2)
    logit_h = lin.logits(x[held])
    threshold, bacc = probe.best_threshold(logit_h, y[held])
    groups_h = [rows[i][0] for i in held]
    auc_h = probe.auc_interval(logit_h, y[held], groups_h, cfg.run.seed)
    report = {"rows_fit": len(fit), "rows_heldout": len(held), "prompts_heldout": len(set(groups_h)),
              "layer": layer, "threshold": threshold, "heldout_auc": auc_h[0],
              "heldout_auc_interval": auc_h[1:],
              "heldout_accuracy": float(((logit_h > threshold) == y[held]).float().mean()),
              "heldout_balanced_accuracy": bacc,
              "fit_accuracy": float(((lin.logits(x[fit]) > threshold) == y[fit]).float().mean())}
    _log(f"probe monitor: layer {layer}, {len(fit)} fit and {len(held)} held-out labelled completions; "
         f"held-out AUC {report['heldout_auc']:.3f}, accuracy {report['heldout_accuracy']:.3f} at threshold "
         f"{threshold:.3f} (chosen on those rows)")
    return Probe(inp.model, inp.knobs, pad, layer, lin, threshold, chunk, report)


def _direction(inp: MonitorInputs) -> Monitor:
    cfg = inp.cfg
    if not inp.V_hack:
        raise UserError(f"monitor.kind=direction: environment {inp.env.name!r} gave no V_hack (no hack and "
                        "clean templates to pair): give --proj.pairs FILE")
    pair_list = resolve.v_pairs(cfg, inp.env, inp.train_problems)
    # the pairs V_hack's extraction held out (whole prompts, pairs.split_heldout): never fitted on
    _, held = pairs.split_heldout(pair_list, cfg.proj.heldout_frac)
    if not held:
        raise UserError(f"monitor.kind=direction: its threshold comes from V_hack's held-out pairs; "
                        f"proj.heldout_frac={cfg.proj.heldout_frac} of {len(pair_list)} pairs holds none out")
    heldout = []
    for p in held:
        prompt_ids, hack, clean = pairs.encode_pair(inp.tokenizer, p)
        heldout += [(prompt_ids, hack, True), (prompt_ids, clean, False)]
    report = {"heldout_pairs": len(held), "rows": sum(len(v) for v in inp.V_hack.values()),
              "nll_norm": cfg.proj.nll_norm}
    return Direction(inp.model, inp.knobs, inp.V_hack, heldout, _pad_id(inp.tokenizer), cfg.proj.nll_norm,
                     float(cfg.rollout.dr_grpo_denom), report, cfg.monitor.direction_every)


# monitor.kind -> its build; "none" has no monitor
MONITORS: dict[str, Callable[[MonitorInputs], Monitor]] = {
    "ground_truth": _ground_truth, "degraded": _degraded, "detector": _detector, "probe": _probe,
    "direction": _direction}

# monitor.kind -> the labels it needs at train time (docs/interventions.md); "none" needs none
LABELS: dict[str, str] = {"none": "none", **{c.name: c.labels
                                             for c in (GroundTruth, Degraded, Detector, Probe, Direction)}}


def build(inp: MonitorInputs) -> Monitor | None:
    """The monitor of inp.cfg.monitor.kind (None for "none")."""
    kind = inp.cfg.monitor.kind
    return None if kind == "none" else MONITORS[kind](inp)

