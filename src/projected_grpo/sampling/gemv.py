"""The packed sampler's fp32 kernels on CPU: the few-row matmul and the one-token attention.

The matmul: x (M, K) · Wᵀ with W (N, K) laid out once in blocks of 24
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

The attention (`attend_one`): a decode step's query token against its rows' KV cache, the query heads that
share a key/value head taken together. At a handful of rows sdpa's per-call setup is most of its time (60-110
µs a layer at 3 rows on the AVX2 machine, 30 layers a token): here the scores are one pass over the keys, the
softmax ATen's, the weighted sum one pass over the values, each (row, key/value head) one thread's fixed-order
sums, so again the same bits in any batch and thread count (docs/benchmarks.md, "The one-token attention").
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
#include <limits>

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

typedef float v4 __attribute__((vector_size(16)));

static inline float hsum(v8 v) {  // a fixed tree: (lanes i + i+4), then (i + i+2), then (0 + 1)
  v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1);
  return a[0] + a[1];
}

// one (row, kv head) task of attend_one, NV = D / 8 vectors per head: scores s (G, n) = scale·q·kᵀ, -inf
// where a column is not kept
template <int NVD>
static void scores(const float* q, const float* k, int64_t sk1, const bool* keep, int64_t G, int64_t n,
                   float sc, float* s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    if (keep && !keep[t]) {
      for (int64_t j = 0; j < G; ++j) s[j * n + t] = neg_inf;
      continue;
    }
    v8 kv[NVD];
    for (int i = 0; i < NVD; ++i) kv[i] = ld(k + t * sk1 + 8 * i);
    for (int64_t j = 0; j < G; ++j) {
      v8 acc = {};
      for (int i = 0; i < NVD; ++i) acc += ld(q + j * NVD * 8 + 8 * i) * kv[i];
      s[j * n + t] = hsum(acc) * sc;
    }
  }
}

// out (G, D) = p (G, n) · v, in halves of at most 4 vectors so the accumulators stay in registers
template <int NVD>
static void weighted(const float* p, const float* v, int64_t sv1, int64_t G, int64_t n, float* out) {
  constexpr int W = NVD < 4 ? NVD : 4;
  for (int64_t j = 0; j < G; ++j) {
    for (int i0 = 0; i0 < NVD; i0 += W) {
      v8 acc[W] = {};
      for (int64_t t = 0; t < n; ++t) {
        const float w = p[j * n + t];
        for (int i = 0; i < W; ++i) acc[i] += w * ld(v + t * sv1 + 8 * (i0 + i));
      }
      for (int i = 0; i < W; ++i) std::memcpy(out + j * NVD * 8 + 8 * (i0 + i), &acc[i], sizeof(v8));
    }
  }
}

// One-token attention over a KV cache: q (N, Hkv, G, D) contiguous; k, v (N, n, Hkv, D) with any row and
// column strides (views of the cache's first n columns), D in {32, 64, 128, 256}; keep (N, n) bool or an
// empty tensor (every column visible). -> (N, Hkv, G, D): softmax(scale q·kᵀ, masked) · v, each (row, kv
// head) one task, its sums over d and over columns in a fixed order; the softmax is ATen's
torch::Tensor attend_one(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keep,
                         double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous(),
              "attend_one: q (N, Hkv, G, D) contiguous, k and v (N, n, Hkv, D)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat, "attend_one: float32");
  const int64_t N = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), n = k.size(1);
  TORCH_CHECK(k.size(0) == N && k.size(2) == Hkv && k.size(3) == D && v.sizes() == k.sizes() &&
              (D == 32 || D == 64 || D == 128 || D == 256) && k.stride(3) == 1 && v.stride(3) == 1 &&
              k.stride(2) == D && v.stride(2) == D,
              "attend_one: k, v (N, n, Hkv, D), D in {32, 64, 128, 256}, each head's D contiguous");
  const bool masked = keep.numel() > 0;
  TORCH_CHECK(!masked || (keep.scalar_type() == torch::kBool && keep.dim() == 2 && keep.size(0) == N &&
              keep.size(1) == n && keep.stride(1) == 1), "attend_one: keep (N, n) bool, columns contiguous");
  auto s = torch::empty({N, Hkv, G, n}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = masked ? keep.data_ptr<bool>() : nullptr;
  float* sp = s.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, N * Hkv, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t r = a / Hkv, h = a % Hkv;
      const float* ka = kp + r * k.stride(0) + h * D;
      const bool* ma = mp ? mp + r * keep.stride(0) : nullptr;
      float* sa = sp + a * G * n;
      switch (D) {
        case 32: scores<4>(qp + a * G * D, ka, k.stride(1), ma, G, n, sc, sa); break;
        case 64: scores<8>(qp + a * G * D, ka, k.stride(1), ma, G, n, sc, sa); break;
        case 128: scores<16>(qp + a * G * D, ka, k.stride(1), ma, G, n, sc, sa); break;
        default: scores<32>(qp + a * G * D, ka, k.stride(1), ma, G, n, sc, sa);
      }
    }
  });
  auto p = at::_softmax(s, -1, false);  // (N, Hkv, G, n)
  auto out = torch::empty_like(q);
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * Hkv, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t r = a / Hkv, h = a % Hkv;
      const float* va = vp + r * v.stride(0) + h * D;
      switch (D) {
        case 32: weighted<4>(pp + a * G * n, va, v.stride(1), G, n, op + a * G * D); break;
        case 64: weighted<8>(pp + a * G * n, va, v.stride(1), G, n, op + a * G * D); break;
        case 128: weighted<16>(pp + a * G * n, va, v.stride(1), G, n, op + a * G * D); break;
        default: weighted<32>(pp + a * G * n, va, v.stride(1), G, n, op + a * G * D);
      }
    }
  });
  return out;
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
                           functions=["blocked_matmul", "block", "attend_one", "parallel_threads"],
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


HEAD_DIMS = (32, 64, 128, 256)  # the head sizes attend_one is built for (the C++ source's cases)


def attend_one(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float) -> Tensor:
    """One query token's attention: q (N, Hkv, G, D), the G query heads that share a key/value head; k, v
    (N, n, Hkv, D) fp32, views of a cache's first n columns (heads contiguous); keep (N, n) bool or None
    (every column visible) -> (N, Hkv, G, D) = softmax(scale·q·kᵀ over the kept columns)·v. Sampling only."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("gemv.attend_one has no backward (it serves the sampler): call it under "
                           "torch.no_grad()")
    mask = torch.empty(0, dtype=torch.bool) if keep is None else keep
    return _module().attend_one(q.contiguous(), k, v, mask, float(scale))
