"""The energy control's principal directions for one module: eigh of AᵀA (R x R) against A Aᵀ (N x N).

The energy-matched control (hack/controls.py) needs the top-K eigenvectors of M = AᵀA, A (N, R) the fit
completions' gradients centred per prompt. The eigendecomposition of M costs O(R³); when N < R (a LoRA knob's
wide modules: R 8192 on the maths organism against ~3,000 completions) the N x N Gram A Aᵀ gives the same
subspace in O(N²R + N³) (`controls._top_and_bottom`). This times both on a random A of the given shape in
one process, sides alternated, and checks the two top-K subspaces agree (the largest entry of the
projectors' difference).

    PYTHONPATH=src .venv/bin/python benchmarks/energy_control.py [--n 3000] [--r 8192] [--k 4] [--rounds 1]

Last line: `RESULT eigh_s=<median> gram_s=<median> speedup=<eigh/gram> projector_diff=<max abs>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from projected_grpo.hack.controls import _top_and_bottom


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="rows of A: the fit completions")
    ap.add_argument("--r", type=int, default=8192, help="the module's knob dimension")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    # a decaying spectrum, as gradients have: the top directions are well separated
    A = torch.randn(args.n, args.r, generator=gen, dtype=torch.float64) * torch.logspace(
        0, -2, args.r, dtype=torch.float64)
    t_eigh, t_gram, diff = [], [], 0.0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        evecs = torch.linalg.eigh(A.T @ A)[1][:, -args.k:].T  # the O(R³) way
        t_eigh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        U, _ = _top_and_bottom(A, args.k, torch.Generator().manual_seed(0))
        t_gram.append(time.perf_counter() - t0)
        diff = max(diff, float((U.T @ U - evecs.T @ evecs).abs().max()))
    e, s = statistics.median(t_eigh), statistics.median(t_gram)
    print(f"A ({args.n}, {args.r}) float64, K {args.k}, {args.threads} thread(s): eigh {t_eigh} s, "
          f"Gram {t_gram} s")
    print(f"RESULT eigh_s={e:.2f} gram_s={s:.2f} speedup={e / s:.1f} projector_diff={diff:.1e}")


if __name__ == "__main__":
    main()
