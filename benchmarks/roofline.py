"""This machine's roofline for one GRPO step of a real model, and ours as a fraction of it.

Absolute tokens/s differ between machines; the fraction of what this machine allows is the figure. In one
process, in rounds (the CPU is shared: each round's figures are taken beside its own probes):
  probes     sustained matmul rate, fp32 and bf16 (F.linear at the training step's shapes, best of 5; bf16
             only counts where torch reports bf16 units), and memory read bandwidth (sum over 512 MiB);
  sampling   `generate` of the step's B prompts x G_s samples x T tokens in one batch (EOS off, so every row
             is T tokens) with the knobs merged, as the rollout step calls it (B = rollout.prompts_per_step,
             or --prompts; rollout.sample_dtype and share_prefix of the config);
  training   the step's merge of W_eff and the train loop's forward + backward on the first prompt's rows
             plus a teacher row (one micro-batch of one prompt: prefix-shared scoring, the per-source
             capture, the clipped surrogate: run/train.py's body).
Bounds (all work counted, nothing assumed free; attention included; each dtype at its own measured rate):
  sampling   prefill: FLOPs / rate; each decode step: max(FLOPs / rate, bytes / bandwidth), its bytes every
             weight in the sampling dtype and the KV cache read so far. The packing of the bf16 weights is
             not in the bound (it is our overhead).
  training   FLOPs / fp32 rate of: the forward, the input-gradient backward (frozen weights: no weight
             gradient), each knob gradient in its cheaper form (thin or through the weight gradient), and
             the W_eff merge (a full-rank SVD knob is merged once per step).
The sampler's kernel alone: each decode step's projections timed in the sampler's own matmul kernel
(packed.packed_linear's: the blocked few-row kernel for fp32, oneDNN's prepacked one for bf16; F.linear for
exact sampling) at its row count, weights read from memory, plus the prefill's bound: the most the sampling
fraction could be with that kernel and no other cost (printed beside it with ours as a fraction of it; not
in the RESULT line).
The fractions are CPU-time ratios (process CPU time of this one-thread process, probes included), so a
busy machine inflates probes and workloads alike; wall-clock fractions are printed beside them. On more than
one thread (`--run.threads N`) the RESULT line takes the wall-clock ones: CPU time adds the threads' up.
On CUDA (`--model.device cuda`) every time is wall-clock after a device synchronise (the host's CPU time says
nothing of the GPU's), the rates are the device's (fp32 and bf16 matmul, HBM read), and the kernel alone is
F.linear in the model's dtype.

    PYTHONPATH=src .venv/bin/python benchmarks/roofline.py [--rounds 3] [--new 96] [--preset smollm2-cpu]
    ... --preset smollm2-gpu --model DIR --model.dtype bfloat16 --rollout.sample-dtype model --new 128
    ... --profile 20    (then one more sampling round under torch.profiler: its 20 costliest ops)
    (any `--section.field VALUE` after the options above changes the preset, as every command's do)

Needs `projected-grpo get-model smollm2` (the preset's model). Last line:
`RESULT sample_roofline=<x> train_roofline=<y>` (medians over rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from projected_grpo import presets
from projected_grpo.objective.losses import AGGREGATIONS, Denominators, clip_surrogate
from projected_grpo.objective.teacher import TEACHER_MODES
from projected_grpo.run import setup
from projected_grpo.sampling.generate import generate
from projected_grpo.sampling.pack import as_ids, encode_completion
from projected_grpo.sampling.packed import packed_linear
from projected_grpo.sampling.prefix import scoring
from projected_grpo.sampling.sample import SAMPLE_DTYPES, concrete_dtype

DEVICE = torch.device("cpu")  # set once in main from the config's model.device


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _timed(fn, reps: int = 1):
    """(best process CPU seconds, best wall seconds, the last call's value) of fn() over reps calls. On CUDA
    both are the wall-clock seconds after a synchronise: the host's CPU time is not the GPU's."""
    best, out = (float("inf"), float("inf")), None
    for _ in range(reps):
        _sync()
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        _sync()
        wall = time.perf_counter() - w
        best = min(best, (wall if DEVICE.type == "cuda" else time.process_time() - c, wall))
    return (*best, out)


def profile_sampling(sample, top: int) -> None:
    """One more sampling round under torch.profiler: its `top` costliest ops by self time (the device's on
    CUDA), and on CUDA the kernels' summed time against the round's wall time: far below it, the decode is
    bound by launches and the host, not by the device's work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        _, wall, _ = _timed(sample)
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=top))
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        print(f"profiled sampling round: {wall:.3f} s wall (under the profiler), kernels {busy:.3f} s "
              f"({busy / wall:.2f} of it), {len(kernels)} kernel runs")


