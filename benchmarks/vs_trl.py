"""projected-grpo vs TRL's GRPOTrainer on one model and GRPO config: step time, tokens/s, peak RSS, math.

Builds one tiny Llama-style model and its tokenizer (projected_grpo.organism.build, offline), saves them to a
temporary directory (or takes a local HF model directory, --model-dir), and trains it from there with both
trainers: same prompts (the built-in problems), same reward callable, group size, completion length,
learning rate, loss (`dr_grpo`, `grpo`), beta (0, 0.04), k3 KL, clip eps 0.2, fp32 on CPU, one thread
each. Ours trains the SVD knobs (arm `none`, no teacher rows; the reference is the base model with knobs
zeroed; its own defaults otherwise: prefix-shared scoring and prefill, no gradient checkpointing unless
--ckpt 1); TRL trains the full model (its default; with beta > 0 it loads a second copy as the
reference, and it turns gradient checkpointing on by default). --pairings runs named pairs instead
(TRL + PEFT LoRA r16 against our LoRA or SVD knob of rank 16; TRL full fine-tuning against our SVD knob
of rank 16), one RESULT line each. Each run is its own subprocess (benchmarks/_vs_trl_worker.py), so
peak RSS is per trainer; the trainers alternate (order flipped every repetition, the CPU is shared) and
medians are reported; each run's first step is dropped as warm-up. Before timing, the loss values (and
their gradients) of both are compared on identical inputs for every loss type they share. --profile
adds one run per trainer and cell with its CPU time split by phase (generate, reward, reference,
forward, backward, optimizer, overhead).

    .venv/bin/pip install -e ".[bench]"   # trl, psutil, peft
    .venv/bin/python benchmarks/vs_trl.py [--reps 2] [--steps 4] [--hidden 256] [--layers 4] [--profile]
    .venv/bin/python benchmarks/vs_trl.py --model-dir DIR --pairings lora16,svd16,full_ref --betas 0.04 \
        --ckpt 0 --micro 1 --sample-dtype auto    # SmolLM2 on a 2-core CPU: ours within 0.6x TRL's memory

Last line: `RESULT step_time_ratio=<ours/trl> memory_ratio=<ours/trl>` for dr_grpo at beta = 0.04
(wall-clock step time; peak RSS of the trainer process); with --pairings, `RESULT pairing=<name> ...`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import defaultdict

import torch

from projected_grpo.objective.losses import AGGREGATIONS, KL_ESTIMATORS, Denominators, clip_surrogate

WORKER = pathlib.Path(__file__).with_name("_vs_trl_worker.py")
SHARED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
EPS = 0.2


# --- math: the same loss on identical inputs -----------------------------------------------------

def our_loss(loss_type: str, logp, logp_old, logp_ref, adv, mask, *, beta: float, G: int, max_new: int,
             n_micro: int) -> torch.Tensor:
    """The step loss exactly as train.py builds it: per micro-batch agg(surrogate) + beta * agg(k3), summed.

    logp, logp_old, logp_ref, mask: (N, T) with N = B * G rows, prompt-major; adv: (N,).
    """
    N = logp.shape[0]
    denoms = Denominators(n_seqs=N, n_tokens=int(mask.sum()), const=float(G * max_new * (N // G)))
    agg, total = AGGREGATIONS[loss_type], torch.zeros(())
    for rows in torch.arange(N).chunk(n_micro):
        pg, _ = clip_surrogate(logp[rows], logp_old[rows], adv[rows], mask[rows], eps_low=EPS, eps_high=EPS)
        kl, _ = KL_ESTIMATORS["k3"](logp[rows], logp_ref[rows], mask[rows])
        total = total + agg(pg, mask[rows], denoms)[0] + beta * agg(kl, mask[rows], denoms)[0]
    return total


class _Accelerator:
    """What GRPOTrainer._compute_loss asks of accelerate on one process."""

    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type: str, logp, logp_old, logp_ref, adv, mask, *, beta: float, G: int, max_new: int,
             n_micro: int) -> torch.Tensor:
    """TRL's own `GRPOTrainer._compute_loss`, run on a bare trainer object whose log-prob forward returns
    `logp`; summed over n_micro gradient-accumulation micro-batches (steps_per_generation = n_micro), as
    TRL's Trainer sums the micro-batch losses it backpropagates. Shapes as in `our_loss`."""
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)  # no model, no datasets: only the attributes _compute_loss reads
    t.__dict__.update(
        loss_type=loss_type, beta=beta, epsilon_low=EPS, epsilon_high=EPS, max_completion_length=max_new,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=n_micro,
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=n_micro),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    total = torch.zeros(())
    for rows in torch.arange(logp.shape[0]).chunk(n_micro):
        n = len(rows)
        # the forward is replaced by the given log-probs (entropy unused: no entropy bonus, no aux loss)
        t._get_per_token_logps_and_entropies = lambda *a, rows=rows, **k: (logp[rows], torch.zeros_like(
            logp[rows]), None)
        ids = torch.zeros(n, 1, dtype=torch.long)
        inputs = {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "completion_mask": mask[rows],
                  "completion_ids": torch.zeros(mask[rows].shape, dtype=torch.long),
                  "advantages": adv[rows], "old_per_token_logps": logp_old[rows],
                  "ref_per_token_logps": logp_ref[rows], "num_items_in_batch": mask.sum()}
        total = total + t._compute_loss(None, inputs)
    return total


