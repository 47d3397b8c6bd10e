"""The sampler's matmul at a decode step's row counts: gemv.py's blocked kernel against oneDNN's prepacked
one (what packed.PackedLinear used for fp32 before, and uses for bf16 above BF16_BLOCKED_ROWS rows where
oneDNN has bf16 kernels), side by side in one process, in fp32 or (--dtype bfloat16) bf16.

For each row count, one SmolLM2-135M decode step's projections (per layer q/k/v fused, o, gate, up, down; then
the lm_head: 30 layers, hidden 576, MLP 1536, 9 heads of 64 over 3 key/value heads, vocab 49152), each shape
timed over copies of its weight that together exceed the caches (256 MB), as a decode step reads them: once
each, from memory. CPU seconds of this process (one thread; wall-clock with --threads above 1), best of
--reps; a step's time is the sum over shapes times their counts. Printed per row count: both kernels' step
time, the weights' read rate (GB/s), and the ratio; with bf16 also the blocked kernel on fp32 weights (what
bf16 saves against fp32 sampling). Alternating the kernels per shape, so a busy machine slows both alike.

    PYTHONPATH=src .venv/bin/python benchmarks/few_row_kernel.py [--rows 1,3,8,16,32,64] [--reps 5] \
        [--threads 1] [--dtype bfloat16]

Last line: `RESULT speedup_rows<M>=<oneDNN time / blocked time> ...`.
"""

from __future__ import annotations

import argparse
import time

import torch

from projected_grpo.sampling import gemv, packed

L, E, INTER, Q, KV, V = 30, 576, 1536, 9 * 64, 3 * 64, 49152
SHAPES = {(Q + 2 * KV, E): L, (E, Q): L, (INTER, E): 2 * L, (E, INTER): L, (V, E): 1}  # (d_out, d_in): count


def _best(fn, reps: int) -> float:
    """Best of `reps` runs: CPU seconds of this process on one thread, wall-clock seconds on more (CPU time
    would add the threads' times up)."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    best = float("inf")
    for _ in range(reps):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def step_times(rows: int, reps: int, dtype: torch.dtype) -> tuple[float, float, float, float]:
    """(oneDNN s, blocked s, blocked s on the fp32 weights (bf16 only, else 0), weight bytes) of one decode
    step's projections at `rows` rows in `dtype`."""
    dnn = blk = blk32 = nbytes = 0.0
    size = torch.empty(0, dtype=dtype).element_size()
    for (d_out, d_in), count in SHAPES.items():
        copies = max(2, int(256e6 // (d_out * d_in * size)))
        Ws = [torch.randn(d_out, d_in).to(dtype) for _ in range(copies)]
        x = torch.randn(rows, d_in).to(dtype)
        packed = [torch.ops.mkldnn._reorder_linear_weight(W, rows) for W in Ws]
        blocked = [gemv.block(W) for W in Ws]
        with torch.inference_mode():
            dnn += count * _best(lambda x=x, ps=packed: [
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in ps], reps) / copies
            blk += count * _best(lambda x=x, ws=blocked, n=d_out: [gemv.matmul(x, w, n) for w in ws],
                                 reps) / copies
            if dtype != torch.float32:
                del packed
                blocked = [gemv.block(W.float()) for W in Ws[:max(2, copies // 2)]]  # 256 MB again
                x32 = x.float()
                blk32 += count * _best(lambda x=x32, ws=blocked, n=d_out: [
                    gemv.matmul(x, w, n) for w in ws], reps) / len(blocked)
        nbytes += count * d_out * d_in * size
    return dnn, blk, blk32, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,3,8,16,32,64", help="decode rows to measure, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per shape; the best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both kernels (more than 1: "
                    "wall-clock time, on an otherwise idle machine)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    reason = gemv.why_not()
    if reason is not None:
        raise SystemExit(reason)
    if dtype == torch.bfloat16 and not packed.packs_on_cpu(dtype):
        raise SystemExit("--dtype bfloat16: this CPU has no oneDNN bf16 kernels to compare with")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s) (the blocked kernel runs on {gemv.threads_used()}); one SmolLM2-135M "
          f"decode step's projections in {args.dtype}")
    result = []
    for rows in map(int, args.rows.split(",")):
        dnn, blk, blk32, nbytes = step_times(rows, args.reps, dtype)
        fp32 = f", blocked fp32 {blk32 * 1e3:6.1f} ms ({blk32 / blk:.2f}x)" if blk32 else ""
        print(f"rows {rows:3d}: oneDNN {dnn * 1e3:6.1f} ms ({nbytes / dnn / 1e9:4.1f} GB/s), blocked "
              f"{blk * 1e3:6.1f} ms ({nbytes / blk / 1e9:4.1f} GB/s) -> {dnn / blk:.2f}x{fp32}", flush=True)
        result.append(f"speedup_rows{rows}={dnn / blk:.2f}")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
