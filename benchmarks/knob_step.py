"""Cost of one training micro-batch by knob implementation, with and without gradient checkpointing.

One step = forward + backward of a GRPO-shaped loss (-adv · Σ logp of the completion tokens, via
`forward_logprobs`, the training forward) on a tiny random Llama (default hidden 256, 4 layers, 1024
vocabulary: the 4.46M-parameter model of benchmarks/vs_trl.py) with 32 sequences × 128 tokens (16
prompt + 112 completion), half student and half teacher rows. Variants:
  full_ft          every weight trainable, no knobs (what TRL's default trains)
  branch_svd       full-rank SVD knobs through the pre-fusion side branch (knobs/reference.py)
  fused_svd        full-rank SVD knobs, fused (knobs/fused.py); fused_svd_r16: rank 16
  branch_lora_r16  LoRA r=16 through the side branch;      fused_lora_r16: fused
Knob variants run inside `Knobs.capture` (the per-source split training uses); an AdamW step between
steps (not timed) moves the knobs, so every timed forward merges W_eff afresh, as in training.
`_ckpt` variants checkpoint every decoder layer (knobs/checkpointing.py). Each variant runs in its own
process (rounds × variants, shuffled): median process CPU time per step, and memory from
/proc/self/status: `step MB` = peak RSS during one step above the RSS before it (activations and
temporaries; freed memory is returned with malloc_trim and the peak reset first), `held MB` = RSS before
the step above the RSS before the model was built (weights, buffers, W_eff caches, optimizer state).
Then sampling: `generate` of 16 rows × 128 new tokens with the preallocated vs the dynamic KV cache.

    .venv/bin/python benchmarks/knob_step.py [--rounds 2] [--reps 4] [--n 32] [--t 128] [--hidden 256]

Last line: `RESULT fused_vs_branch_svd=<cpu ratio> ... sampling_speedup=<dynamic / preallocated>`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the test oracles

VARIANTS = {  # name -> (knob kind or None for full fine-tuning, rank, side-branch reference?)
    "full_ft": (None, None, False), "branch_svd": ("svd", None, True), "fused_svd": ("svd", None, False),
    "fused_svd_r16": ("svd", 16, False), "branch_lora_r16": ("lora", 16, True),
    "fused_lora_r16": ("lora", 16, False),
}
CHECKPOINTED = ("full_ft", "fused_svd", "fused_svd_r16", "fused_lora_r16")  # the side branch cannot


def _mem_mb() -> tuple[float, float]:
    """(current RSS, peak RSS since the last reset) of this process in MB."""
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) / 1024, int(d["VmHWM"].split()[0]) / 1024


def _reset_peak() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back, so the next peak is this step's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    return _mem_mb()[0]


def build_model(opt):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=1024, hidden_size=opt["hidden"], intermediate_size=4 * opt["hidden"],
                      num_hidden_layers=opt["layers"], num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def train_worker(opt: dict) -> dict:
    import contextlib

    import torch
    from oracles import branch_path

    from projected_grpo.knobs import checkpointing
    from projected_grpo.knobs.adapters import wrap
    from projected_grpo.sampling.pack import pack
    from projected_grpo.sampling.score import forward_logprobs

    torch.set_num_threads(opt["threads"])
    rss_start = _mem_mb()[0]
    model = build_model(opt)
    kind, rank, branch = VARIANTS[opt["variant"]]
    knobs = None
    if kind is None:
        params = list(model.parameters())
    else:
        with tempfile.TemporaryDirectory() as cache:
            knobs = wrap(model, kind, rank=rank, cache_dir=cache)
        params = knobs.parameters()
        for p in params:  # away from zero: a trained knob, W_eff a real copy
            p.data.normal_(0, 1e-3)
    if opt["ckpt"]:
        checkpointing.enable(model)
    gen = torch.Generator().manual_seed(1)
    n, P = opt["n"], 16
    batch = pack(list(torch.randint(2, 1024, (n, P), generator=gen)),
                 list(torch.randint(2, 1024, (n, opt["t"] - P), generator=gen)), pad_id=0)
    adv = torch.randn(n, generator=gen)
    is_student = torch.arange(n) < n // 2
    optim = torch.optim.AdamW(params, lr=1e-4)

    def step():
        ctx = knobs.capture(is_student) if knobs is not None else contextlib.nullcontext()
        with ctx:
            logp, _ = forward_logprobs(model, batch)  # (N, T)
            (-(adv[:, None] * logp * batch.completion_mask).sum() / logp.numel()).backward()

    times, peaks = [], []
    with branch_path(knobs) if branch else contextlib.nullcontext():
        for i in range(opt["reps"] + 1):
            optim.zero_grad(set_to_none=True)
            before = _reset_peak()
            t0 = time.process_time()
            step()
            dt = time.process_time() - t0
            peaks.append((_mem_mb()[1] - before, before - rss_start))
            optim.step()  # moves the knobs: the next forward merges W_eff again, as in training
            if i:  # the first step is a warm-up (lazy allocations, the first merge)
                times.append(dt)
    return {"cpu_s": times, "step_mb": [p[0] for p in peaks[1:]], "held_mb": [p[1] for p in peaks[1:]]}


def sample_worker(opt: dict) -> dict:
    import torch

    from projected_grpo.sampling.generate import generate

    torch.set_num_threads(opt["threads"])
    model = build_model(opt)
    prompts = [list(range(5, 35)), list(range(40, 62))]
    kw = dict(max_new_tokens=opt["new_tokens"], temperature=1.0, seed=3, eos_id=[], pad_id=0)
    times = {"preallocated": [], "dynamic": []}
    for i in range(opt["reps"] + 1):
        for cache in random.Random(i).sample(list(times), 2):
            t0 = time.process_time()
            generate(model, prompts, opt["rows"] // 2, kv_cache=cache, **kw)
            if i:
                times[cache].append(time.process_time() - t0)
    return times


def _spawn(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"worker {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant (interleaved)")
    ap.add_argument("--reps", type=int, default=4, help="timed steps per process (after one warm-up)")
    ap.add_argument("--n", type=int, default=32, help="sequences per micro-batch")
    ap.add_argument("--t", type=int, default=128, help="tokens per sequence (16 of them prompt)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opt = ap.parse_args()
    if opt.worker:
        spec = json.loads(opt.worker)
        print(json.dumps(sample_worker(spec) if spec.get("mode") == "sample" else train_worker(spec)))
        return
    base = {k: getattr(opt, k) for k in ("reps", "n", "t", "hidden", "layers", "threads")}
    names = [v for v in opt.variants.split(",") if v]
    cells = [(v, False) for v in names] + [(v, True) for v in names if v in CHECKPOINTED]
    res: dict[tuple[str, bool], dict[str, list[float]]] = {c: {} for c in cells}
    rng = random.Random(0)
    print(f"llama hidden={opt.hidden} layers={opt.layers} vocab=1024; micro-batch {opt.n}x{opt.t}; "
          f"threads={opt.threads}; {opt.rounds} processes x {opt.reps} timed steps per cell", flush=True)
    for r in range(opt.rounds):
        for cell in rng.sample(cells, len(cells)):
            out = _spawn({**base, "variant": cell[0], "ckpt": cell[1]})
            for k, v in out.items():
                res[cell].setdefault(k, []).extend(v)
            print(f"  round {r} {cell[0]}{'_ckpt' if cell[1] else ''}: "
                  f"{statistics.median(out['cpu_s']) * 1e3:.0f} ms", flush=True)
    med = {c: {k: statistics.median(v) for k, v in d.items()} for c, d in res.items()}
    print("\n| variant | checkpointing | CPU ms/step | step MB | held MB |\n|---|---|---:|---:|---:|")
    for (v, ck), m in med.items():
        print(f"| {v} | {'on' if ck else 'off'} | {m['cpu_s'] * 1e3:.0f} | {m['step_mb']:.0f} | "
              f"{m['held_mb']:.0f} |")
    s = _spawn({**base, "mode": "sample", "rows": 16, "new_tokens": 128, "reps": 3})
    sm = {k: statistics.median(v) for k, v in s.items()}
    print(f"\nsampling 16 rows x 128 new tokens: dynamic KV cache {sm['dynamic'] * 1e3:.0f} ms, preallocated "
          f"{sm['preallocated'] * 1e3:.0f} ms CPU")

    def ratio(a, b, key="cpu_s"):
        return f"{med[a][key] / med[b][key]:.3f}" if a in med and b in med else "nan"

    print("RESULT "
          f"fused_vs_branch_svd={ratio(('fused_svd', False), ('branch_svd', False))} "
          f"fused_svd_vs_full_ft={ratio(('fused_svd', False), ('full_ft', False))} "
          f"fused_svd_r16_vs_full_ft={ratio(('fused_svd_r16', False), ('full_ft', False))} "
          f"fused_vs_branch_lora={ratio(('fused_lora_r16', False), ('branch_lora_r16', False))} "
          f"step_mem_fused_vs_branch_svd={ratio(('fused_svd', False), ('branch_svd', False), 'step_mb')} "
          f"step_mem_ckpt_vs_not_svd={ratio(('fused_svd', True), ('fused_svd', False), 'step_mb')} "
          f"sampling_speedup={sm['dynamic'] / sm['preallocated']:.3f}")


if __name__ == "__main__":
    main()