def loss_inputs(seed: int, B: int = 2, G: int = 4, T: int = 6) -> dict[str, torch.Tensor]:
    """Random but realistic inputs: ragged completions (one of length 1), ratios on both sides of the clip."""
    g = torch.Generator().manual_seed(seed)
    N = B * G
    logp = -3.0 * torch.rand(N, T, generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0], lengths[-1] = 1, T
    return {"logp": logp, "logp_old": logp + 0.4 * torch.randn(N, T, generator=g),
            "logp_ref": logp + 0.3 * torch.randn(N, T, generator=g), "adv": torch.randn(N, generator=g),
            "mask": (torch.arange(T)[None, :] < lengths[:, None]).float()}


def loss_check(seed: int = 0, G: int = 4, T: int = 6) -> list[dict]:
    """Per (loss type, beta, micro-batches): both losses, |diff|, max |grad diff| (d loss / d logp)."""
    out = []
    for loss_type, beta, n_micro in itertools.product(SHARED_LOSSES, (0.0, 0.04), (1, 2)):
        x = loss_inputs(seed, G=G, T=T)
        vals, grads = [], []
        for fn in (our_loss, trl_loss):
            logp = x["logp"].clone().requires_grad_(True)
            v = fn(loss_type, logp, x["logp_old"], x["logp_ref"], x["adv"], x["mask"], beta=beta, G=G,
                   max_new=T, n_micro=n_micro)
            v.backward()
            vals.append(float(v.detach()))
            grads.append(logp.grad)
        out.append({"loss": loss_type, "beta": beta, "n_micro": n_micro, "ours": vals[0], "trl": vals[1],
                    "abs_diff": abs(vals[0] - vals[1]),
                    "grad_max_diff": float((grads[0] - grads[1]).abs().max())})
    return out


def matches(row: dict) -> bool:
    """fp32 agreement: values to 1e-5 relative (1e-7 absolute), gradients to 1e-6 absolute."""
    return math.isclose(row["ours"], row["trl"], rel_tol=1e-5, abs_tol=1e-7) and row["grad_max_diff"] <= 1e-6


DEFINITIONS = """\
definitions (where they can differ):
  dr_grpo: TRL divides each micro-batch by (its rows x max_completion_length x grad-accum steps); ours by
           G x max_new_tokens x prompts_per_step for the whole step. Equal for equal micro-batches. Ours skips
           zero-variance groups but keeps the constant; TRL keeps them (advantage 0), so with beta > 0 their
           KL term counts in TRL's loss and not in ours.
  grpo:    per-sequence token mean, then mean over the step's sequences: equal (same skip caveat).
  bnpo:    TRL: token mean of the micro-batch / grad-accum steps; ours: token mean x N_mb / n_seqs. Equal
           for equal micro-batches.
  dapo:    TRL: token sum / num_items_in_batch (generation batch, all processes); ours: / the step's
           completion tokens. Equal on one process.
  KL:      both k3 = exp(ref - logp) - (ref - logp) - 1, added as beta * KL to the token loss (TRL) or
           aggregated separately and added (ours): the same value, aggregations being linear.
  advantages: grpo = (R - mean_g) / (std_g + 1e-4), std Bessel-corrected, in both; dr_grpo = R - mean_g
           (TRL scale_rewards="none")."""


# --- timing runs ------------------------------------------------------------------------------

