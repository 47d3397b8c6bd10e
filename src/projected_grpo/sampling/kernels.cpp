// The packed sampler's CPU kernels (sampling/gemv.py builds this file with torch.utils.cpp_extension and
// documents each kernel): the few-row fp32 matmul over blocked weights, the one-token attention, RMSNorm and
// the rotary embedding. Each output is one thread's sum in a fixed order: the same bits in any batch and
// thread count on a fixed machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t KC = 256;  // a slice of a block: 256 x 24 floats = 24 KiB (bf16: 8), within a 32 KiB L1

static inline v8 ld(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
static inline v8 as_v8(u32x8 u) { v8 v; std::memcpy(&v, &u, sizeof v); return v; }

// 8 values stored as fp32 or as bf16's bits (uint16), as fp32: bf16 widened exactly (a float's high half)
static inline v8 ldf(const float* p) { return ld(p); }
static inline v8 ldf(const uint16_t* p) {
#ifdef __AVX2__  // one vpmovzxwd from memory and a shift: GCC lowers the generic form below to two halves
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return as_v8(__builtin_convertvector(h, u32x8) << 16);
#endif
}

// A block of the matmul's weights: NR output columns of every k, NV vectors of 8 floats once loaded.
// fp32: 24 columns in order (3 vectors x 4 rows = 12 accumulators of AVX2's 16 registers). bf16: 16
// columns, interleaved so that one 32-byte load widens into two vectors by a shift and a mask (k's
// uint16 2i holds column i, 2i + 1 column 8 + i: a uint32 lane's low half, then its high half), where a
// widening load per 8 columns costs a shuffle and a shift each
template <typename W> struct Blk;
template <> struct Blk<float> {
  static constexpr int64_t NV = 3, NR = 24;
  static inline void row(const float* w, v8* wv) {
    for (int64_t j = 0; j < NV; ++j) wv[j] = ld(w + 8 * j);
  }
  static constexpr int64_t at(int64_t c) { return c; }  // where column c sits in its k's NR values
};
template <> struct Blk<uint16_t> {
  static constexpr int64_t NV = 2, NR = 16;
  static inline void row(const uint16_t* w, v8* wv) {
    u32x8 u;
    std::memcpy(&u, w, sizeof u);
    wv[0] = as_v8(u << 16);  // columns 0..7: the low halves, widened
    wv[1] = as_v8(u & 0xFFFF0000u);  // columns 8..15: the high halves, already a float's high half
  }
  // where column c of a block sits in its k's NR values
  static constexpr int64_t at(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }
};

// R rows (1..4) of x against k0 .. k1 - 1 of one block w (K, NR) of fp32 or bf16 weights (W: float or
// uint16_t, bf16 widened exactly): y[r, 0:cols] = (k0 > 0 ? y[r] : 0) + sum_k x[r, k] * w[k, :] in fp32, k
// in order, so a sum split at any k0 is the same sum (and bf16 blocks give the fp32 blocks' bits)
// pf .. pf_end: bytes of the weight stream to prefetch into L2 meanwhile, a line per k (none: pf_end = pf)
template <int R, typename W>
static inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, float* y,
                        int64_t ldy, int64_t cols, const char* pf, const char* pf_end) {
  constexpr int64_t NV = Blk<W>::NV, NR = Blk<W>::NR;
  v8 acc[R][NV] = {};
  if (k0 > 0)
    for (int r = 0; r < R; ++r) std::memcpy(&acc[r][0], y + r * ldy, cols * sizeof(float));
  for (int64_t k = k0; k < k1; ++k) {
    if (pf < pf_end) { __builtin_prefetch(pf, 0, 1); pf += 64; }
    v8 wv[NV];
    Blk<W>::row(w + k * NR, wv);
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
// (NR sequential read streams, one write stream). T: float, or uint16_t for bf16's bits (a copy, no rounding,
// its columns where Blk<T>::at puts them)

template <typename T>
static torch::Tensor block_as(const torch::Tensor& W) {
  constexpr int64_t NR = Blk<T>::NR;
  const int64_t N = W.size(0), K = W.size(1), nb = (N + NR - 1) / NR;
  auto out = torch::empty({nb, K, NR}, W.options());
  const T* wp = static_cast<const T*>(W.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(NR, N - b * NR);
      const T* src = wp + b * NR * K;
      T* ob = op + b * K * NR;
      for (int64_t k = 0; k < K; ++k) {  // writes in order; reads NR rows in step, a cache line per 16 k
        for (int64_t r = 0; r < rows; ++r) ob[k * NR + Blk<T>::at(r)] = src[r * K + k];
        for (int64_t r = rows; r < NR; ++r) ob[k * NR + Blk<T>::at(r)] = 0;  // +0.0 in both dtypes
      }
    }
  });
  return out;
}

