"""DPO against hacks on the knobs, the reference being the base model (knobs zeroed, no second copy).

`projected-grpo dpo` trains the knobs on (prompt, chosen, rejected) pairs; `pass_before` runs the same pass
inside a `train` process when dpo.before is set (the `dpo_then_grpo` arm: the RL loop then starts from its
knobs, setup.start_knobs). Pairs come from V_hack's sources with clean = chosen and hack = rejected
(`load_dpo_pairs`); their prompts are split once, by a stable hash, into fit and held-out pairs. The
reference log-probs are computed once, under knobs.zeroed(). Per step: dpo.batch_pairs fit pairs (a seeded
shuffle per epoch, a function of the step alone, so a resumed run needs no cursor) -> summed completion
log-probs -> DPO_LOSSES[dpo.loss] -> backward -> the projection arm on the knob gradient (as in GRPO) ->
clip -> AdamW -> a metrics row with fit and held-out margins -> checkpoint. Before the first step and after
the last, dpo.sample_n samples per train problem with one seed are graded: the sampled hack rate.
Deterministic given the seed on CPU; --resume continues bit for bit. Formulas: docs/losses.md section 7.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence

import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.errors import UserError
from projected_grpo.hack import pairs as PR
from projected_grpo.hack import resolve
from projected_grpo.objective.losses import DPO_LOSSES
from projected_grpo.objective.schedule import lr_at
from projected_grpo.run import checkpoint, metrics, session, setup
from projected_grpo.run.row import rates
from projected_grpo.run.step import projected_step, set_lr
from projected_grpo.sampling.generate import step_seed
from projected_grpo.sampling.pack import pack
from projected_grpo.sampling.sample import sample_and_grade
from projected_grpo.sampling.score import forward_logprobs

Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (prompt ids, chosen ids, rejected ids): (T,) long


def load_dpo_pairs(cfg: C.Config, env, tok, problems: Sequence, run_dir: pathlib.Path) -> list[PR.Pair]:
    """dpo.pairs: empty = V_hack's pairs (proj.pairs, else the environment's templates); `pool` = mined
    from the teacher pool (pool.path, else template rows built into run_dir/pool.jsonl) with detector E of
    every mode trained on; else a JSON/JSONL pairs file. Pair.hack is the rejected side, Pair.clean chosen."""
    if not cfg.dpo.pairs:
        if not (found := resolve.v_pairs(cfg, env, problems)):
            raise UserError(f"dpo: environment {env.name!r} has no hack and clean templates to pair; give "
                            "--dpo.pairs FILE (JSON/JSONL with prompt, hack, clean)")
        return found
    if cfg.dpo.pairs != "pool":
        return PR.load_pairs_file(cfg.dpo.pairs)
    path = pathlib.Path(cfg.pool.path or run_dir / "pool.jsonl")
    prompts = setup.prompt_table(env, tok, problems)
    if not path.exists():
        setup.build_template_pool(cfg, env, tok, problems, prompts, path)
    mined, stats = setup.mined_pairs(str(path), tok, problems, {i: ids for i, (_, ids) in prompts.items()},
                                     sorted({p.mode for p in problems}), ("E",), cfg.proj.pairs_per_problem)
    if not mined:
        raise UserError(f"dpo.pairs=pool: no (hack, clean) pairs mined from {path} ({json.dumps(stats)})")
    return mined


def split_pairs(pairs: Sequence[PR.Pair], heldout_frac: float) -> tuple[list[int], list[int]]:
    """(fit, held-out) pair indices: the prompts ordered by a stable hash of their text, the first
    round(heldout_frac * #prompts) (at least 1 when heldout_frac > 0) held out with all their pairs."""
    keys = {i: PR._prompt_key(p) for i, p in enumerate(pairs)}
    prompts = sorted(set(keys.values()), key=lambda k: store.stable_hash(k))
    n_held = max(1, round(heldout_frac * len(prompts))) if heldout_frac > 0 else 0
    if n_held >= len(prompts):
        raise UserError(f"dpo.heldout_frac={heldout_frac}: the pairs have {len(prompts)} prompt(s), too few "
                        "to hold some out and fit on the rest; lower it (0 = no held-out pairs) or add pairs")
    held = set(prompts[:n_held])
    return [i for i in keys if keys[i] not in held], [i for i in keys if keys[i] in held]


def seq_logps(model, tok, items: Sequence[Item], device: str, chunk: int):
    """Summed completion log-probs (temperature 1) of the chosen and the rejected sides, (N,) each, under
    the model as it is (knob context and grad mode are the caller's); `chunk` pairs per forward."""
    out_c, out_r = [], []
    for c in range(0, len(items), chunk):
        part = items[c:c + chunk]
        seqs = pack([p for p, _, _ in part] * 2, [ch for _, ch, _ in part] + [rj for _, _, rj in part],
                    tok.pad_token_id).to(device)
        logp, _ = forward_logprobs(model, seqs)  # (2n, T), 0 off the mask
        total = logp.sum(1)
        out_c.append(total[:len(part)])
        out_r.append(total[len(part):])
    return torch.cat(out_c), torch.cat(out_r)


def reference_logps(model, knobs, tok, items: Sequence[Item], device: str, chunk: int):
    """The reference's summed log-probs (chosen, rejected), (N,) each: the base model, knobs zeroed."""
    with torch.no_grad(), knobs.zeroed():
        return seq_logps(model, tok, items, device, chunk)


def batch_indices(step: int, n_fit: int, size: int, seed: int) -> list[int]:
    """The fit-pair indices of `step`: positions step*size .. step*size + size - 1 of the concatenation of
    one seeded permutation of range(n_fit) per epoch (size <= n_fit, so no pair twice in a batch)."""
    perm = lambda e: torch.randperm(n_fit, generator=torch.Generator().manual_seed(step_seed(seed, e, "dpo")))
    out = []
    for j in range(step * size, (step + 1) * size):
        out.append(int(perm(j // n_fit)[j % n_fit]))
    return out


def sampled_rates(cfg: C.Config, model, knobs, tok, env, problems: Sequence, prompt_ids, when: str) -> dict:
    """dpo/{hack,solve,format}_<when>: dpo.sample_n samples per problem of the deployed model (quarantine
    zeroed) at rollout.temperature, one fixed seed, graded: the same draws before and after training."""
    with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
        got = sample_and_grade(model, tok, env, problems, prompt_ids, cfg.dpo.sample_n,
                               max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                               top_p=cfg.rollout.top_p, seed=step_seed(cfg.run.seed, 0, "dpo-sample"))
    return {f"dpo/{k.split('/')[0]}_{when}": v for k, v in rates([s.grade for s in got], when).items()}


def _loss(cfg: C.Config, logp, ref) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO_LOSSES[dpo.loss] of logp (logp_c, logp_r) and ref (ref_c, ref_r); stats with margin, log-probs."""
    loss, st = DPO_LOSSES[cfg.dpo.loss](logp[0], logp[1], ref[0], ref[1], beta=cfg.dpo.beta)
    out = {k: float(v) for k, v in st.items()}
    out["dpo/margin"] = out["dpo/reward_chosen"] - out["dpo/reward_rejected"]
    out["dpo/logp_chosen"] = float(logp[0].detach().mean())
    out["dpo/logp_rejected"] = float(logp[1].detach().mean())
    return loss, out


def train_dpo(cfg: C.Config) -> dict:
    """Run DPO as configured; returns the summary (also in run_dir/summary.json); final knobs in
    run_dir/knobs.safetensors (setup.KNOBS_FILE)."""
    if cfg.proj.refresh_every:
        raise UserError("config: proj.refresh_every (online V_hack refresh) is run by the GRPO loop only; "
                        "for DPO set it to 0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: every rank would write the one run dir
        raise UserError("config: DPO trains in one process; run `projected-grpo dpo` without torchrun, "
                        "then start the data-parallel run from its knobs (--model.init-knobs "
                        "RUN/knobs.safetensors)")
    cfg, ck = session.open_run(cfg, "dpo")
    run_dir = pathlib.Path(cfg.run.dir)
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    dev, chunk = cfg.model.device, cfg.dpo.batch_pairs
    with contextlib.closing(setup.make_env(cfg)) as env:
        train_problems = env.problem_sets()["train"]
        prompt_ids = {i: ids for i, (_, ids) in setup.prompt_table(env, tok, train_problems).items()}
        pair_list = load_dpo_pairs(cfg, env, tok, train_problems, run_dir)
        fit, held = split_pairs(pair_list, cfg.dpo.heldout_frac)
        items = []
        for p in pair_list:
            prompt, hack, clean = PR.encode_pair(tok, p)
            items.append((prompt, clean, hack))
        ref = reference_logps(model, knobs, tok, items, dev, chunk)
        opt = torch.optim.AdamW([{"params": knobs.parameters()}, {"params": knobs.hack_parameters()}],
                                lr=cfg.dpo.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                weight_decay=cfg.optim.weight_decay)
        # no cursors: a step's pairs are a function of the step alone (batch_indices)
        V_hack, v_line, start = session.resume(ck, knobs, opt, fresh=lambda: (
            resolve.resolve_v_hack(cfg, model, knobs, tok, env, train_problems)))
        guard = session.MovementGuard(knobs)  # fail closed: knobs that do not move stop the run
        metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, cfg.run.report_to, cfg.to_dict())
        bar = metrics.Progress(cfg.dpo.steps, initial=start, desc="dpo")
        print(f"run {run_dir} from step {start} | DPO ({cfg.dpo.loss}, beta {cfg.dpo.beta}) on {len(fit)} "
              f"pairs, {len(held)} held out | arm {cfg.proj.arm} | {v_line}", file=sys.stderr)
        size = min(cfg.dpo.batch_pairs, len(fit))
        t_mark = time.perf_counter()
        for step in range(start, cfg.dpo.steps):
            row: dict = {}
            if step == 0 and cfg.dpo.sample_n:
                row |= sampled_rates(cfg, model, knobs, tok, env, train_problems, prompt_ids, "before")
            idx = batch_indices(step, len(fit), size, cfg.run.seed)
            mb = [fit[i] for i in idx]
            opt.zero_grad(set_to_none=True)
            logp = seq_logps(model, tok, [items[i] for i in mb], dev, chunk)
            loss, stats = _loss(cfg, logp, (ref[0][mb], ref[1][mb]))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: non-finite DPO loss")
            loss.backward()
            session.check_finite(step, "gradient", {"knobs": knobs.grads("main")})
            lr = lr_at(step, peak=cfg.dpo.lr, total=cfg.dpo.steps, warmup=cfg.optim.warmup_steps,
                       floor_frac=cfg.optim.min_lr_frac)
            set_lr(opt, lr)
            stats |= {k: float(v) for k, v in projected_step(cfg, opt, knobs, V_hack).items()}
            grad_norm = stats.pop("grad/norm")
            guard.after_step(step, grad_norm=grad_norm)
            if held:
                with torch.no_grad():
                    h_loss, h_stats = _loss(cfg, seq_logps(model, tok, [items[i] for i in held], dev, chunk),
                                            (ref[0][held], ref[1][held]))
                row |= {"dpo/heldout_loss": float(h_loss), "dpo/heldout_margin": h_stats["dpo/margin"],
                        "dpo/heldout_accuracy": h_stats["dpo/accuracy"]}
            if step + 1 == cfg.dpo.steps and cfg.dpo.sample_n:
                row |= sampled_rates(cfg, model, knobs, tok, env, train_problems, prompt_ids, "after")
            row |= {"loss/dpo": float(loss.detach()), **stats, "lr": lr, "grad/norm": grad_norm,
                    **{k: float(v) for k, v in knobs.norms().items()},
                    "time/step": time.perf_counter() - t_mark}
            bar.update(logger.log(step, row))
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == cfg.dpo.steps:
                checkpoint.save_checkpoint(run_dir, step + 1, knobs=knobs, V_hack=V_hack, optimizer=opt,
                                           cursors={}, config=cfg.to_dict())
            t_mark = time.perf_counter()
        bar.close()
        logger.close()
    knobs.save(run_dir / setup.KNOBS_FILE)
    summary = _summary(cfg, run_dir, n_fit=len(fit), n_heldout=len(held), v_hack=v_line)
    session.release(run_dir)
    return summary


def _summary(cfg: C.Config, run_dir: pathlib.Path, **extra) -> dict:
    """summary.json: the last row's held-out numbers, the sampled rates before and after, last-5 means."""
    rows = metrics.read_rows(run_dir / metrics.METRICS_FILE)
    keys = ("dpo/heldout_margin", "dpo/heldout_accuracy", "dpo/heldout_loss", "dpo/hack_after",
            "dpo/solve_after", "dpo/format_after")
    summary = metrics.summarize(rows) | {k: rows[-1][k] for k in keys if k in rows[-1]}
    summary |= {k: v for k, v in rows[0].items() if k.endswith("_before")}
    summary |= {"run_dir": str(run_dir), "algo": "dpo", "loss": cfg.dpo.loss, **extra}
    store.write_json_atomic(run_dir / metrics.SUMMARY_FILE, summary)
    print("\n".join(f"{k:>22}: {v:.4f}" if isinstance(v, float) else f"{k:>22}: {v!r}"
                    for k, v in summary.items()))
    return summary


def pass_before(cfg: C.Config) -> None:
    """dpo.before: the DPO pass into <run.dir>/dpo whose final knobs the RL loop starts from; a finished pass
    (its summary.json, written with the same config) is skipped, an interrupted one resumed."""
    if not cfg.dpo.before:
        return
    cfg = session.resolved(cfg)  # as the GRPO run and the pass will record it
    sub_dir = pathlib.Path(setup.start_knobs(cfg)).parent
    sub = C.replace(cfg, dpo={"before": False}, run={"dir": str(sub_dir), "resume": False})
    if (sub_dir / metrics.SUMMARY_FILE).exists():
        done = C.Config.from_json(str(sub_dir / "config.json"))
        if diff := C.diff(done, sub, ("run.resume",)):
            raise UserError(f"{sub_dir}: a finished DPO pass with another config ({diff}); remove it or use "
                            "another --run-dir")
        print(f"dpo.before: {sub_dir} finished earlier; starting from its knobs", file=sys.stderr)
        return
    train_dpo(C.replace(sub, run={"resume": (sub_dir / metrics.METRICS_FILE).exists()}))


def main(argv: list[str]) -> int:
    """`projected-grpo dpo`: parse (presets.parse, the train options), run DPO, print the summary."""
    cfg, _ = presets.parse(argv, prog="projected-grpo dpo", forbid=("--dpo.before",))
    with session.cleanup_on_failure():  # a run that fails before its first step leaves no directory
        train_dpo(cfg)
    return 0
