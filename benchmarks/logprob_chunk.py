"""Per-token log-probs (and entropy) from logits: CPU time per chunk size, side by side in one process.

objective/logprobs.py computes `token_logprobs` and `entropy_from_logits` a block of token rows at a time
in fp32, `CHUNK_ELEMENTS` floats per block. Rows are independent, so the block size changes where the
temporaries live, not what is computed: this script times forward + backward of `token_logprobs` plus
`entropy_from_logits` (the training step's use: the loss's log-probs with a gradient, the entropy metric
without) for several block sizes on the shapes of SmolLM2's vocabulary (49152: the `smollm2-math-cpu` step's
16 x 31 completion tokens and the vs_trl pairing's 4 x 31), Qwen2's (151936) and the organism's (1024), and
says whether each block size's outputs are bit for bit the largest's.

    PYTHONPATH=src .venv/bin/python benchmarks/logprob_chunk.py [--threads 1] [--reps 3]

Last line: `RESULT speedup_smollm2=<ms at 2**25 / ms at the default>` on the 16 x 31 x 49152 shape.
"""

from __future__ import annotations

import argparse
import time

import torch

from projected_grpo.objective import logprobs as LP

SHAPES = {"smollm2": (16, 31, 49152), "smollm2_pair": (4, 31, 49152), "qwen2": (8, 64, 151936),
          "organism": (32, 32, 1024)}
EXPONENTS = (25, 22, 21, 20, 19, 18)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    opt = ap.parse_args()
    torch.set_num_threads(opt.threads)
    default = LP.CHUNK_ELEMENTS
    ms: dict[tuple[str, int], float] = {}
    for name, (N, T, V) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        logits = (4 * torch.randn(N, T, V, generator=gen)).requires_grad_(True)
        targets = torch.randint(0, V, (N, T), generator=gen)

        def step(logits=logits, targets=targets):
            logp = LP.token_logprobs(logits, targets)
            ent = LP.entropy_from_logits(logits.detach())
            (grad,) = torch.autograd.grad(logp.sum(), logits)
            return logp, ent, grad

        first = None
        cells = []
        for e in EXPONENTS:
            LP.CHUNK_ELEMENTS = 2**e
            out = step()  # warm-up, and the outputs compared
            first = first or out
            t0 = time.process_time()
            for _ in range(opt.reps):
                step()
            ms[name, e] = (time.process_time() - t0) / opt.reps * 1e3
            same = "same bits" if all(torch.equal(a, b) for a, b in zip(out, first)) else "OTHER BITS"
            cells.append(f"2^{e}: {ms[name, e]:.0f} ms ({same})")
        print(f"{name} {N}x{T}x{V}: " + " | ".join(cells), flush=True)
    LP.CHUNK_ELEMENTS = default
    e_default = default.bit_length() - 1
    print(f"default CHUNK_ELEMENTS = 2^{e_default}; {opt.threads} thread(s), {opt.reps} reps, CPU time")
    print(f"RESULT speedup_smollm2={ms['smollm2', 25] / ms['smollm2', e_default]:.2f}")


if __name__ == "__main__":
    main()