def build_model(model_dir: pathlib.Path, hidden: int, layers: int) -> int:
    """Tiny Llama-style LM + the built-in-corpus BPE tokenizer, saved as a HF directory; returns #params."""
    from projected_grpo.organism.build import build_tokenizer, tiny_model
    from projected_grpo.organism.warmup import builtin_corpus

    tok = build_tokenizer(builtin_corpus().texts(), vocab_size=1024)
    model = tiny_model(tok, hidden=hidden, layers=layers, heads=4, seed=0)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def random_like(src: str, model_dir: pathlib.Path, dtype: str) -> pathlib.Path:
    """src's architecture (config.json) and tokenizer, with seeded random weights in `dtype`, saved to
    model_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=getattr(torch, dtype))
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(src).save_pretrained(model_dir)
    return model_dir


def run_worker(spec: dict, tmp: pathlib.Path, tag: str) -> dict:
    """One trainer in a fresh process; adds `tree_peak_rss_mb` (process + children, sampled each 50 ms)."""
    import psutil

    spec_path, out_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    log = open(tmp / f"{tag}.log", "w")
    proc = subprocess.Popen([sys.executable, str(WORKER), str(spec_path), str(out_path)], stdout=log,
                            stderr=log)
    peak = [0.0]

    def sample():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
                peak[0] = max(peak[0], rss / 2**20)
            except psutil.Error:  # a child exited between listing and reading: take the next sample
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    sampler.join()
    log.close()
    if rc != 0:
        raise RuntimeError(f"{tag}: worker exited {rc}; its log: {tmp / f'{tag}.log'}:\n"
                           + (tmp / f"{tag}.log").read_text()[-3000:])
    return json.loads(out_path.read_text()) | {"tree_peak_rss_mb": peak[0]}


PHASES = ("generate", "reward", "reference", "forward", "backward", "optimizer", "overhead")


def print_profile(prof: dict[tuple, dict]) -> None:
    """Median CPU ms per step by phase (worker.Phases), one line per (cell, trainer)."""
    print("\n== profile: CPU ms per step by phase (median over steps 2..; one run each) ==")
    print(f"{'loss':>7} {'beta':>5} {'trainer':>7} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'step':>7}")
    for (loss, beta, trainer), r in prof.items():
        ph = r["phases_cpu"]
        cells = [1e3 * statistics.median(ph[p]) if ph.get(p) else 0.0 for p in PHASES]
        print(f"{loss:>7} {beta:>5} {trainer:>7} " + " ".join(f"{c:>9.0f}" for c in cells)
              + f" {1e3 * statistics.median(r['cpu_s']):>7.0f}")


def versions() -> str:
    import importlib.metadata as md
    import importlib.util

    names = ("torch", "transformers", "trl", "accelerate", "datasets", "peft")
    pkgs = ", ".join(f"{p} {md.version(p)}" for p in names if importlib.util.find_spec(p))
    return f"python {platform.python_version()}, {pkgs}; {platform.machine()}, {os.cpu_count()} cores"


# pairing -> (ours' knob and rank, TRL's LoRA rank: 0 = full fine-tuning) on a real model (docs/benchmarks.md)
PAIRINGS = {"lora16": (("lora", 16), 16), "svd16": (("svd", 16), 16), "full_ref": (("svd", 16), 0)}


def side_name(trainer: str, spec: dict) -> str:
    if trainer == "ours":
        return f"ours-{spec['knob']}{spec['rank'] or ('-full' if spec['knob'] == 'svd' else '16')}"
    return f"trl-lora{spec['trl_lora_r']}" if spec["trl_lora_r"] else "trl-full"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="runs per (trainer, loss, beta); 0 with --profile: "
                    "the profile alone")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step B")
    ap.add_argument("--group", type=int, default=4, help="group size G")
    ap.add_argument("--max-new", type=int, default=32, help="completion length limit")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model-dir", default="", help="a local HF model directory (e.g. the one "
                    "`projected-grpo get-model smollm2` prints) instead of the built tiny Llama")
    ap.add_argument("--pairings", default="", help=f"comma list of {', '.join(PAIRINGS)}: ours vs TRL per "
                    "pairing, one RESULT line each (instead of --knob/--rank against TRL full fine-tuning)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="both trainers' device (cuda: TRL without use_cpu; "
                    "memory is then the GPU's peak allocated, RSS beside it)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: ours loads the frozen base in bf16 (knobs fp32); TRL: bf16=True")
    ap.add_argument("--random-weights", action="store_true", help="with --model-dir: that architecture and "
                    "tokenizer with seeded random weights, saved in --dtype (the cost of the architecture, "
                    "where its weights cannot travel; a random model samples to max_new every time)")
    ap.add_argument("--knob", default="svd", choices=["svd", "lora"], help="our knob adapter")
    ap.add_argument("--rank", type=int, default=0, help="our knob rank (0: svd full, lora 16)")
    ap.add_argument("--ckpt", type=int, default=0, help="our gradient checkpointing "
                    "(model.grad_checkpointing: off by default in ours, on by default in TRL)")
    ap.add_argument("--share-prefix", type=int, default=1, help="ours: rollout.share_prefix (1: each prompt "
                    "run once per group; 0: every row recomputes its prompt)")
    ap.add_argument("--sample-dtype", default="model", choices=["model", "float32", "bfloat16", "auto"],
                    help="ours: rollout.sample_dtype (float32 / bfloat16: students sampled from packed "
                    "weights in that dtype, sampling/packed.py; auto: bf16 where the CPU has bf16 kernels, "
                    "else fp32; TRL samples in fp32 either way)")
    ap.add_argument("--micro", type=int, default=0, help="ours: rollout.micro_prompts (prompts per "
                    "forward/backward micro-batch; 0: all at once). TRL: --trl-micro")
    ap.add_argument("--trl-micro", type=int, default=0, help="TRL: rows per micro-batch N (the step's B x G "
                    "rows as B x G / N accumulated micro-batches after one generation; 0: all in one batch, "
                    "gradient_accumulation_steps 1)")
    ap.add_argument("--cuda-graph", type=int, default=0, help="ours: rollout.cuda_graph (1: each decode step "
                    "replayed from a CUDA graph, sampling/graphed.py; --device cuda only)")
    ap.add_argument("--profile", action="store_true",
                    help="also one profiled run per trainer and cell: CPU time per step by phase")
    ap.add_argument("--losses", default="dr_grpo,grpo")
    ap.add_argument("--betas", default="0,0.04")
    opt = ap.parse_args()
    t_start = time.perf_counter()
    pairings = {p: PAIRINGS[p] for p in opt.pairings.split(",") if p} or {
        "default": ((opt.knob, opt.rank), 0)}

    print("== loss equality on identical inputs (TRL GRPOTrainer._compute_loss vs our objective.losses) ==")
    rows = loss_check()
    for r in rows:
        ok = "match" if matches(r) else "DIFFER"
        print(f"  {r['loss']:>7} beta={r['beta']:<4} micro={r['n_micro']}  ours={r['ours']:+.8f} "
              f"trl={r['trl']:+.8f}  |diff|={r['abs_diff']:.1e} grad |diff|={r['grad_max_diff']:.1e}  {ok}")
    print(DEFINITIONS)

    with tempfile.TemporaryDirectory(prefix="vs_trl-") as d:
        tmp = pathlib.Path(d)
        if opt.model_dir:
            from transformers import AutoConfig

            model_dir, cfg = opt.model_dir, AutoConfig.from_pretrained(opt.model_dir)
            what = (f"{cfg.model_type} from {model_dir} (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} "
                    f"layers, vocab {cfg.vocab_size})")
            if opt.random_weights:
                model_dir = str(random_like(opt.model_dir, tmp / "model", opt.dtype))
                what += f", random weights in {opt.dtype}"
        else:
            model_dir = str(tmp / "model")
            n_params = build_model(tmp / "model", opt.hidden, opt.layers)
            what = f"{n_params / 1e6:.2f}M-param Llama (hidden {opt.hidden}, {opt.layers} layers)"
        base = {"model_dir": model_dir, "cache_dir": str(tmp / "cache"), "tmp": str(tmp),
                "B": opt.prompts, "G": opt.group, "max_new": opt.max_new, "lr": opt.lr, "steps": opt.steps,
                "seed": 0, "threads": opt.threads, "ckpt": bool(opt.ckpt),
                "share_prefix": bool(opt.share_prefix), "sample_dtype": opt.sample_dtype, "micro": opt.micro,
                "trl_micro": opt.trl_micro,
                "device": opt.device, "dtype": opt.dtype, "cuda_graph": bool(opt.cuda_graph)}
        cells = [(lo, float(b)) for lo in opt.losses.split(",") for b in opt.betas.split(",")]
        # each distinct trainer setting runs once per (rep, cell), shared by the pairings that use it
        sides: dict[str, dict] = {}
        for (knob, rank), trl_r in pairings.values():
            for trainer, extra in (("ours", {"knob": knob, "rank": rank}), ("trl", {"trl_lora_r": trl_r})):
                spec = {"trainer": trainer, "knob": knob, "rank": rank, "trl_lora_r": trl_r, **extra}
                sides.setdefault(side_name(trainer, spec), spec)
        print(f"\n== timing: {what}, B={opt.prompts} G={opt.group} max_new={opt.max_new} lr={opt.lr}, "
              f"{opt.steps} steps x {opt.reps} runs per cell, {opt.threads} thread(s); ours: ckpt={opt.ckpt} "
              f"micro={opt.micro} sample_dtype={opt.sample_dtype}; TRL: rows per micro-batch "
              f"{opt.trl_micro or opt.prompts * opt.group}; sides: "
              f"{', '.join(sides)} ==")
        # warm-up: ours caches its SVDs on first use; that one-off is not timed
        for name, side in sides.items():
            if side["trainer"] == "ours":
                run_worker({**base, **side, "loss": cells[0][0], "beta": cells[0][1], "steps": 1}, tmp,
                           f"warm-{name}")
        res: dict[tuple, list[dict]] = defaultdict(list)
        for rep in range(opt.reps):
            for loss, beta in cells:
                order = list(sides.items()) if rep % 2 == 0 else list(sides.items())[::-1]
                for name, side in order:
                    spec = {**base, **side, "loss": loss, "beta": beta}
                    res[(loss, beta, name)].append(run_worker(spec, tmp, f"{name}-{loss}-{beta}-{rep}"))
        prof = {(loss, beta, name): run_worker({**base, **side, "loss": loss, "beta": beta, "profile": True},
                                               tmp, f"prof-{name}-{loss}-{beta}")
                for loss, beta in cells for name, side in sides.items()} if opt.profile else {}

    if prof:
        print_profile(prof)
    if not res:  # --reps 0 --profile: the profile alone
        return
    med = statistics.median
    summary = {}
    gpu = opt.device.startswith("cuda")
    gpu_head = f"{'gpu MB':>8}" if gpu else ""
    print(f"\n{'loss':>7} {'beta':>5} {'trainer':>13} {'step s':>7} {'cpu s':>6} {'tok/s':>6} {'rss MB':>7} "
          f"{'tree MB':>7}{gpu_head}   ours: generate / backward s")
    for (loss, beta, name), runs in res.items():
        steps = [s for r in runs for s in r["step_s"][1:]]
        toks = [t / s for r in runs for t, s in zip(r["tokens"][1:], r["step_s"][1:])]
        cpu = [c for r in runs for c in r["cpu_s"]]
        s = summary[(loss, beta, name)] = {"step": med(steps), "cpu": med(cpu), "tok_s": med(toks),
                                           "rss": med(r["peak_rss_mb"] for r in runs),
                                           "tree": med(r["tree_peak_rss_mb"] for r in runs),
                                           "gpu": med(r.get("gpu_peak_mb", 0.0) for r in runs)}
        ph = ""
        if name.startswith("ours"):
            ph = " / ".join(f"{med(x for r in runs for x in r['phases'][k][1:]):.2f}"
                            for k in ("generate", "backward"))
        gpu_col = f"{s['gpu']:>8.0f}" if gpu else ""
        print(f"{loss:>7} {beta:>5} {name:>13} {s['step']:>7.2f} {s['cpu']:>6.2f} {s['tok_s']:>6.0f} "
              f"{s['rss']:>7.0f} {s['tree']:>7.0f}{gpu_col}   {ph}")
    print(f"\n{versions()}; {torch.get_num_threads()} torch threads here, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    key = ("dr_grpo", 0.04) if ("dr_grpo", 0.04) in cells else cells[-1]
    for pairing, ((knob, rank), trl_r) in pairings.items():
        o = summary[(*key, side_name("ours", {"knob": knob, "rank": rank}))]
        t = summary[(*key, side_name("trl", {"trl_lora_r": trl_r}))]
        tag = "" if pairing == "default" else f"pairing={pairing} "
        print(f"{tag}cpu_time_ratio={o['cpu'] / t['cpu']:.3f} tree_memory_ratio={o['tree'] / t['tree']:.3f} "
              f"(loss {key[0]}, beta {key[1]})")
        mem = "gpu" if gpu else "rss"  # on a GPU the memory that bounds the work is the device's
        print(f"RESULT {tag}step_time_ratio={o['step'] / t['step']:.3f} "
              f"memory_ratio={o[mem] / t[mem]:.3f}")


if __name__ == "__main__":
    main()
