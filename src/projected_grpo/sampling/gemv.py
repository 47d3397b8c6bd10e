"""The packed sampler's kernels on CPU (their C++ in kernels.cpp): the few-row matmul, the one-token
attention, RMSNorm and the rotary embedding, each for fp32 and bf16 (bf16 values widened exactly, the sums in
fp32, the result rounded once to bf16).

The matmul: x (M, K) · Wᵀ with W (N, K) laid out once in blocks of 24 output columns, (ceil(N / 24), K, 24);
each block is streamed from memory once while rows accumulate in registers, four at a time, over slices of
256 k that stay in the L1 cache while every row tile passes. bf16 weights are half the bytes to stream and
are widened in registers (exactly: a bf16 is a float's high half; blocks of 16 columns, interleaved so that
one load widens into two vectors by a shift and a mask), so a bf16 block gives the bits the fp32 block of
the same values gives. At 1-2 rows that reads SmolLM2's projections 1.4-1.7x faster than oneDNN's bf16
kernel, at 3 as fast, and 1.1-1.8x faster than the fp32 blocks; above 3 rows it is slower than oneDNN's
(packed.BF16_BLOCKED_ROWS; docs/benchmarks.md [58], [59]).

Why written by hand: at a handful of rows a decode step's matmul is a read of the weights, and its speed is
the read bandwidth. oneDNN's prepacked fp32 kernel (torch.ops.mkldnn, what the sampler used before) reads
SmolLM2's projections at 10-14 GB/s at 1-3 rows on a 2-core AMD EPYC with AVX2, where the machine reads
25-34 GB/s; this loop reads them at 20-31 GB/s there, is 1.5x faster at 8 rows and as fast or faster up to
128 rows, where both are compute-bound (docs/benchmarks.md, "The few-row kernel";
benchmarks/few_row_kernel.py). torch.compile's CPU GEMM template (max-autotune) uses the same layout and
reaches the same speed, but only for weights frozen into the compiled graph as constants: the knobs change
the merged weights every step, so it would recompile for every `generate`.

The loop is plain C++ (kernels.cpp) over GCC/Clang vector extensions (a vector of 8 floats, one AVX2 register;
3 of them x 4 rows = 12 accumulators of AVX2's 16 registers), built on first use by torch.utils.cpp_extension
(a C++ compiler and ninja) into torch's extension cache, one build per instruction set (torch's CPU
capability) and torch version, so a cache shared between machines never runs code built for another CPU; with
OpenMP, so the column blocks are shared out over torch's threads (run.threads). Every output is one thread's
sum over k in a fixed order (a slice boundary continues the same sum), so a row's result is the same bits in
any batch, for any thread count and run to run on a fixed machine; against F.linear only the order of the sum
differs (tests/test_gemv.py).

The attention (`attend_one`): a decode step's query token against its rows' KV cache, the query heads that
share a key/value head taken together. At a handful of rows sdpa's per-call setup is most of its time (60-110
µs a layer at 3 rows on the AVX2 machine, 30 layers a token): here the scores are one pass over the keys, the
softmax ATen's, the weighted sum one pass over the values, each (row, key/value head) one thread's fixed-order
sums, so again the same bits in any batch and thread count (docs/benchmarks.md, "The one-token attention").
RMSNorm and the rotary embedding are one call each instead of ~10 and ~6 ATen ops of a few µs apiece, which
at a handful of rows are their whole cost. In bf16 sdpa's one-token path is slower still (1.5 ms a call at 32
rows on an AVX-512 CPU): the same kernels there made bf16 sampling 1.45x faster (docs/benchmarks.md, [50]).
"""

from __future__ import annotations

import functools
import pathlib
import platform
import re
import warnings

import torch
from torch import Tensor

SOURCE = pathlib.Path(__file__).parent / "kernels.cpp"  # the C++, beside this file (package data)


