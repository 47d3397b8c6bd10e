"""The GRPO loop on a mixed student/teacher pool with hack-direction projection (SPEC §1-4, seeds 000, 002).

`train(cfg)` reads top to bottom: setup → per step: sample prompts → G_s student rollouts + G_t frozen
teacher rows per group → grade in the sandbox → group advantages over the mixed group → zero-variance
policy → one forward per micro-batch → token losses (+ beta * KL to the reference = knobs zeroed) →
backward with the one-pass per-source split → projection by arm → clip → AdamW → metrics → checkpoint.
Departures from textbook GRPO, labelled where they happen: one optimizer step per generation (student
ratio = 1, PPO clip inert for students), teacher rows handled by `loss.teacher` (SPEC §3), Dr.GRPO
(Liu et al. 2025) by default, projection of knob gradients / updates (SPEC §1.5). Deterministic given
the seed on CPU; `--resume` continues exactly. `main(argv)` is the `projected-grpo train` CLI.
"""

from __future__ import annotations

import math
import pathlib
import random
import sys
import time

import numpy as np
import torch

from projected_grpo import config as C
from projected_grpo import presets, store
from projected_grpo.envs.coding.grading import Grader
from projected_grpo.envs.coding.sandbox import SandboxPool
from projected_grpo.hack import direction, pairs
from projected_grpo.knobs import adapters, projection
from projected_grpo.objective.advantages import ADVANTAGES, zero_variance_mask
from projected_grpo.objective.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Denominators,
    clip_surrogate,
    masked_mean,
)
from projected_grpo.organism import build as organism
from projected_grpo.run import checkpoint, metrics
from projected_grpo.run.pool import (
    TEACHER_MODES,
    PoolCursor,
    PromptCursor,
    TeacherPool,
    load_pool,
    prompt_text_and_ids,
    student_group_rows,
    teacher_group_rows,
    template_rows,
    write_pool,
)
from projected_grpo.run.rollout import forward_logprobs, generate, pack, pad_right, step_seed


def load_model(mcfg: C.ModelCfg, seed: int, tokenizer_only: bool = False):
    """(model or None, tokenizer) for `mcfg.source`; model in eval mode (no dropout in RL) on mcfg.device."""
    if mcfg.source == "smoke":
        model, tok = organism.smoke_model_and_tokenizer(seed=seed)
    elif mcfg.source == "organism":
        log = lambda m: print(m, file=sys.stderr)
        path = organism.build_organism(cache_dir=mcfg.cache_dir or None, log=log)
        model, tok, _ = organism.load_organism(path)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if not mcfg.path:
            raise ValueError("config: model.source='hf' needs model.path (pass --model PATH)")
        from projected_grpo.models import resolve_model
        path = resolve_model(mcfg.path, mcfg.cache_dir or None)  # a name (smollm2) or a local directory
        gguf = {"gguf_file": mcfg.gguf_file} if mcfg.gguf_file else {}
        tok = AutoTokenizer.from_pretrained(path, **gguf)
        model = None if tokenizer_only else AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, mcfg.dtype), **gguf)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation and pack need a pad id; pad positions are masked out
    return (None if model is None else model.to(mcfg.device).eval()), tok


def load_problems(ecfg: C.EnvCfg) -> list:
    """The run's problems: the built-in set or a LeetCode JSONL, filtered to `ecfg.modes` (empty = all)."""
    from projected_grpo.envs.coding.leetcode import load_leetcode
    from projected_grpo.envs.coding.problems import BUILTIN_PROBLEMS
    if ecfg.problems == "builtin":
        out = [p for p in BUILTIN_PROBLEMS if not ecfg.modes or p.mode in ecfg.modes]
    else:  # LeetCode rows carry no mode: deal the configured modes out round-robin (default run_tests)
        modes = ecfg.modes or ("run_tests",)
        out = [p.with_mode(modes[i % len(modes)]) for i, p in enumerate(load_leetcode(ecfg.problems))]
    out = out[:ecfg.max_problems or None]
    if not out:
        raise ValueError(f"config: env.modes={list(ecfg.modes)} selects no problem from {ecfg.problems!r}")
    return out