def probe(rows: int, d_in: int, d_out: int) -> dict[str, float]:
    """Sustained rates: matmul GFLOP/s per dtype (CPU and wall) and read bandwidth GB/s."""
    out = {}
    cuda = DEVICE.type == "cuda"
    bf16 = cuda or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    reps = 100 if cuda else 10  # a GPU runs 10 of these in well under a millisecond
    for dt in [torch.float32] + ([torch.bfloat16] if bf16 else []):
        x, w = torch.randn(rows, d_in, device=DEVICE).to(dt), torch.randn(d_out, d_in, device=DEVICE).to(dt)
        flops = reps * 2 * rows * d_in * d_out
        F.linear(x, w)  # warm-up: the first call on a GPU picks its kernel
        c, wall, _ = _timed(lambda x=x, w=w: [F.linear(x, w) for _ in range(reps)], reps=5)
        out[f"{dt}"] = flops / c / 1e9
        out[f"{dt} wall"] = flops / wall / 1e9
    big = torch.ones(2**30 if cuda else 2**27, device=DEVICE)  # 4 GiB (past any GPU cache) / 512 MiB of fp32
    big.sum()
    c, wall, _ = _timed(lambda: big.sum(), reps=3)
    out["bw"], out["bw wall"] = big.numel() * 4 / c / 1e9, big.numel() * 4 / wall / 1e9
    return out


def linear_shapes(model) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([(d_out, d_in)] of every projection in the decoder layers, (V, E) of the lm_head)."""
    body = [tuple(m.weight.shape) if hasattr(m, "weight") else tuple(m.base.weight.shape)
            for name, m in model.model.layers.named_modules()
            if name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj")]
    return body, tuple(model.lm_head.weight.shape)


def prefill_bound(model, P: int, rate: float) -> float:
    """Seconds the shared prefill of one prompt of P tokens needs at least at `rate` GFLOP/s (it is
    compute-bound): every projection for P positions, the lm_head for the last, causal attention."""
    body, (V, E) = linear_shapes(model)
    c = model.config
    L, H = c.num_hidden_layers, c.num_attention_heads
    D = E // H
    return (P * 2 * sum(o * i for o, i in body) + 2 * V * E + 2 * H * D * P * P * L) / (rate * 1e9)


def sample_bound(model, Ps: list[int], N: int, T: int, rate: float, bw: float, nbytes: int) -> float:
    """Seconds this machine needs at least to sample N rows x T tokens after each prompt of Ps (P_b tokens;
    each prefill shared by its N rows, all B * N rows decoded together), with weights of `nbytes` bytes per
    element, at `rate` GFLOP/s and `bw` GB/s."""
    body, (V, E) = linear_shapes(model)
    c = model.config
    L, H, Hkv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    D = E // H
    per_tok = 2 * sum(o * i for o, i in body)
    weight_bytes = nbytes * (sum(o * i for o, i in body) + V * E)
    t = sum(prefill_bound(model, P, rate) for P in Ps)
    for j in range(1, T):  # T tokens need T - 1 decode steps (the first comes from the prefill)
        flops = sum(N * (per_tok + 2 * V * E + 4 * H * D * (P + j) * L) for P in Ps)
        moved = weight_bytes + sum(N * 2 * L * Hkv * D * (P + j) * nbytes for P in Ps)
        t += max(flops / (rate * 1e9), moved / (bw * 1e9))
    return t


def decode_shapes(model) -> dict[tuple[int, int], int]:
    """(d_out, d_in) -> how many of that projection a decode step runs, as the samplers lay them out: a
    layer's q, k and v as one matmul (packed.py), then o, gate, up, down, and the lm_head."""
    c = model.config
    E, H, Hkv, L = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers
    D, inter, V = getattr(c, "head_dim", None) or E // H, c.intermediate_size, model.lm_head.weight.shape[0]
    out: dict[tuple[int, int], int] = {}
    for shape, n in (((H * D + 2 * Hkv * D, E), L), ((E, H * D), L), ((inter, E), 2 * L), ((E, inter), L),
                     ((V, E), 1)):
        out[shape] = out.get(shape, 0) + n
    return out