torch::Tensor block(torch::Tensor W) {
  const bool bf16 = W.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(W.dim() == 2 && (bf16 || W.scalar_type() == torch::kFloat), "block: W (N, K) float32 or bf16");
  W = W.contiguous();
  return bf16 ? block_as<uint16_t>(W) : block_as<float>(W);
}

template <typename T>
static void blocked_matmul_as(const float* xp, const T* wp, float* yp, int64_t M, int64_t K, int64_t N,
                              int64_t nb) {
  constexpr int64_t NR = Blk<T>::NR;
  const char* end = reinterpret_cast<const char*>(wp + nb * K * NR);  // the stream's end: no prefetch past it
  const int64_t tiles = (M + 3) / 4;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T* w = wp + b * K * NR;
      const int64_t cols = std::min(NR, N - b * NR);
      // more than 4 rows read the block once per 4: in slices of KC rows of k, each slice stays in L1 while
      // every row tile passes over it. Meanwhile the row tiles share out a prefetch of the stream's next
      // slice (the next block's first at a block's end), so memory works while the tiles compute: 1.1-1.3x
      // at 5-32 rows. One tile (<= 4 rows) reads at the memory's speed already; a prefetch only slowed it.
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        const char* next = reinterpret_cast<const char*>(w + k1 * NR);
        const int64_t ahead = tiles == 1 ? 0 : std::min<int64_t>((k1 - k0) * NR * sizeof(T), end - next);
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
}

