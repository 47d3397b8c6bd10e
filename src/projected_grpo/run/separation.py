"""`projected-grpo separation`: does V_hack carry hack-specific information on this model? Tier 0, no RL.

For the configured model and environment, at the base model (knobs zero), with the run's own `--proj.*` and
`--monitor.*` settings:
  V_hack    extracted with every control (hack/direction.extract), and its held-out separation beside each
            control's with intervals (hack/check.separation, as `extract-direction` prints it);
  direction the direction monitor's score (the completion's NLL gradient summed along V's rows,
            subspace.along) of every held-out completion, for the real V and each control V: how well it
            ranks held-out hacks above cleans (hack/check.ordering: within-prompt AUC with t-intervals over
            held-out prompts, paired against the real V and Holm-adjusted; the pooled AUC with a bootstrap
            over held-out prompts);
  probe     the probe monitor built as a run builds it (hack/monitors.py), on the environment's probe
            problems (none of them a pair's prompt): its held-out AUC and accuracy.
Beside each control: the share of the held-out pairs' centred completion gradients its span holds (the
energy control's match, carried to held-out prompts) and how much of the real V's span it shares
(subspace.shared_span: an energy control near 1 is the real V rotated, not another direction).
Prints one table and writes it with every number to `--out` (separation.md, separation.json). Deterministic
given the seed (run.seed: the probe's split and the bootstrap; the controls use direction.CHECK_SEED).
docs/findings.md section 8 runs it on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time

import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.errors import UserError
from projected_grpo.hack import check, monitors, pairs
from projected_grpo.hack import resolve as hack_resolve
from projected_grpo.hack.direction import Extraction, extract
from projected_grpo.hack.subspace import along, shared_span
from projected_grpo.run import setup

JSON_FILE, MD_FILE = "separation.json", "separation.md"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeparationOpts(presets.Base):
    """projected-grpo separation: pairs from --proj.pairs or the environment's templates of its train problems
    (--env.max-problems of them), as train's; the probe from --monitor.probe-pairs or the environment's probe
    problems (--monitor.probe-problems of them)."""

    out: str = ""
    """write separation.json and separation.md into this directory (made if absent)"""
    n_boot: int = 2000
    """resamples of the held-out prompts for the pooled AUC's bootstrap interval"""
    chunk_tokens: int = 4096
    """padded tokens per forward and backward of V_hack's pair gradients: memory only (SmolLM2-135M peaked
    at 12.5 GB RSS at 4096 on GSM8K pairs)"""


def heldout_scores(ext: Extraction) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """The direction monitor's raw score of each distinct held-out completion under the real V and each
    control V: (name -> (N,) float64, labels (N,) bool (hack), each completion's prompt id (N,))."""
    by_prompt = pairs.completions_by_prompt(ext.held)
    rows = [(i, side, g) for g, group in enumerate(by_prompt) for i, side in group]
    g_hack, g_clean = ext.g_held
    X = {m: torch.stack([(g_hack if side == "hack" else g_clean)[m][i] for i, side, _ in rows])
         for m in g_hack}  # module -> (N, R)
    scores = {name: along(X, V) for name, V in {"real": ext.real, **ext.controls}.items()}
    return scores, torch.tensor([side == "hack" for _, side, _ in rows]), [g for *_, g in rows]


def probe_report(cfg: C.Config, model, knobs, tokenizer, env, problems) -> dict:
    """The probe monitor's build report (held-out AUC with its bootstrap interval, accuracy, rows), fitted as
    a run fits it; the pairs' prompts count as trained on, so none of the probe's may be one of them."""
    trained = {tuple(ids.tolist()) for _, ids in setup.prompt_table(env, tokenizer, problems).values()}
    inp = monitors.MonitorInputs(cfg, model, knobs, tokenizer, env, list(problems), trained)
    return monitors.MONITORS["probe"](inp).report


def _iv(x: list, signed: bool = False) -> str:
    """[mean, lo, hi] as "m [lo, hi]" (lo None: "m")."""
    f = "{:+.3f}" if signed else "{:.3f}"
    return f.format(x[0]) + ("" if x[1] is None else f" [{f.format(x[1])}, {f.format(x[2])}]")


def _vs(v: dict | None) -> str:
    """A real-vs-control record as "diff [lo, hi], p_holm" ("" for the real V itself)."""
    if v is None:
        return ""
    p = "n/a" if v["p_holm"] is None else f"{v['p_holm']:.3g}"
    return f"{_iv(v['diff'], True)}, {p}" + (" **beats**" if v["beats"] else "")