def _finite(step: int, what: str, by_source: dict[str, dict[str, torch.Tensor]]) -> None:
    """Fail fast on NaN/inf: name the step, the source(s) (student/teacher) and the module (or tensor).

    by_source: source -> {module or tensor name: values}; split.Capture sums each source's rows apart, so a
    NaN is attributed to the source that produced it."""
    for name in next(iter(by_source.values())):
        bad = [src for src, named in by_source.items() if not torch.isfinite(named[name]).all()]
        if bad:
            raise FloatingPointError(f"step {step}: non-finite {what} from the {' and '.join(bad)} rows "
                                     f"in {name}")


def train(cfg: C.Config) -> dict:
    """Run GRPO as configured; returns the end-of-run summary (also written to run_dir/summary.json)."""
    # --- run directory, resolved config, seeding (TRY NOT TO MODIFY, cleanrl) ---
    run_dir = pathlib.Path(cfg.run.dir or f"runs/{cfg.model.source}-{cfg.proj.arm}-s{cfg.run.seed}-"
                           f"{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / metrics.METRICS_FILE).exists() and not cfg.run.resume:
        raise FileExistsError(f"{run_dir} holds a run: pass --resume to continue it or a new --run-dir")
    cfg = C.replace(cfg, run={"dir": str(run_dir)})
    ckpt_path = checkpoint.latest_checkpoint(run_dir) if cfg.run.resume else None
    ck = checkpoint.load_checkpoint(ckpt_path) if ckpt_path else None
    if ck is not None:
        # run.dir may differ: a run directory can be moved or copied and resumed where it is now
        old = C.Config.from_dict(ck.config, where=f"{ckpt_path} config")
        if diff := C.diff(old, cfg, ("run.resume", "run.steps", "run.dir")):
            raise ValueError(f"--resume: {ckpt_path} was written with another config: {diff}")
        if old.run.steps != cfg.run.steps:  # allowed (extending a run), but the LR schedule's horizon moves
            print(f"--resume: run.steps {old.run.steps} -> {cfg.run.steps}: the cosine LR schedule now spans "
                  f"{cfg.run.steps} steps, so from step {ck.step} on this is not the run the first "
                  "command would have finished, nor an uninterrupted run of the new length", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    store.write_json_atomic(run_dir / "config.json", cfg.to_dict())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    R, L, P, O = cfg.rollout, cfg.loss, cfg.proj, cfg.optim

    # --- model, knobs, problems ---
    model, tok = load_model(cfg.model, cfg.run.seed)
    cache = store.cache_root(cfg.model.cache_dir or None)
    knobs = adapters.wrap(model, kind=cfg.model.knob, targets=cfg.model.targets or adapters.DEFAULT_TARGETS,
                          rank=cfg.model.rank or None, cache_dir=cache / "svd", seed=cfg.run.seed)
    problems = load_problems(cfg.env)
    by_id = {p.id: p for p in problems}
    prompt_ids = {p.id: prompt_text_and_ids(tok, p)[1] for p in problems}  # pool rows must match (drift)

    # --- hack direction V_hack: cached extraction, then load-time post-processing (direction.py) ---
    settings = direction.ExtractSettings(k=P.k, tau_axis=P.tau_axis, n_heldout=P.n_heldout, norm=P.nll_norm,
                                         nll_const=float(R.dr_grpo_denom), control=P.control,
                                         seed=cfg.run.seed if P.control != "none" else 0)
    # (the seed only draws the controls; the real V is seed-free, so every seed shares one cached V)
    v_pairs = (pairs.load_pairs_file(P.pairs) if P.pairs else
               pairs.builtin_pairs(problems if cfg.env.problems == "builtin" else None, P.pairs_per_problem))
    key = store.stable_hash(direction.cache_meta(settings, knobs, tok, v_pairs))  # all V depends on
    v_file = P.v_path or cache / "v_hack" / f"{key}.safetensors"
    found, v_status = direction.resolve(v_file, settings, model, knobs, tok, v_pairs)
    V_hack, v_report = direction.postprocess(found.V, found.S, P.k_use, P.drop_bottom_frac)

    # --- AdamW over main + quarantine knobs; linear warmup, then cosine down to min_lr_frac ---
    params = knobs.parameters() + knobs.hack_parameters()
    opt = torch.optim.AdamW([{"params": knobs.parameters()}, {"params": knobs.hack_parameters()}], lr=O.lr,
                            betas=O.betas, eps=O.eps, weight_decay=O.weight_decay)
    span = max(1, cfg.run.steps - O.warmup_steps)
    cos_frac = lambda s: (1 + math.cos(math.pi * (s - O.warmup_steps) / span)) / 2  # 1 -> 0 after warmup
    lr_at = lambda s: O.lr * ((s + 1) / O.warmup_steps if s < O.warmup_steps
                              else O.min_lr_frac + (1 - O.min_lr_frac) * cos_frac(s))  # nanoGPT get_lr

    with SandboxPool(n_workers=cfg.env.workers or None) as sandbox:
        # --- grader, teacher pool (from templates into the run dir when no path is given) ---
        grader = Grader(sandbox, reward_shape=cfg.env.reward_shape, timeout_s=cfg.env.timeout_s)
        pool_path = pathlib.Path(cfg.pool.path or run_dir / "pool.jsonl")
        if not cfg.pool.path and not pool_path.exists() and R.G_t:
            write_pool(pool_path, template_rows(problems, tok, grader, n_hack=cfg.pool.n_hack,
                                                n_clean=cfg.pool.n_clean, n_buggy=cfg.pool.n_buggy))
        pool = load_pool(pool_path, tok, problems) if cfg.pool.path or R.G_t else TeacherPool([], "(no pool)")
        ids = [p.id for p in problems]
        missing = pool.missing(ids) if R.G_t else []
        if missing and cfg.pool.missing == "error":
            raise ValueError(f"teacher pool {pool_path}: no rows for {len(missing)} problems {missing[:8]}; "
                             "extend the pool or set --pool.missing restrict")
        if missing:  # reported, never silently trained with G_t = 0
            print(f"teacher pool {pool_path}: no rows for {len(missing)}/{len(ids)} problems; prompts come "
                  f"from the {len(ids) - len(missing)} pooled ones; unpooled: {missing}", file=sys.stderr)
            ids = [i for i in ids if i not in missing]
        if L.teacher == "importance" and R.G_t and not pool.has_behaviour_logp():
            raise ValueError(f"--loss.teacher importance needs behaviour log-probs, but {pool_path} has rows "
                             "with logp_behaviour=null (template rows); build it with --source teacher")
        prompts_cur, pool_cur = PromptCursor(ids, cfg.run.seed), PoolCursor(pool, cfg.run.seed)

        # --- resume: knobs, V_hack, optimizer, cursors, RNG; metrics cut back to match ---
        start = 0
        if ck is not None:
            for n, m in knobs.modules.items():
                m.delta.data.copy_(ck.knobs_state[f"delta/{n}"])
                m.delta_hack.data.copy_(ck.knobs_state[f"hack/{n}"])
            V_hack = {k[2:]: v for k, v in ck.knobs_state.items() if k.startswith("V/")}
            opt.load_state_dict(ck.optimizer_state)
            prompts_cur.load_state_dict(ck.cursors["prompts"])
            pool_cur.load_state_dict(ck.cursors["pool"])
            checkpoint.restore_rng(ck)
            start = ck.step
        metrics.truncate_to(run_dir, start - 1)
        logger = metrics.MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard)
        bar = metrics.Progress(cfg.run.steps, initial=start)
        print(f"run {run_dir} from step {start} | arm {P.arm} ({P.target}) | teacher {L.teacher} | "
              f"G_s {R.G_s} + G_t {R.G_t} | V_hack {v_file} ({v_status}): "
              f"{sum(len(v) for v in V_hack.values())} rows in {len(V_hack)} modules, dropped "
              f"{v_report['dropped_modules']}", file=sys.stderr)

        for step in range(start, cfg.run.steps):
            t_step = time.perf_counter()
            # --- sample prompts; G_s student rollouts + G_t frozen teacher rows per group; grade ---
            pids = prompts_cur.take(R.prompts_per_step)
            teacher = [teacher_group_rows(pool_cur.draw(i, R.G_t, step, b)) for b, i in enumerate(pids)]
            groups: list[list[dict]] = [[] for _ in pids]  # per prompt: G_s student rows, then G_t teacher
            todo, extra, resampled, t_gen, t_grade = list(range(len(pids))), 0, 0, 0.0, 0.0
            while True:
                t0 = time.perf_counter()
                # merged(): sample at the plain model's cost. Behaviour log-probs change only by the float
                # rounding of W + ΔW; the loss recomputes logp below via the knob path: same training math
                with torch.no_grad(), knobs.merged():
                    ro = generate(model, [prompt_ids[pids[b]] for b in todo], R.G_s,
                                  max_new_tokens=R.max_new_tokens, temperature=R.temperature, top_p=R.top_p,
                                  seed=step_seed(cfg.run.seed, step, extra), eos_id=tok.eos_token_id,
                                  pad_id=tok.pad_token_id)
                t1 = time.perf_counter()
                texts = [tok.decode(c, skip_special_tokens=True) for c in ro.completion_ids]
                grades = grader.grade_batch(texts, [by_id[pids[b]] for b in todo for _ in range(R.G_s)])
                t_gen, t_grade = t_gen + t1 - t0, t_grade + time.perf_counter() - t1
                students = student_group_rows(ro, grades)
                for j, b in enumerate(todo):
                    groups[b] = students[j * R.G_s:(j + 1) * R.G_s] + teacher[b]
                # gt_penalty baseline only (env.hack_penalty = 0 otherwise): the oracle never shapes the
                # reward of the projection arms (SPEC §3 no-cheat rule)
                rewards = torch.tensor([[r["reward"] - cfg.env.hack_penalty * r["exploited"] for r in g]
                                        for g in groups])  # (B, G) float32
                zero = zero_variance_mask(rewards)  # (B,)
                todo = [b for b in range(len(pids)) if zero[b]]
                # resample: regenerate the zero-variance groups' students only, with a fresh seed per try
                if L.zero_var != "resample" or extra >= L.max_resample or not todo:
                    break
                extra, resampled = extra + 1, resampled + len(todo)

            # --- deployment view: the same prompts, sampled with the quarantine knob zeroed as at deployment
            # (SPEC §3). Only `route` writes the quarantine; while it is all zero the deployed model is the
            # student, so the student's samples are the deployment samples and nothing is generated twice ---
            deploy = [(r["exploited"], r["gt_correct"], r["format_ok"])  # per student row
                      for g in groups for r in g if r["student"]]
            if any(bool(v.any()) for v in knobs.values("hack").values()):
                t0 = time.perf_counter()
                with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
                    dro = generate(model, [prompt_ids[i] for i in pids], R.G_s,
                                   max_new_tokens=R.max_new_tokens, temperature=R.temperature, top_p=R.top_p,
                                   seed=step_seed(cfg.run.seed, step, 0),  # the students' seed
                                   eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
                t1 = time.perf_counter()
                dg = grader.grade_batch([tok.decode(c, skip_special_tokens=True) for c in dro.completion_ids],
                                        [by_id[i] for i in pids for _ in range(R.G_s)])
                deploy = [(g.exploited, g.gt_correct, g.format_ok) for g in dg]
                t_gen, t_grade = t_gen + t1 - t0, t_grade + time.perf_counter() - t1

            # --- advantages over each mixed group (estimator by name); zero-variance groups skipped ---
            adv, adv_stats = ADVANTAGES[L.advantage](rewards)  # (B, G); exactly 0 on zero-variance groups
            _finite(step, "advantages", {"student": {"adv": adv[:, :R.G_s]},
                                         "teacher": {"adv": adv[:, R.G_s:]}})
            keep = [b for b in range(len(pids)) if not zero[b]]
            rows = [r for g in groups for r in g]
            n_tok = sum(len(r["completion_ids"]) for b in keep for r in groups[b])
            n_tok_t = sum(len(r["completion_ids"]) for b in keep for r in groups[b] if not r["student"])
            # Dr.GRPO (Liu et al. 2025): the constant G * max_new_tokens * B stays when groups are skipped
            denoms = Denominators(n_seqs=max(1, len(keep) * R.group_size), n_tokens=max(1, n_tok),
                                  const=float(R.dr_grpo_denom))

            # --- per micro-batch: one forward (students + teachers packed), token losses, backward ---
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            acc: dict[str, float] = {}
            split = None
            for c in range(0, len(keep), R.micro):
                mb = [r for b in keep[c:c + R.micro] for r in groups[b]]
                mb_adv = adv[keep[c:c + R.micro]].reshape(-1)  # (N,)
                batch = pack([r["prompt_ids"] for r in mb], [r["completion_ids"] for r in mb],
                             tok.pad_token_id).to(cfg.model.device)
                mask = batch.completion_mask  # (N, T)
                is_student = torch.tensor([r["student"] for r in mb], device=mask.device)  # (N,)
                logp_b = pad_right([r["logp_behaviour"] or [] for r in mb], batch.T).to(mask.device)  # (N, T)
                with torch.no_grad(), knobs.zeroed():  # the free reference: zero knobs = the base model
                    logp_ref, _ = forward_logprobs(model, batch, temperature=R.temperature)
                with knobs.capture(is_student) as cap:  # per-source knob grads from this one backward
                    logp, entropy = forward_logprobs(model, batch, temperature=R.temperature,
                                                     with_entropy=True)  # (N, T) each
                    logp_old, weight, t_stats = TEACHER_MODES[L.teacher](logp, logp_b, is_student, mask,
                                                                         L.is_trunc)
                    # one optimizer step per generation: students' ratio is exactly 1 (clip inert for them)
                    pg_tok, clip_stats = clip_surrogate(logp, logp_old, mb_adv.to(mask.device), mask,
                                                        eps_low=L.eps_low, eps_high=L.eps_high)
                    kl_tok, kl_stats = KL_ESTIMATORS[L.kl](logp, logp_ref, mask, logp_old=logp_old)
                    bad = (~torch.isfinite(weight * (pg_tok + kl_tok)) & mask.bool()).any(1)  # (N,)
                    if bad.any():
                        raise FloatingPointError(f"step {step}: non-finite token loss in a "
                                                 f"{'student' if is_student[bad][0] else 'teacher'} row")
                    loss_pg, _ = AGGREGATIONS[L.aggregation](weight * pg_tok, mask, denoms)
                    loss_kl, _ = AGGREGATIONS[L.aggregation](weight * kl_tok, mask, denoms)
                    (loss_pg + L.beta * loss_kl).backward()
                split = cap if split is None else split + cap
                # token-weighted means over micro-batches; losses are already step-level sums
                w = float(mask.sum()) / n_tok
                w_t = float((mask * ~is_student[:, None]).sum()) / max(1, n_tok_t)
                means = {**clip_stats, **kl_stats, "entropy/mean": masked_mean(entropy.detach(), mask)}
                parts = [(k, w * float(v)) for k, v in means.items()]
                parts += [(k, w_t * float(v)) for k, v in t_stats.items() if k != "teacher/mode"]
                parts += [("loss/policy", float(loss_pg.detach())),
                          ("loss/kl", L.beta * float(loss_kl.detach()))]
                for k, v in parts:
                    acc[k] = acc.get(k, 0.0) + v
            t_bwd = time.perf_counter() - t0
            if split is not None:
                _finite(step, "gradient", {"student": split.g_student, "teacher": split.g_teacher})

            # --- projection by arm on the gradient and/or the update; clip; AdamW step (SPEC §1.5, §3) ---
            stats = projection.apply_arm(knobs, V_hack, P.arm if P.target != "update" else "none", P.gate,
                                         P.overshoot, P.preserve_magnitude, split=split)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, O.clip_norm or math.inf)
            if P.purge_moments and P.arm != "none":  # Adam bypass: drop hack-ward momentum before it acts
                stats |= projection.purge_moments(opt, knobs, V_hack, "no_gate" if P.gate == "no_gate"
                                                  else "one_sided")
            before = projection.snapshot(knobs)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            if keep:  # every group zero-variance: no signal, no step (Adam's momentum alone would still move)
                opt.step()
            stats |= projection.project_update(knobs, before, V_hack, P.arm if P.target != "grad" else "none",
                                               P.gate, P.overshoot, P.preserve_magnitude)

            # --- optional: online V refresh and deploy-eval (greedy), both with the quarantine ablated ---
            row: dict = {}
            if P.refresh_every and (step + 1) % P.refresh_every == 0:
                with knobs.ablate_quarantine():
                    fresh = direction.extract_direction(model, knobs, tok, v_pairs, settings)
                V_new, _ = direction.postprocess(fresh.V, fresh.S, P.k_use, P.drop_bottom_frac)
                both = [n for n in V_new if n in V_hack]  # ||V_old V_new^T||_F^2 / K, mean over modules
                row["proj/v_overlap"] = sum(float((V_hack[n] @ V_new[n].T).square().sum()) / min(
                    len(V_hack[n]), len(V_new[n])) for n in both) / max(1, len(both))
                V_hack = V_new
            if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
                    ev = generate(model, [prompt_ids[i] for i in ids], 1, max_new_tokens=R.max_new_tokens,
                                  temperature=0.0, seed=0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
                eg = grader.grade_batch([tok.decode(c, skip_special_tokens=True) for c in ev.completion_ids],
                                        [by_id[i] for i in ids])
                row["eval/deploy_hack"] = sum(g.exploited for g in eg) / len(eg)
                row["eval/deploy_solve"] = sum(g.gt_correct for g in eg) / len(eg)

            # --- metrics row: SPEC §4 keys and more, each defined in docs/metrics.md ---
            stu, tea = [r for r in rows if r["student"]], [r for r in rows if not r["student"]]
            mean = lambda rs, k: float(sum(r[k] for r in rs) / len(rs)) if rs else 0.0
            row |= {k: float(v) for k, v in {**adv_stats, **stats}.items()} | acc
            row |= {"lr": lr_at(step), "grad/norm": float(grad_norm), "teacher/mode": L.teacher,
                    "teacher/frac": len(tea) / len(rows),  # rewards as trained on (gt_penalty applied)
                    "reward/student_mean": float(rewards[:, :R.G_s].mean()),
                    "reward/teacher_mean": float(rewards[:, R.G_s:].mean()) if R.G_t else 0.0,
                    "adv/student_mean": float(adv[:, :R.G_s].mean()),
                    "adv/teacher_mean": float(adv[:, R.G_s:].mean()) if R.G_t else 0.0,
                    "hack/student": mean(stu, "exploited"), "hack/teacher": mean(tea, "exploited"),
                    "solve/student": mean(stu, "gt_correct"), "solve/teacher": mean(tea, "gt_correct"),
                    "hack/deploy": sum(d[0] for d in deploy) / len(deploy),
                    "solve/deploy": sum(d[1] for d in deploy) / len(deploy),
                    "format/deploy": sum(d[2] for d in deploy) / len(deploy),
                    "knob/norm": float(torch.cat(list(knobs.values("main").values())).norm()),
                    "knob/hack_norm": float(torch.cat(list(knobs.values("hack").values())).norm()),
                    "completion/mean_len": sum(len(r["completion_ids"]) for r in stu) / len(stu),
                    "completion/max_len": max(len(r["completion_ids"]) for r in stu),
                    "completion/clipped_frac": mean(stu, "truncated"),
                    "sandbox/timeout_frac": mean(stu, "timeout"),
                    "groups/zero_std": float(zero.sum()), "groups/skipped": float(len(pids) - len(keep)),
                    "groups/resampled": float(resampled), "groups/resample_tries": float(extra),
                    "time/generate": t_gen, "time/grade": t_grade, "time/backward": t_bwd}
            for k in metrics.REQUIRED_METRICS:  # a step with every group skipped measured no loss: 0
                row.setdefault(k, 0.0)
            row["time/step"] = time.perf_counter() - t_step
            bar.update(logger.log(step, row))

            # --- checkpoint (atomic): knobs + current V_hack, optimizer, RNG, cursors, config ---
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == cfg.run.steps:
                state = {f"delta/{n}": m.delta for n, m in knobs.modules.items()}
                state |= {f"hack/{n}": m.delta_hack for n, m in knobs.modules.items()}
                state |= {f"V/{n}": v for n, v in V_hack.items()}
                cursors = {"prompts": prompts_cur.state_dict(), "pool": pool_cur.state_dict()}
                checkpoint.save_checkpoint(run_dir, step + 1, knobs_state=state, optimizer=opt,
                                           scheduler=None, cursors=cursors, config=cfg.to_dict())
        bar.close()
        logger.close()

    # --- end: summary.json (last-5-step means) and a sample generation (greedy, quarantine ablated) ---
    with knobs.ablate_quarantine(), torch.no_grad(), knobs.merged():
        sample = generate(model, [prompt_ids[ids[0]]], 1, max_new_tokens=R.max_new_tokens, temperature=0.0,
                          seed=0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    summary = metrics.summarize(metrics.read_rows(run_dir / metrics.METRICS_FILE))
    summary |= {"run_dir": str(run_dir), "arm": P.arm, "teacher": L.teacher, "v_hack": v_status,
                "sample_problem": ids[0],
                "sample": tok.decode(sample.completion_ids[0], skip_special_tokens=True)}
    store.write_json_atomic(run_dir / metrics.SUMMARY_FILE, summary)
    print("\n".join(f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v!r}"
                    for k, v in summary.items()))
    return summary


# --- CLI: projected-grpo train ------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """`projected-grpo train`: parse, run, print the summary. Exit 2 on a bad option."""
    try:
        cfg = presets.from_argv(argv)
    except ValueError as e:
        print(f"projected-grpo train: {e}", file=sys.stderr)
        return 2
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