def _flags() -> tuple[str, list[str], list[str]]:
    """(the build's name, compiler flags, OpenMP's flags for both compiler and linker): AVX2 and FMA where
    torch's own kernels use them (its CPU capability AVX2 or AVX512), else the compiler's defaults for this
    machine's ISA; OpenMP on Linux where torch runs on it. The name holds the ISA, the capability and torch's
    version, so a cache shared between machines or kept across a torch upgrade never loads a build made for
    another (torch's cache keys a build by its source and flags only)."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    isa = ["-mavx2", "-mfma"] if platform.machine() in ("x86_64", "AMD64") and cap.startswith("avx") else []
    name = re.sub(r"\W", "_", f"{platform.machine()}_{cap}_torch{torch.__version__}")
    # at::parallel_for is OpenMP in a header: without -fopenmp it runs on one thread whatever
    # torch.set_num_threads says. torch's Linux wheels carry libgomp.so.1, loaded before this module, so
    # the build links to that same runtime (one thread pool, the thread count torch sets)
    omp = ["-fopenmp"] if platform.system() == "Linux" and torch.backends.openmp.is_available() else []
    # fp-contract=fast: a multiply and add fuse into one FMA (ISO C++ mode, which torch builds in, turns
    # that off): one rounding fewer, and the same code every build
    return name, ["-O3", "-ffp-contract=fast", *isa], omp


@functools.cache
def _module():
    """The built extension (built once per instruction set into torch's extension cache). Where the OpenMP
    build fails (a compiler without an OpenMP runtime, e.g. clang without libomp), the serial one is built
    instead, with a warning: the kernel then runs on one thread whatever run.threads says."""
    from torch.utils.cpp_extension import load_inline
    name, cflags, omp = _flags()

    def build(tag: str, c: list[str], ld: list[str]):
        return load_inline(f"projected_grpo_gemv_{name}{tag}", cpp_sources=SOURCE.read_text(),
                           functions=["blocked_matmul", "block", "attend_one", "rms_norm", "rope",
                                      "parallel_threads"],
                           extra_cflags=c, extra_ldflags=ld, verbose=False)

    try:
        return build("", cflags + omp, omp)
    except (OSError, RuntimeError, ImportError) as e:
        if not omp:  # nothing to leave out: the failure is why_not()'s to report
            raise
        warnings.warn(f"building the few-row fp32 kernel with OpenMP failed ({type(e).__name__}: "
                      f"{str(e).strip()[-300:]}); building it without: it runs on one thread", stacklevel=2)
        return build("_serial", cflags, [])


@functools.cache
def why_not() -> str | None:
    """Why the kernel cannot be used in this process (None: it can). Builds it on first call; a failed build
    (no C++ compiler, no ninja) is returned as the reason, with the compiler's own message, for the caller to
    report."""
    try:
        _module()
    except (OSError, RuntimeError, ImportError) as e:
        return f"building the few-row fp32 kernel failed ({type(e).__name__}: {str(e).strip()[-400:]})"
    return None


def block(W: Tensor) -> Tensor:
    """W (N, K) fp32 -> (ceil(N / 24), K, 24): column block b holds rows 24·b .. 24·b + 23 of W, the last
    padded with zeros (24: the C++ source's Blk<float>::NR). bf16 -> (ceil(N / 16), K, 16) in bf16, a block's
    16 columns interleaved: per k, slot 2i holds column i, slot 2i + 1 column 8 + i (Blk<uint16_t>)."""
    return _module().block(W.detach())


def _no_graph(name: str, *tensors: Tensor) -> None:
    """Refuse a call that autograd would need to differentiate: these kernels have no backward."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"gemv.{name} has no backward (it serves the sampler): call it under "
                           "torch.no_grad()")


def matmul(x: Tensor, Wb: Tensor, N: int, b: Tensor | None = None) -> Tensor:
    """x (..., K) · Wᵀ + b -> (..., N) in x's dtype, W given as block(W); x and W fp32 or bf16, b (N,) or
    None. Computed in fp32 (bf16 values widened exactly, the bias added to the fp32 sums) and, for a bf16 x,
    rounded once at the end, as oneDNN's bf16 matmul rounds. Sampling only: the kernel has no backward."""
    _no_graph("matmul", x)
    y = _module().blocked_matmul(x.reshape(-1, x.shape[-1]).float(), Wb, N)
    if b is not None:
        y.add_(b)
    return y.view(*x.shape[:-1], N).to(x.dtype)


def threads_used(n: int = 64) -> int:
    """How many of torch's threads the kernel's loop over `n` column blocks runs on (torch.get_num_threads()
    where the build has OpenMP; 1 without)."""
    return int(_module().parallel_threads(n))


HEAD_DIMS = (32, 64, 128, 256)  # the head sizes attend_one is built for (the C++ source's cases)


def attend_one(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float) -> Tensor:
    """One query token's attention: q (N, Hkv, G, D), the G query heads that share a key/value head; k, v
    (N, n, Hkv, D) fp32 or bf16 (both alike), views of a cache's first n columns (heads contiguous); keep
    (N, n) bool or None (every column visible) -> (N, Hkv, G, D) in q's dtype = softmax(scale·q·kᵀ over the
    kept columns)·v, computed in fp32 whatever the dtypes (bf16 inputs widened exactly, the result rounded
    once at the end). Sampling only."""
    _no_graph("attend_one", q, k, v)
    mask = torch.empty(0, dtype=torch.bool) if keep is None else keep
    return _module().attend_one(q.float().contiguous(), k, v, mask, float(scale)).to(q.dtype)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x (..., E) fp32 or bf16, w (E,) -> w · x / sqrt(mean(x²) + eps) per row in x's dtype: Hugging Face's
    RMSNorm computed in fp32 (its mean summed in another order: the same up to fp32 rounding) and, for bf16,
    rounded once at the end as ATen's fused rms_norm does; one C++ call. Sampling only."""
    _no_graph("rms_norm", x, w)
    return _module().rms_norm(x, w.detach().float(), float(eps))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (N, T, Hh, D) fp32 or bf16 (each head's D contiguous), cos, sin (N, T, 1, D) in x's dtype ->
    x·cos + rotate_half(x)·sin (N, T, Hh, D): Hugging Face's apply_rotary_pos_emb for the q and k heads at
    once, one C++ call, in fp32 (an FMA may fuse a product into the sum: the same up to fp32 rounding) and,
    for bf16, rounded once at the end where HF rounds each product and the sum. Sampling only."""
    _no_graph("rope", x)
    return _module().rope(x, cos, sin)
