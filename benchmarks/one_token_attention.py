"""The packed sampler's one-token attention: gemv.attend_one against F.scaled_dot_product_attention (what
packed.PackedLM's decode step called before), side by side in one process, over fp32 caches or (--dtype
bfloat16) bf16 ones as the bf16 sampler holds them (the kernel then computes in fp32 and rounds once).

One SmolLM2-135M decode step's attention (30 layers; 9 query heads of 64 over 3 key/value heads, the query
heads of a key/value head as rows, as the sampler calls it) for a batch of rows over a KV cache of `n` filled
columns; each layer reads its own cache (30 of them, as a decode step does, so a step's keys and values come
from wherever 30 layers' caches live, not from L1). Both kernels get the same strided views of the caches and
the same padding mask (a fifth of the columns masked, as left padding would). CPU seconds of this process (one
thread; wall-clock with --threads above 1), best of --reps; printed per (rows, n): both step times and their
ratio, and the largest difference between the two outputs.

    PYTHONPATH=src .venv/bin/python benchmarks/one_token_attention.py [--rows 1,3,8,32] [--cols 128,256] \
        [--reps 20] [--threads 1] [--dtype float32|bfloat16]

Last line: `RESULT speedup_rows<M>=<sdpa time / kernel time at the largest n> ...`.
"""

from __future__ import annotations

import argparse

import torch
from few_row_kernel import _best  # best of reps: CPU time on one thread, wall-clock on more (run as a script)
from torch.nn import functional as F

from projected_grpo.sampling import gemv

L, HKV, G, D = 30, 3, 3, 64


def step_times(rows: int, n: int, reps: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(sdpa s, kernel s, max |difference|) of one decode step's attention at `rows` rows, n columns."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    C = n + 32  # a cache with room left, as the sampler allocates it: k, v are views of its first n columns
    cache = lambda: torch.randn(rows, C, HKV, D, generator=g).to(dtype)
    caches = [(cache(), cache()) for _ in range(L)]
    q = torch.randn(rows, HKV, G, D, generator=g).to(dtype)
    keep = torch.rand(rows, n, generator=g) > 0.2
    keep[:, -1] = True
    mask = keep[:, None, None, :]
    views = [(k[:, :n], v[:, :n]) for k, v in caches]
    with torch.inference_mode():
        sdpa = _best(lambda: [F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                                             attn_mask=mask, scale=D ** -0.5)
                              for k, v in views], reps)
        kern = _best(lambda: [gemv.attend_one(q, k, v, keep, D ** -0.5) for k, v in views], reps)
        k, v = views[0]
        diff = (gemv.attend_one(q, k, v, keep, D ** -0.5) - F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=D ** -0.5)).float().abs().max()
    return sdpa, kern, float(diff)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,3,8,32")
    ap.add_argument("--cols", default="128,256", help="filled cache columns n (prompt + tokens so far)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="q and the caches")
    opt = ap.parse_args()
    dtype = getattr(torch, opt.dtype)
    torch.set_num_threads(opt.threads)
    reason = gemv.why_not()
    if reason is not None:
        raise SystemExit(f"the kernel cannot be built here: {reason}")
    cols = [int(c) for c in opt.cols.split(",")]
    print(f"one SmolLM2 decode step's attention ({L} layers, {HKV} kv heads x {G} query heads of {D}); "
          f"{opt.dtype}; {opt.threads} thread(s); ms per step, best of {opt.reps}")
    speedups = {}
    for rows in (int(r) for r in opt.rows.split(",")):
        for n in cols:
            sdpa, kern, diff = step_times(rows, n, opt.reps, dtype)
            print(f"  rows {rows:>3} n {n:>4}: sdpa {sdpa * 1e3:7.3f}  kernel {kern * 1e3:7.3f}  "
                  f"ratio {sdpa / kern:5.2f}  max |diff| {diff:.1e}")
            speedups[rows] = sdpa / kern  # the largest n's, printed last
    print("RESULT " + " ".join(f"speedup_rows{r}={s:.2f}" for r, s in speedups.items()))


if __name__ == "__main__":
    main()