// x (M, K) fp32 against Wb = block(W), W fp32 or bf16 -> (M, N) fp32: every output one thread's fixed-order
// fp32 sum (bf16 weights widened exactly), so the same bits for bf16 blocks as for fp32 blocks of the same
// (widened) values
torch::Tensor blocked_matmul(torch::Tensor x, torch::Tensor Wb, int64_t N) {
  const bool bf16 = Wb.scalar_type() == torch::kBFloat16;
  const int64_t NR = bf16 ? Blk<uint16_t>::NR : Blk<float>::NR;
  TORCH_CHECK(x.dim() == 2 && Wb.dim() == 3 && Wb.size(2) == NR && x.size(1) == Wb.size(1) &&
              Wb.size(0) == (N + NR - 1) / NR,
              "blocked_matmul: x (M, K), Wb (ceil(N / ", NR, "), K, ", NR, ") for its dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && (bf16 || Wb.scalar_type() == torch::kFloat),
              "blocked_matmul: x float32, Wb float32 or bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = Wb.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (bf16)
    blocked_matmul_as(x.data_ptr<float>(), static_cast<const uint16_t*>(Wb.data_ptr()), y.data_ptr<float>(),
                      M, K, N, nb);
  else
    blocked_matmul_as(x.data_ptr<float>(), Wb.data_ptr<float>(), y.data_ptr<float>(), M, K, N, nb);
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
template <int NVD, typename KV>
static void scores(const float* q, const KV* k, int64_t sk1, const bool* keep, int64_t G, int64_t n,
                   float sc, float* s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    if (keep && !keep[t]) {
      for (int64_t j = 0; j < G; ++j) s[j * n + t] = neg_inf;
      continue;
    }
    v8 kv[NVD];
    for (int i = 0; i < NVD; ++i) kv[i] = ldf(k + t * sk1 + 8 * i);
    for (int64_t j = 0; j < G; ++j) {
      v8 acc = {};
      for (int i = 0; i < NVD; ++i) acc += ld(q + j * NVD * 8 + 8 * i) * kv[i];
      s[j * n + t] = hsum(acc) * sc;
    }
  }
}

// out (G, D) = p (G, n) · v, in halves of at most 4 vectors so the accumulators stay in registers
template <int NVD, typename KV>
static void weighted(const float* p, const KV* v, int64_t sv1, int64_t G, int64_t n, float* out) {
  constexpr int W = NVD < 4 ? NVD : 4;
  for (int64_t j = 0; j < G; ++j) {
    for (int i0 = 0; i0 < NVD; i0 += W) {
      v8 acc[W] = {};
      for (int64_t t = 0; t < n; ++t) {
        const float w = p[j * n + t];
        for (int i = 0; i < W; ++i) acc[i] += w * ldf(v + t * sv1 + 8 * (i0 + i));
      }
      for (int i = 0; i < W; ++i) std::memcpy(out + j * NVD * 8 + 8 * (i0 + i), &acc[i], sizeof(v8));
    }
  }
}

// attend_one's two passes over one cache dtype KV (float, or uint16 for bf16's bits); s (N, Hkv, G, n)
template <typename KV>
static torch::Tensor attend_one_as(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const bool* mp, int64_t mstride, float sc, torch::Tensor s) {
  const int64_t N = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), n = k.size(1);
  const float* qp = q.data_ptr<float>();
  const KV* kp = static_cast<const KV*>(k.data_ptr());
  const KV* vp = static_cast<const KV*>(v.data_ptr());
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, N * Hkv, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t r = a / Hkv, h = a % Hkv;
      const KV* ka = kp + r * k.stride(0) + h * D;
      const bool* ma = mp ? mp + r * mstride : nullptr;
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
      const KV* va = vp + r * v.stride(0) + h * D;
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

// One-token attention over a KV cache: q (N, Hkv, G, D) fp32 contiguous; k, v (N, n, Hkv, D) fp32 or bf16
// (both alike) with any row and column strides (views of the cache's first n columns), D in {32, 64, 128,
// 256}; keep (N, n) bool or an empty tensor (every column visible). -> (N, Hkv, G, D) fp32: softmax(scale
// q·kᵀ, masked) · v, each (row, kv head) one task, its sums over d and over columns in a fixed order in fp32
// (bf16 keys and values widened exactly); the softmax is ATen's
torch::Tensor attend_one(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keep,
                         double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous(),
              "attend_one: q (N, Hkv, G, D) contiguous, k and v (N, n, Hkv, D)");
  const bool bf16 = k.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.scalar_type() == torch::kFloat && (bf16 || k.scalar_type() == torch::kFloat) &&
              v.scalar_type() == k.scalar_type(), "attend_one: q float32, k and v both float32 or bfloat16");
  const int64_t N = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), n = k.size(1);
  TORCH_CHECK(k.size(0) == N && k.size(2) == Hkv && k.size(3) == D && v.sizes() == k.sizes() &&
              (D == 32 || D == 64 || D == 128 || D == 256) && k.stride(3) == 1 && v.stride(3) == 1 &&
              k.stride(2) == D && v.stride(2) == D,
              "attend_one: k, v (N, n, Hkv, D), D in {32, 64, 128, 256}, each head's D contiguous");
  const bool masked = keep.numel() > 0;
  TORCH_CHECK(!masked || (keep.scalar_type() == torch::kBool && keep.dim() == 2 && keep.size(0) == N &&
              keep.size(1) == n && keep.stride(1) == 1), "attend_one: keep (N, n) bool, columns contiguous");
  auto s = torch::empty({N, Hkv, G, n}, q.options());
  const bool* mp = masked ? keep.data_ptr<bool>() : nullptr;
  const int64_t ms = masked ? keep.stride(0) : 0;
  const float sc = static_cast<float>(scale);
  return bf16 ? attend_one_as<uint16_t>(q, k, v, mp, ms, sc, s)
              : attend_one_as<float>(q, k, v, mp, ms, sc, s);
}

