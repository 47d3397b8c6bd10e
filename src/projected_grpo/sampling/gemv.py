"""The packed sampler's fp32 matmul on CPU: x (M, K) · Wᵀ with W (N, K) laid out once in blocks of 24
output columns, (ceil(N / 24), K, 24); each block is streamed from memory once while rows accumulate in
registers, four at a time, over slices of 256 k that stay in the L1 cache while every row tile passes.

Why written by hand: at a handful of rows a decode step's matmul is a read of the weights, and its speed is
the read bandwidth. oneDNN's prepacked fp32 kernel (torch.ops.mkldnn, what the sampler used before) reads
SmolLM2's projections at 10-14 GB/s at 1-3 rows on a 2-core AMD EPYC with AVX2, where the machine reads
25-34 GB/s; this loop reads them at 20-31 GB/s there, is 1.5x faster at 8 rows and as fast or faster up to
128 rows, where both are compute-bound (docs/benchmarks.md, "The few-row kernel";
benchmarks/few_row_kernel.py). torch.compile's CPU GEMM template (max-autotune) uses the same layout and
reaches the same speed, but only for weights frozen into the compiled graph as constants: the knobs change
the merged weights every step, so it would recompile for every `generate`.

The loop is plain C++ over GCC/Clang vector extensions (a vector of 8 floats, one AVX2 register; 3 of them x
4 rows = 12 accumulators of AVX2's 16 registers), built on first use by torch.utils.cpp_extension (a C++
compiler and ninja) into torch's extension cache, one build per instruction set (torch's CPU capability) and
torch version, so a cache shared between machines never runs code built for another CPU; with OpenMP, so
the column blocks are shared out over torch's threads (run.threads). Every output is one thread's sum over k
in a fixed order (a slice boundary continues the same sum), so a row's result is the same bits in any batch,
for any thread count and run to run on a fixed machine; against F.linear only the order of the sum differs
(tests/test_gemv.py).
"""

from __future__ import annotations

import functools
import platform
import re
import warnings

import torch
from torch import Tensor

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t NV = 3, NR = 8 * NV;  // a block: NR output columns as NV vectors
constexpr int64_t KC = 256;  // a slice of a block: 256 x 24 floats = 24 KiB, within a 32 KiB L1

static inline v8 ld(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }

// R rows (1..4) of x against k0 .. k1 - 1 of one block w (K, NR): y[r, 0:cols] = (k0 > 0 ? y[r] : 0) +
// sum_k x[r, k] * w[k, :], k in order, so a sum split at any k0 is the same sum
// pf .. pf_end: bytes of the weight stream to prefetch into L2 meanwhile, a line per k (none: pf_end = pf)
template <int R>
static inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const float* w, float* y,
                        int64_t ldy, int64_t cols, const char* pf, const char* pf_end) {
  v8 acc[R][NV] = {};
  if (k0 > 0)
    for (int r = 0; r < R; ++r) std::memcpy(&acc[r][0], y + r * ldy, cols * sizeof(float));
  for (int64_t k = k0; k < k1; ++k) {
    if (pf < pf_end) { __builtin_prefetch(pf, 0, 1); pf += 64; }
    v8 wv[NV];
#pragma GCC unroll 4
    for (int64_t j = 0; j < NV; ++j) wv[j] = ld(w + k * NR + 8 * j);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma GCC unroll 4
      for (int64_t j = 0; j < NV; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, &acc[r][0], cols * sizeof(float));
}

// W (N, K) -> (ceil(N / NR), K, NR), the last block's missing columns zero: each block gathers NR rows of W
// (NR sequential read streams, one write stream)
torch::Tensor block(torch::Tensor W) {
  TORCH_CHECK(W.dim() == 2 && W.scalar_type() == torch::kFloat, "block: W (N, K) float32");
  W = W.contiguous();
  const int64_t N = W.size(0), K = W.size(1), nb = (N + NR - 1) / NR;
  auto out = torch::empty({nb, K, NR}, W.options());
  const float* wp = W.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(NR, N - b * NR);
      const float* src = wp + b * NR * K;
      float* ob = op + b * K * NR;
      for (int64_t k = 0; k < K; ++k) {  // writes in order; reads NR rows in step, a cache line per 16 k
        for (int64_t r = 0; r < rows; ++r) ob[k * NR + r] = src[r * K + k];
        for (int64_t r = rows; r < NR; ++r) ob[k * NR + r] = 0.0f;
      }
    }
  });
  return out;
}

