"""Cost of the per-source gradient split: one backward with capture vs plain backward vs two backwards.

A tiny random Llama wrapped with knobs, a GRPO-shaped loss (-adv · Σ logp per sequence) on a realistic
batch (default 32 sequences × 128 tokens, half student, half teacher). One step = forward + backward
(+ the split). The three variants are interleaved in a fresh random order each repetition (the CPU is
shared, so load drifts) and medians are reported. Ratios use process CPU time (`time.process_time`),
which other processes' load disturbs far less than wall time; wall-time medians are printed too.
The split is checked against the two-backward oracle once before timing.

    .venv/bin/python benchmarks/split_overhead.py [--reps 9] [--kind svd] [--n 32] [--t 128] [--threads 1]

Last line: `RESULT split_vs_plain=<r> two_backward_vs_plain=<r>`.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from projected_grpo.knobs.adapters import wrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the test oracles
from oracles import two_backward_split


def per_seq_loss(model, x, adv):
    logp = torch.log_softmax(model(x).logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
    return -adv * logp.sum(-1)  # (N,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kind", default="svd", choices=["svd", "lora"])
    ap.add_argument("--n", type=int, default=32, help="sequences per batch")
    ap.add_argument("--t", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    opt = ap.parse_args()
    torch.set_num_threads(opt.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=opt.hidden, intermediate_size=2 * opt.hidden,
                      num_hidden_layers=opt.layers, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as cache:
        knobs = wrap(model, opt.kind, cache_dir=cache)
    for p in knobs.parameters():
        p.data.normal_(0, 0.01)
    x = torch.randint(0, cfg.vocab_size, (opt.n, opt.t))
    adv = torch.randn(opt.n)
    is_student = torch.arange(opt.n) < opt.n // 2

    def zero():
        for p in knobs.parameters():
            p.grad = None

    def plain():
        per_seq_loss(model, x, adv).sum().backward()

    def split():
        with knobs.capture(is_student) as cap:
            per_seq_loss(model, x, adv).sum().backward()
        return cap

    def two():
        loss = per_seq_loss(model, x, adv)
        return two_backward_split(knobs, loss[is_student].sum(), loss[~is_student].sum())

    zero()
    cap = split()
    g_s, _ = two()
    err = max(((cap.g_student[n] - g_s[n]).abs().max() / g_s[n].abs().max().clamp_min(1e-30)).item()
              for n in g_s)
    print(f"model: llama hidden={opt.hidden} layers={opt.layers} knob={opt.kind} "
          f"({len(knobs.modules)} modules, {sum(m.knob_dim for m in knobs.modules.values())} knob dims); "
          f"batch {opt.n}x{opt.t}; threads={opt.threads}; split vs oracle max rel err {err:.1e}")
    variants = {"plain": plain, "split": split, "two_backward": two}
    times: dict[str, list[float]] = {k: [] for k in variants}
    walls: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for name in order:  # warm-up
        zero()
        variants[name]()
    rng = random.Random(0)
    for _ in range(opt.reps):
        rng.shuffle(order)
        for name in order:
            zero()
            w0, t0 = time.perf_counter(), time.process_time()
            variants[name]()
            times[name].append(time.process_time() - t0)
            walls[name].append(time.perf_counter() - w0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>13}: median {v * 1e3:8.1f} ms CPU/step over {opt.reps} reps "
              f"(min {min(times[k]) * 1e3:.1f}, max {max(times[k]) * 1e3:.1f}); "
              f"wall median {statistics.median(walls[k]) * 1e3:.1f} ms")
    print(f"RESULT split_vs_plain={med['split'] / med['plain']:.3f} "
          f"two_backward_vs_plain={med['two_backward'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