// one value of a tensor stored as fp32 or as bf16's bits (uint16): widened to fp32 exactly, and rounded back
// to the nearest even bf16 (NaN kept a NaN), as torch's own conversions do
static inline float wid(float f) { return f; }
static inline float wid(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void put(float* p, float f) { *p = f; }
static inline void put(uint16_t* p, float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  *p = std::isnan(f) ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename S>
static void rms_norm_as(const S* xp, const float* wp, S* yp, int64_t M, int64_t E, float e) {
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const S* xr = xp + m * E;
      S* yr = yp + m * E;
      v8 acc = {};
      int64_t i = 0;
      for (; i + 8 <= E; i += 8) acc += ldf(xr + i) * ldf(xr + i);
      float ss = hsum(acc);
      for (; i < E; ++i) ss += wid(xr[i]) * wid(xr[i]);
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(E) + e);
      for (i = 0; i < E; ++i) put(yr + i, wp[i] * (wid(xr[i]) * r));
    }
  });
}

// RMSNorm of each row of x (M, E), fp32 or bf16, with w (E,) fp32: w * (x * 1 / sqrt(mean(x²) + eps)) in
// fp32, rounded once to x's dtype (as ATen's fused rms_norm does); the mean a fixed-order sum (8 lanes, then
// a tree) per row; rows in parallel only where there are many (a decode step's handful: serial)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == torch::kFloat) && w.scalar_type() == torch::kFloat &&
              w.dim() == 1 && x.size(-1) == w.size(0) && w.is_contiguous(),
              "rms_norm: x (..., E) float32 or bfloat16, w (E,) float32");
  x = x.contiguous();
  const int64_t E = x.size(-1), M = x.numel() / std::max<int64_t>(E, 1);
  auto y = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  if (bf16)
    rms_norm_as(static_cast<const uint16_t*>(x.data_ptr()), w.data_ptr<float>(),
                static_cast<uint16_t*>(y.data_ptr()), M, E, e);
  else
    rms_norm_as(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, E, e);
  return y;
}

template <typename S>
static void rope_as(const torch::Tensor& x, const S* cp, const S* sp, S* yp) {
  const int64_t N = x.size(0), T = x.size(1), Hh = x.size(2), D = x.size(3), half = D / 2;
  const S* xp = static_cast<const S*>(x.data_ptr());
  at::parallel_for(0, N * T, 64, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t nn = a / T, t = a % T;
      const S* c = cp + a * D;
      const S* s = sp + a * D;
      for (int64_t h = 0; h < Hh; ++h) {
        const S* xh = xp + nn * x.stride(0) + t * x.stride(1) + h * D;
        S* yh = yp + (a * Hh + h) * D;
        for (int64_t d = 0; d < half; ++d)
          put(yh + d, wid(xh[d]) * wid(c[d]) - wid(xh[d + half]) * wid(s[d]));
        for (int64_t d = half; d < D; ++d)
          put(yh + d, wid(xh[d]) * wid(c[d]) + wid(xh[d - half]) * wid(s[d]));
      }
    }
  });
}

// The rotary embedding of x (N, T, Hh, D) (each head's D contiguous, heads D apart; any N, T strides) with
// cos, sin (N, T, D), all fp32 or all bf16: x·cos + rotate_half(x)·sin, rotate_half(x) = (-x[D/2:], x[:D/2]),
// in fp32, rounded once to x's dtype -> (N, T, Hh, D)
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.dim() == 4 && (dt == torch::kFloat || dt == torch::kBFloat16) && x.stride(3) == 1 &&
              x.stride(2) == x.size(3) && x.size(3) % 2 == 0,
              "rope: x (N, T, Hh, D) float32 or bfloat16, each head contiguous, D even");
  const int64_t N = x.size(0), T = x.size(1), Hh = x.size(2), D = x.size(3);
  cos = cos.reshape({N, T, D}).contiguous();
  sin = sin.reshape({N, T, D}).contiguous();
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt, "rope: cos, sin in x's dtype");
  auto y = torch::empty({N, T, Hh, D}, x.options());
  if (dt == torch::kBFloat16)
    rope_as(x, static_cast<const uint16_t*>(cos.data_ptr()), static_cast<const uint16_t*>(sin.data_ptr()),
            static_cast<uint16_t*>(y.data_ptr()));
  else
    rope_as(x, cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>());
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