torch::Tensor blocked_matmul(torch::Tensor x, torch::Tensor Wb, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && Wb.dim() == 3 && Wb.size(2) == NR && x.size(1) == Wb.size(1),
              "blocked_matmul: x (M, K), Wb (ceil(N / ", NR, "), K, ", NR, ")");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && Wb.scalar_type() == torch::kFloat,
              "blocked_matmul: float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = Wb.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = Wb.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const char* end = reinterpret_cast<const char*>(wp + nb * K * NR);  // the stream's end: no prefetch past it
  const int64_t tiles = (M + 3) / 4;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* w = wp + b * K * NR;
      const int64_t cols = std::min(NR, N - b * NR);
      // more than 4 rows read the block once per 4: in slices of KC rows of k, each slice stays in L1 while
      // every row tile passes over it. Meanwhile the row tiles share out a prefetch of the stream's next
      // slice (the next block's first at a block's end), so memory works while the tiles compute: 1.1-1.3x
      // at 5-32 rows. One tile (<= 4 rows) reads at the memory's speed already; a prefetch only slowed it.
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        const char* next = reinterpret_cast<const char*>(w + k1 * NR);
        const int64_t ahead = tiles == 1 ? 0 : std::min<int64_t>((k1 - k0) * NR * 4, end - next);
        const int64_t share = (ahead + tiles - 1) / tiles;
        for (int64_t m = 0; m < M; m += 4) {
          const float* xm = xp + m * K;
          float* ym = yp + m * N + b * NR;
          const char* pf = next + std::min(ahead, m / 4 * share);
          const char* pf_end = next + std::min(ahead, (m / 4 + 1) * share);
          switch (std::min<int64_t>(M - m, 4)) {
            case 1: tile<1>(xm, K, k0, k1, w, ym, N, cols, pf, pf_end); break;
            case 2: tile<2>(xm, K, k0, k1, w, ym, N, cols, pf, pf_end); break;
            case 3: tile<3>(xm, K, k0, k1, w, ym, N, cols, pf, pf_end); break;
            default: tile<4>(xm, K, k0, k1, w, ym, N, cols, pf, pf_end);
          }
        }
      }
    }
  });
  return y;
}

// how many threads a parallel_for over n items runs on: whether this build honours torch's thread count
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> most{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t t = at::get_thread_num() + 1;
    int64_t seen = most.load();
    while (t > seen && !most.compare_exchange_weak(seen, t)) {}
  });
  return most.load();
}
"""


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
        return load_inline(f"projected_grpo_gemv_{name}{tag}", cpp_sources=_SOURCE,
                           functions=["blocked_matmul", "block", "parallel_threads"], extra_cflags=c,
                           extra_ldflags=ld, verbose=False)

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
    padded with zeros (24: the C++ source's NR)."""
    return _module().block(W.detach())


def matmul(x: Tensor, Wb: Tensor, N: int) -> Tensor:
    """x (..., K) fp32 · Wᵀ -> (..., N), W given as block(W). Sampling only: the kernel has no backward."""
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("gemv.matmul has no backward (it serves the sampler): call it under "
                           "torch.no_grad()")
    y = _module().blocked_matmul(x.reshape(-1, x.shape[-1]), Wb, N)
    return y.view(*x.shape[:-1], N)


def threads_used(n: int = 64) -> int:
    """How many of torch's threads the kernel's loop over `n` column blocks runs on (torch.get_num_threads()
    where the build has OpenMP; 1 without)."""
    return int(_module().parallel_threads(n))