def table(result: dict) -> str:
    """The markdown table of one result (the record main writes): a row per V, then the probe and the two
    verdict lines."""
    chk, order, probe, s = result["check"], result["direction"], result["probe"], result["setup"]
    energy = chk.get("energy_heldout", {})
    out = [f"Tier 0 (no RL), {s['model']} on {s['env']}: {s['n_pairs']} pairs, {s['n_fit']} fit, "
           f"{chk['n_pairs']} held out from {chk['n_prompts']} prompts ({order['n_completions']} distinct "
           f"held-out completions); k={s['k']}, knob {s['knob']}, seed {s['seed']}", "",
           "| V | separation [95% t] | real − V, Holm p | within-prompt AUC [95% t] | real − V, Holm p | "
           "pooled AUC [95% boot.] | bal. acc. | held-out energy | span shared with real V |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name in ["real", *[c for c in check.CHECKED if c in chk["scores"]]]:
        a = order["auc"][name]
        cells = [name, _iv(chk["scores"][name]), _vs(chk["vs"].get(name)), _iv(a["within"]),
                 _vs(order["vs"].get(name)), _iv(a["pooled"]), f"{a['bacc']:.3f}",
                 f"{energy[name]:.3f}" if name in energy else "", f"{result['shared_span'][name]:.3f}"]
        out.append("| " + " | ".join(cells) + " |")
    out += [f"| {c} | not built: {why} | | | | | | | |" for c, why in chk.get("unavailable", {}).items()]
    auc = _iv([probe["heldout_auc"], *probe["heldout_auc_interval"]])
    out += ["", f"probe monitor (layer {probe['layer']}): held-out AUC {auc} (95% boot. over "
            f"{probe['prompts_heldout']} held-out prompts), accuracy {probe['heldout_accuracy']:.3f} at its "
            f"threshold (chosen on those rows); {probe['rows_fit']} fit and {probe['rows_heldout']} held-out "
            "labelled completions", "",
            f"separation: {check.verdict(chk)[1]}",
            f"direction score: {verdict_line(order)}"]
    return "\n".join(out)


def verdict_line(order: dict) -> str:
    """One line: does the real V's within-prompt AUC beat every control's (check.ordering's record)?"""
    failed = [c for c, v in order["vs"].items() if v["beats"] is False]
    if failed:
        return f"the real V's within-prompt AUC does NOT beat the {', '.join(failed)} control(s)"
    if order["passed"] is None:
        return "undecided (too few held-out prompts)"
    return f"the real V's within-prompt AUC beats every control ({', '.join(order['vs'])})"


def main(argv: list[str]) -> int:
    """`projected-grpo separation`: see SeparationOpts and the module docstring."""
    cfg, opts = presets.parse(argv, "projected-grpo separation", SeparationOpts, forbid=("--proj.control",))
    if opts.chunk_tokens < 1 or opts.n_boot < 2:
        raise UserError(f"--chunk-tokens {opts.chunk_tokens} and --n-boot {opts.n_boot}: expected >= 1 and "
                        ">= 2")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    t0 = time.perf_counter()
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    wall = {"load": time.perf_counter() - t0}
    settings = hack_resolve.extract_settings(cfg)
    with contextlib.closing(setup.make_env(cfg)) as env, hack_resolve.at_zero(knobs):
        problems = env.problem_sets()["train"]
        pair_list = hack_resolve.v_pairs(cfg, env, problems)
        if not pair_list:
            raise UserError(f"environment {env.name!r} has no hack and clean templates to pair: give "
                            "--proj.pairs FILE")
        t = time.perf_counter()
        ext = extract(model, knobs, tok, pair_list, settings, opts.chunk_tokens)
        wall["extract"] = time.perf_counter() - t
        if not ext.held:
            raise UserError(f"--proj.heldout-frac {cfg.proj.heldout_frac} holds no prompt out of "
                            f"{len(pair_list)} pairs: nothing to measure separation on")
        t = time.perf_counter()
        probe = probe_report(cfg, model, knobs, tok, env, problems)
        wall["probe"] = time.perf_counter() - t
    scores, labels, groups = heldout_scores(ext)
    order = check.ordering(scores, labels, groups, cfg.run.seed, opts.n_boot)
    wall["total"] = time.perf_counter() - t0
    st = ext.direction.stats
    every_v = {"real": ext.real, **ext.controls}
    model_name = cfg.model.path or cfg.model.source
    env_name = f"{cfg.env.name} ({cfg.env.problems}, modes {','.join(cfg.env.modes) or 'default'})"
    result = {"setup": {"model": model_name, "env": env_name, "n_pairs": st["n_pairs"],
                        "n_fit": st["n_train"], "k": settings.k, "knob": cfg.model.knob, "seed": cfg.run.seed,
                        "settings": dataclasses.asdict(settings), "argv": list(argv)},
              "check": st["check"], "direction": order, "probe": probe,
              "shared_span": {n: shared_span(V, ext.real) for n, V in every_v.items()},
              "scores": {n: x.tolist() for n, x in scores.items()}, "labels": labels.tolist(),
              "groups": groups, "wall_s": wall}
    text = table(result)
    print(text)
    print(f"wall: {', '.join(f'{k} {v:.0f} s' for k, v in wall.items())}")
    if opts.out:
        out = pathlib.Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        store.write_json_atomic(out / JSON_FILE, result)
        store.write_text_atomic(out / MD_FILE, text + "\n")
    return 0