def kernel_step(model, rows: int, dtype: torch.dtype | None) -> float:
    """CPU seconds one decode step's projections take in the sampler's own matmul kernel at `rows` rows, and
    nothing else: packed.packed_linear's kernel in `dtype` (gemv.py's for fp32, oneDNN's for bf16), or
    F.linear in the model's dtype for exact sampling (dtype None; always on CUDA). Each shape is timed over
    copies of its weight that together exceed the caches (256 MB), best of 3, as a decode step reads them:
    once each, from memory."""
    total, dt = 0.0, dtype or next(model.parameters()).dtype
    for (d_out, d_in), count in decode_shapes(model).items():
        copies = max(2, int(256e6 // (d_out * d_in * dt.itemsize)))
        x = torch.randn(rows, d_in, device=DEVICE).to(dt)
        if dtype is None or DEVICE.type == "cuda":
            ws = [torch.randn(d_out, d_in, device=DEVICE).to(dt) for _ in range(copies)]
            calls = [lambda w=w, x=x: F.linear(x, w) for w in ws]
        else:
            ws = [packed_linear(torch.randn(d_out, d_in), None, dt, rows) for _ in range(copies)]
            calls = [lambda w=w, x=x: w(x) for w in ws]
        with torch.inference_mode():
            c, _, _ = _timed(lambda calls=calls: [f() for f in calls], reps=3)
        total += count * c / copies
    return total


def train_bound(model, knobs, segments: list[tuple[int, int]], head_tokens: int, rate: float) -> float:
    """Seconds the training step's merge + forward + backward need at least at `rate` GFLOP/s (the frozen
    weights' dtype; the knob math is fp32 whatever it is, counted at the same rate: a lower bound).

    segments: the forward's rows as (first position, positions): a shared prompt row (0, P), a completion
    on it (P, T - 1), a packed row (0, P + T - 1); head_tokens: completion tokens scored (lm_head rows)."""
    body, (V, E) = linear_shapes(model)
    c = model.config
    L, H, D = c.num_hidden_layers, c.num_attention_heads, E // c.num_attention_heads
    n = sum(k for _, k in segments)
    attn = 4 * H * D * L * sum(k * (a + (k + 1) / 2) for a, k in segments)  # each position's keys so far
    fwd = 2 * n * sum(o * i for o, i in body) + 2 * head_tokens * V * E + attn
    bwd = fwd + attn  # input gradients: the matmuls transposed, attention's backward ~2x its forward
    knob = merge = 0.0
    for m in knobs.modules.values():
        d_out, d_in = m.base.weight.shape
        R = m.knob_dim if m.kind == "svd" else m.delta.shape[1]
        thin = 2 * n * R * (d_in + d_out)
        dw = 2 * n * d_in * d_out + 2 * 2 * R * d_out * d_in  # weight gradient, projected per source
        knob += min(thin, dw) if m.kind == "svd" else thin
        merge += 2 * d_out * R * d_in
    return (fwd + bwd + knob + merge) / (rate * 1e9)


def train_body(model, knobs, score, tok, prompt: torch.Tensor, comps: list[torch.Tensor],
               student: torch.Tensor):
    """run/train.py's micro-batch over one prompt (T_p,) and N completions (T_c,) of torch.long ids: pack,
    forward under the per-source capture, clipped surrogate with dr_grpo aggregation, backward (advantages
    +-1 so every row has a gradient)."""
    seqs = score.pack([prompt] * len(comps), comps, tok.pad_token_id, student).to(DEVICE)
    student = student.to(DEVICE)  # as run/train.py moves each micro-batch to the model's device
    mask = seqs.completion_mask
    adv = torch.tensor([1.0, -1.0] * (len(comps) // 2) + [1.0] * (len(comps) % 2), device=DEVICE)
    denoms = Denominators(n_seqs=len(comps), n_tokens=int(mask.sum()), const=float(mask.numel()))
    with knobs.capture(student) as cap:
        logp, _ = score.logprobs(model, seqs, temperature=1.0, with_entropy=True, capture=cap)
        logp_old, weight, _ = TEACHER_MODES["imitation"](logp, torch.zeros_like(logp), student, mask, 2.0)
        pg, _ = clip_surrogate(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
        loss, _ = AGGREGATIONS["dr_grpo"](weight * pg, mask, denoms)
        loss.backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-cpu")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=0, help="new tokens per sample (0: the preset's)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts sampled together (0: the preset's "
                    "rollout.prompts_per_step, as its rollout step samples them)")
    ap.add_argument("--sample-dtype", default="",
                    help="override rollout.sample_dtype (model, float32, bfloat16, auto)")
    ap.add_argument("--profile", type=int, default=0, help="after the rounds, one more sampling round under "
                    "torch.profiler: print its N costliest ops (0: none)")
    opt, overrides = ap.parse_known_args()
    argv = ["--preset", opt.preset, "--model", opt.model]
    argv += ["--rollout.sample-dtype", opt.sample_dtype] if opt.sample_dtype else []
    cfg, _ = presets.parse(argv + overrides, prog="roofline")
    global DEVICE
    DEVICE = torch.device(cfg.model.device)
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    torch.manual_seed(0)
    model, tok = setup.load_model(cfg)
    knobs = setup.wrap_knobs(cfg, model)
    with torch.no_grad():  # knobs away from zero, as after a step: W_eff is a real merge
        for p in knobs.parameters():
            p.normal_(0.0, 1e-3)
    env = setup.make_env(cfg)
    problems = env.problem_sets()["train"][:opt.prompts or cfg.rollout.prompts_per_step]
    table = setup.prompt_table(env, tok, problems)
    prompts = [table[p.id][1] for p in problems]
    prompt, Ps = prompts[0], [len(q) for q in prompts]
    teacher = as_ids(encode_completion(tok, env.templates(problems[0], "hack")[0]))
    T, N = opt.new or cfg.rollout.max_new_tokens, cfg.rollout.G_s
    B = len(prompts)
    dt = SAMPLE_DTYPES[concrete_dtype(cfg.rollout.sample_dtype, DEVICE)]
    model_dt = next(model.parameters()).dtype
    sample_dt = dt or model_dt
    nbytes = sample_dt.itemsize
    score = scoring(model, cfg.rollout.share_prefix)
    student = torch.tensor([True] * N + [False])
    graph = ", CUDA graph" if cfg.rollout.cuda_graph else ""
    print(f"model {cfg.model.path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; "
          f"{B} prompt(s) of {Ps} tokens, {N} samples each x {T} new tokens "
          f"(sampling in {sample_dt}{graph}), "
          f"training on the first's + 1 teacher row of {len(teacher)} tokens; "
          + (torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} "
             "thread(s)"))
    rows = []
    for r in range(opt.rounds):
        # 512 rows keep a CPU's matmul at its sustained rate; a GPU needs the training step's rows to fill it
        rows_probe = 512 if DEVICE.type == "cpu" else (N + 1) * (len(prompt) + T)
        pr = probe(rows_probe, model.config.hidden_size, model.config.intermediate_size)
        # a dtype without its own units here (bf16 on a CPU without them) is bounded at fp32's rate
        s_key, t_key = (str(d) if str(d) in pr else "torch.float32" for d in (sample_dt, model_dt))
        rate = pr[s_key]

        def sample(seed=r):
            with torch.no_grad(), knobs.merged():
                return generate(model, prompts, N, max_new_tokens=T, seed=seed, eos_id=[],
                                pad_id=tok.pad_token_id, share_prefill=cfg.rollout.share_prefix,
                                sample_dtype=dt, cuda_graph=cfg.rollout.cuda_graph)

        for m in knobs.modules.values():  # not timed here: the merge is the training side's (below)
            m.weight_eff()
        s_cpu, s_wall, ro = _timed(sample)
        comps = ro.completion_ids[:N] + [teacher]  # the first prompt's rows (prompt-major)
        s_bound = sample_bound(model, Ps, N, T, rate, pr["bw"], nbytes)
        s_bound_wall = sample_bound(model, Ps, N, T, pr[s_key + " wall"], pr["bw wall"], nbytes)
        # the sampler's own matmul kernel, alone: what the fraction could be with no other cost
        s_ceiling = (sum(prefill_bound(model, P, rate) for P in Ps)
                     + (T - 1) * kernel_step(model, B * N, dt))

        def train(comps=comps):
            with torch.no_grad():
                for p in knobs.parameters():  # a knob update: the next forward merges W_eff afresh
                    p.add_(1e-4)
            train_body(model, knobs, score, tok, prompt, comps, student)

        t_cpu, t_wall, _ = _timed(train)
        P = len(prompt)
        segments = ([(0, P), (0, P)] + [(P, len(c) - 1) for c in comps] if cfg.rollout.share_prefix
                    else [(0, P + len(c) - 1) for c in comps])  # prefix rows: one per source
        head = sum(len(c) for c in comps)
        t_bound = train_bound(model, knobs, segments, head, pr[t_key])
        t_bound_wall = train_bound(model, knobs, segments, head, pr[t_key + " wall"])
        row = {"fp32": pr["torch.float32"], "bf16": pr.get("torch.bfloat16", 0.0), "bw": pr["bw"],
               "tok_s": B * N * T / s_wall, "tok_s_cpu": B * N * T / s_cpu,
               "bound_tok_s": B * N * T / s_bound,
               "sample": s_bound / s_cpu, "sample_wall": s_bound_wall / s_wall,
               "kernel": s_bound / s_ceiling, "of_kernel": s_ceiling / s_cpu,
               "train_s": t_cpu, "train_bound_s": t_bound, "train": t_bound / t_cpu,
               "train_wall": t_bound_wall / t_wall}
        rows.append(row)
        print(f"round {r}: fp32 {row['fp32']:.0f} bf16 {row['bf16']:.0f} GFLOP/s, read {row['bw']:.1f} GB/s"
              " | "
              f"sampling {row['tok_s_cpu']:.0f} tok/s (cpu; wall {row['tok_s']:.0f}), bound "
              f"{row['bound_tok_s']:.0f} -> {row['sample']:.2f} (wall {row['sample_wall']:.2f}; the kernel "
              f"alone {row['kernel']:.2f}, ours {row['of_kernel']:.2f} of it) | training "
              f"{t_cpu:.2f} s cpu ({t_wall:.2f} wall), bound {t_bound:.2f} s -> {row['train']:.2f} "
              f"(wall {row['train_wall']:.2f})", flush=True)
    if opt.profile:
        profile_sampling(sample, opt.profile)
    env.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"medians over {len(rows)} rounds: sampling {med['tok_s_cpu']:.0f} tok/s of a "
          f"{med['bound_tok_s']:.0f} bound, training step {med['train_s']:.2f} s of a "
          f"{med['train_bound_s']:.2f} s bound; the sampler's matmul kernel alone would reach "
          f"{med['kernel']:.3f} of the sampling bound (ours is {med['of_kernel']:.3f} of that)")
    # on more than one CPU thread the process's CPU time adds the threads' up: the wall-clock fractions count
    wall = DEVICE.type == "cpu" and torch.get_num_threads() > 1
    s_key, t_key = ("sample_wall", "train_wall") if wall else ("sample", "train")
    print(f"RESULT sample_roofline={med[s_key]:.3f} train_roofline={med[t_key]:.3f}")


if __name__ == "__main__":
    main()
