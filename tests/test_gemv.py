"""gemv.py: the few-row kernel computes x·Wᵀ (a hand-worked example, then F.linear within fp32
rounding at every row-tile and k-slice boundary), and it is bit-reproducible by construction: a row's output
does not depend on the thread count, on the other rows in the batch, or on the run. Where this machine has a
C++ compiler and ninja, the kernel must build (so CI catches a broken build rather than quietly sampling with
the slower fallback)."""

from __future__ import annotations

import importlib.util
import platform
import shutil

import pytest
import torch
from torch.nn import functional as F

from projected_grpo.sampling import gemv, packed

CAN_BUILD = shutil.which("c++") is not None and importlib.util.find_spec("ninja") is not None
needs_kernel = pytest.mark.skipif(gemv.why_not() is not None, reason=str(gemv.why_not()))


def test_builds_wherever_a_compiler_and_ninja_are():
    if not CAN_BUILD:
        pytest.skip("no C++ compiler or ninja: the sampler falls back to oneDNN's kernel, with a warning")
    assert gemv.why_not() is None


@needs_kernel
def test_block_layout_by_hand():
    W = torch.arange(6.0).view(3, 2)  # N 3, K 2: one block of 24 columns, rows 3..23 zero
    Wb = gemv.block(W)
    assert Wb.shape == (1, 2, 24)
    # block[0][k][n] = W[n][k]: k 0 -> W[:, 0] = 0, 2, 4; k 1 -> W[:, 1] = 1, 3, 5
    assert Wb[0, 0, :3].tolist() == [0.0, 2.0, 4.0] and Wb[0, 1, :3].tolist() == [1.0, 3.0, 5.0]
    assert not Wb[0, :, 3:].any()


@needs_kernel
def test_hand_worked_product():
    W = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # N 3, K 2
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]])  # M 2
    # row 0: (1 + 2, 3 + 4, 5 + 6) = (3, 7, 11); row 1: (2 - 2, 6 - 4, 10 - 6) = (0, 2, 4)
    assert gemv.matmul(x, gemv.block(W), 3).tolist() == [[3.0, 7.0, 11.0], [0.0, 2.0, 4.0]]


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("N, K", [(24, 8), (50, 300), (7, 600)])  # K > 256: the k-slices meet mid-sum
def test_equals_f_linear_within_fp32_rounding(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    W, x = torch.randn(N, K, generator=g), torch.randn(2, M, K, generator=g)
    y = gemv.matmul(x, gemv.block(W), N)
    ref = F.linear(x.double(), W.double())
    assert y.shape == (2, M, N) and y.dtype == torch.float32
    # |terms| ~ 1, K of them: fp32 epsilon 6e-8 times sqrt(K)-ish growth, far under 1e-4
    assert (y.double() - ref).abs().max() < 1e-4


@needs_kernel
def test_a_rows_output_is_the_same_bits_in_any_batch_and_thread_count():
    g = torch.Generator().manual_seed(0)
    W, x = torch.randn(100, 700, generator=g), torch.randn(9, 700, generator=g)
    Wb = gemv.block(W)
    full = gemv.matmul(x, Wb, 100)
    # row tiles of 4 (rows 0-3, 4-7) and of 1 (row 8) run the same sum in the same order per row
    for i in range(9):
        assert torch.equal(gemv.matmul(x[i:i + 1], Wb, 100)[0], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gemv.matmul(x, Wb, 100)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, full) and torch.equal(gemv.matmul(x, Wb, 100), full)


@needs_kernel
def test_the_kernel_runs_on_torchs_threads():
    # at::parallel_for is OpenMP in a header: built without -fopenmp the loop ran on one thread whatever
    # torch.set_num_threads said (the sampler used one core of two before 2026-11-27)
    threads = torch.get_num_threads()
    omp = platform.system() == "Linux" and torch.backends.openmp.is_available()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert gemv.threads_used() == (n if omp else 1)
    finally:
        torch.set_num_threads(threads)


def test_a_failed_openmp_build_falls_back_to_the_serial_one(monkeypatch):
    # a compiler without an OpenMP runtime (clang without libomp): build again without -fopenmp, and say so
    import torch.utils.cpp_extension as ext

    built = []

    def load_inline(name, **kw):
        if "-fopenmp" in kw["extra_cflags"]:
            raise RuntimeError("fatal error: 'omp.h' file not found")
        built.append((name, kw["extra_cflags"], kw["extra_ldflags"]))
        return "the serial build"

    monkeypatch.setattr(ext, "load_inline", load_inline)
    monkeypatch.setattr(gemv, "_flags", lambda: ("isa", ["-O3"], ["-fopenmp"]))
    gemv._module.cache_clear()
    try:
        with pytest.warns(UserWarning, match="omp.h.*without: it runs on one thread"):
            assert gemv._module() == "the serial build"
    finally:
        gemv._module.cache_clear()  # the next caller loads the real build again
    assert built == [("projected_grpo_gemv_isa_serial", ["-O3"], [])]


def test_a_failed_build_warns_with_its_reason_and_falls_back(monkeypatch):
    reason = "building the few-row fp32 kernel failed (RuntimeError: no c++)"
    monkeypatch.setattr(gemv, "why_not", lambda: reason)
    monkeypatch.setattr(packed, "_blocked_kernel", packed._blocked_kernel.__wrapped__)
    for dtype in (torch.float32, torch.bfloat16):  # bf16 at a handful of rows would take it too
        with pytest.warns(UserWarning, match="no c\\+\\+.*oneDNN"):
            lin = packed.packed_linear(torch.randn(5, 3), None, dtype, rows=1)
        assert lin.kernel == ("onednn" if packed.packs_on_cpu(dtype) else "plain")


@needs_kernel
def test_packed_linear_epilogues_on_the_blocked_kernel():
    g = torch.Generator().manual_seed(1)
    W, b, x, y = (torch.randn(*s, generator=g) for s in ((30, 16), (30,), (3, 16), (3, 30)))
    lin = packed.packed_linear(W, b, torch.float32, rows=3)
    assert lin.kernel == "blocked"
    ref = F.linear(x, W, b)
    assert torch.allclose(lin(x), ref, atol=1e-5)
    assert torch.allclose(lin.swish(x), F.silu(ref), atol=1e-5)
    assert torch.allclose(lin.then(x, y, "add"), ref + y, atol=1e-5)
    assert torch.allclose(lin.then(x, y, "mul"), ref * y, atol=1e-5)


@needs_kernel
def test_block_of_bf16_weights_by_hand():
    W = torch.arange(40.0).view(20, 2).bfloat16()  # N 20, K 2: blocks of 16 columns, the second 4 + 12 zero
    Wb = gemv.block(W)
    assert Wb.dtype == torch.bfloat16 and Wb.shape == (2, 2, 16)
    # per k, slot 2i holds column i, slot 2i + 1 column 8 + i: k 0 -> W[0, 0], W[8, 0], W[1, 0], W[9, 0], ...
    assert Wb[0, 0].tolist() == [v for i in range(8) for v in (2.0 * i, 2.0 * (8 + i))]
    assert Wb[0, 1].tolist() == [v for i in range(8) for v in (2.0 * i + 1, 2.0 * (8 + i) + 1)]
    # block 1 holds columns 16..19 at slots 0, 2, 4, 6 (k 0: W[16..19, 0] = 32, 34, 36, 38), the rest +0.0
    assert Wb[1, 0, 0:8:2].tolist() == [32.0, 34.0, 36.0, 38.0] and not Wb[1, 0, 8:].any()
    assert not Wb[1, :, 1::2].any()


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 5])
@pytest.mark.parametrize("N, K", [(50, 300), (7, 600)])
def test_bf16_weights_are_the_fp32_kernel_on_the_widened_values_rounded_once(M, N, K):
    """bf16 blocks are widened exactly in the loop: the same fp32 sums, bit for bit, as fp32 blocks of the
    same values; a bf16 x is widened first and the result (bias added in fp32) rounded once, as oneDNN's
    bf16 matmul rounds."""
    g = torch.Generator().manual_seed(M * 100 + N)
    W, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g).bfloat16()
    y32 = gemv.matmul(x, gemv.block(W.float()), N)
    assert torch.equal(gemv.matmul(x, gemv.block(W), N), y32)  # fp32 x: the fp32 result
    xb = x.bfloat16()
    want = (gemv.matmul(xb.float(), gemv.block(W.float()), N) + b.float()).bfloat16()
    got = gemv.matmul(xb, gemv.block(W), N, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # against F.linear on the same bf16 values: within a bf16 rounding of the fp32 sum (one step is at most
    # 2^-8 of a value's magnitude, rounding to nearest), plus fp32's reordering of K terms
    ref = F.linear(xb.double(), W.double(), b.double())
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4).all()


@needs_kernel
def test_packed_linear_bf16_takes_the_blocked_kernel_at_a_handful_of_rows(monkeypatch):
    W = torch.randn(30, 16)
    at = packed.BF16_BLOCKED_ROWS
    assert packed.packed_linear(W, None, torch.bfloat16, rows=at).kernel == "blocked"
    above = packed.packed_linear(W, None, torch.bfloat16, rows=at + 1).kernel
    assert above == ("onednn" if packed.packs_on_cpu(torch.bfloat16) else "blocked")
    monkeypatch.setattr(packed, "packs_on_cpu", lambda dtype=torch.bfloat16: dtype != torch.bfloat16)
    assert packed.packed_linear(W, None, torch.bfloat16, rows=64).kernel == "blocked"  # an AVX2 CPU: any rows


@needs_kernel
def test_refuses_a_graph_it_cannot_differentiate():
    x = torch.randn(2, 8, requires_grad=True)
    Wb = gemv.block(torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="no backward.*no_grad"):
        gemv.matmul(x, Wb, 5)
    with torch.no_grad():
        assert gemv.matmul(x, Wb, 5).shape == (2, 5)


# --- attend_one: the packed sampler's one-token attention -------------------------------------------------


@needs_kernel
def test_attend_one_hand_worked():
    D = 32  # the smallest head size it is built for; only the first two coordinates are non-zero
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k, v = torch.zeros(1, 2, 1, D), torch.zeros(1, 2, 1, D)  # (N 1, n 2 columns, Hkv 1, D)
    k[0, 1, 0, 0] = 3.0  # scores at scale 0.5: q·k0 = 0 -> 0, q·k1 = 3 -> 1.5
    v[0, 0, 0, 0], v[0, 1, 0, 1] = 4.0, 8.0
    out = gemv.attend_one(q, k, v, None, 0.5)
    # softmax(0, 1.5) = (1, e^1.5) / (1 + e^1.5) = (0.18243, 0.81757): out = (4 * 0.18243, 8 * 0.81757, 0..)
    w1 = torch.tensor(1.5).exp() / (1 + torch.tensor(1.5).exp())
    assert torch.allclose(out[0, 0, 0, :2], torch.stack([4 * (1 - w1), 8 * w1]), rtol=1e-6, atol=0)
    assert not out[0, 0, 0, 2:].any()
    # the second column masked out: all weight on the first, exactly v0
    masked = gemv.attend_one(q, k, v, torch.tensor([[True, False]]), 0.5)
    assert masked[0, 0, 0, :2].tolist() == [4.0, 0.0]


@needs_kernel
@pytest.mark.parametrize("D", gemv.HEAD_DIMS)
@pytest.mark.parametrize("N, Hkv, G, n", [(1, 1, 1, 1), (3, 3, 3, 37), (5, 2, 4, 130)])
def test_attend_one_equals_sdpa_on_cache_views(D, N, Hkv, G, n):
    g = torch.Generator().manual_seed(D + 10 * N + n)
    C = n + 7  # the cache holds more columns than are filled: k, v are strided views of its first n
    kc, vc = torch.randn(N, C, Hkv, D, generator=g), torch.randn(N, C, Hkv, D, generator=g)
    q = torch.randn(N, Hkv, G, D, generator=g)
    keep = torch.rand(N, C, generator=g) > 0.3
    keep[:, n - 1] = True  # the newest column (the query's own key) is always visible
    k, v = kc[:, :n], vc[:, :n]
    for m in (None, keep[:, :n]):
        got = gemv.attend_one(q, k, v, m, D ** -0.5)
        kd, vd = k.transpose(1, 2).double(), v.transpose(1, 2).double()
        ref = F.scaled_dot_product_attention(q.double(), kd, vd, scale=D ** -0.5,
                                             attn_mask=None if m is None else m[:, None, None])
        assert got.shape == (N, Hkv, G, D) and (got.double() - ref).abs().max() < 1e-5


@needs_kernel
def test_attend_one_is_the_same_bits_in_any_batch_and_thread_count():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 3, 3, 64, generator=g), torch.randn(5, 90, 3, 64, generator=g), \
        torch.randn(5, 90, 3, 64, generator=g)
    full = gemv.attend_one(q, k, v, None, 0.125)
    for i in range(5):  # one (row, kv head) per task: a row's sums do not see the others
        assert torch.equal(gemv.attend_one(q[i:i + 1], k[i:i + 1], v[i:i + 1], None, 0.125)[0], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gemv.attend_one(q, k, v, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, full)


@needs_kernel
@pytest.mark.parametrize("D", gemv.HEAD_DIMS)
def test_attend_one_on_bf16_is_the_fp32_attention_of_the_widened_values_rounded_once(D):
    # bf16 -> fp32 is exact, and the bf16 path runs the fp32 path's sums in its order: the same bits, then
    # one rounding of the result to bf16
    g = torch.Generator().manual_seed(D)
    N, Hkv, G, n, C = 4, 3, 3, 41, 50
    kc, vc = (torch.randn(N, C, Hkv, D, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(N, Hkv, G, D, generator=g).bfloat16()
    keep = torch.rand(N, n, generator=g) > 0.3
    keep[:, n - 1] = True
    for m in (None, keep):
        got = gemv.attend_one(q, kc[:, :n], vc[:, :n], m, D ** -0.5)
        wide = gemv.attend_one(q.float(), kc[:, :n].float(), vc[:, :n].float(), m, D ** -0.5)
        assert got.dtype == torch.bfloat16 and torch.equal(got, wide.bfloat16())
        # and sdpa's bf16 attention within bf16's rounding (it rounds its own intermediates too)
        mask = None if m is None else m[:, None, None]
        ref = F.scaled_dot_product_attention(q, kc[:, :n].transpose(1, 2), vc[:, :n].transpose(1, 2),
                                             scale=D ** -0.5, attn_mask=mask)
        assert ((got.float() - ref.float()).abs() <= 2e-2 * ref.float().abs().clamp(min=1.0)).all()


@needs_kernel
def test_attend_one_refuses_mixed_dtypes():
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 2, 1, 32)
    with pytest.raises(RuntimeError, match="both float32 or bfloat16"):
        gemv.attend_one(q, k, k.bfloat16(), None, 1.0)


@needs_kernel
def test_attend_one_refuses_a_graph():
    q = torch.randn(1, 1, 1, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        gemv.attend_one(q, torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), None, 1.0)


# --- rms_norm and rope: the packed fp32 forward's RMSNorm and rotary embedding in one call each ------------


@needs_kernel
def test_rms_norm_hand_worked():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([2.0, 0.5])
    # row 0: mean(9, 16) = 12.5, eps 0 -> x / sqrt(12.5) = (0.84853, 1.13137); times w -> (1.69706, 0.56569)
    # row 1: mean(1, 1) = 1 -> (1, -1) * w = (2, -0.5), exactly
    y = gemv.rms_norm(x, w, 0.0)
    assert torch.allclose(y[0], torch.tensor([6 / 12.5 ** 0.5, 2 / 12.5 ** 0.5]), rtol=1e-6, atol=0)
    assert y[1].tolist() == [2.0, -0.5]


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 1, 576), (2, 37, 64), (5, 13)])  # E a multiple of 8, and not
def test_rms_norm_equals_f_rms_norm(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, w = 3 * torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    x_view = x.transpose(0, -2) if x.dim() == 3 else x  # a non-contiguous input is read as its values
    y = gemv.rms_norm(x_view, w, 1e-5)
    ref = F.rms_norm(x_view.double(), (shape[-1],), w.double(), 1e-5)
    assert y.shape == x_view.shape and (y.double() - ref).abs().max() < 1e-5
    for i in range(x.shape[0]):  # each row alone: the same bits
        assert torch.equal(gemv.rms_norm(x[i:i + 1], w, 1e-5)[0], gemv.rms_norm(x, w, 1e-5)[i])


@needs_kernel
def test_rms_norm_and_rope_on_bf16_are_their_fp32_results_on_the_widened_values_rounded_once():
    from projected_grpo.sampling.decode_step import _rotate_half

    g = torch.Generator().manual_seed(3)
    x, w = (3 * torch.randn(4, 2, 576, generator=g)).bfloat16(), torch.randn(576, generator=g).bfloat16()
    y = gemv.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16 and torch.equal(y, gemv.rms_norm(x.float(), w.float(), 1e-5).bfloat16())
    # ATen's fused bf16 RMSNorm also computes in fp32 and rounds once: another summation order, so at most
    # one bf16 step apart (a step is at most 2^-7 of the value)
    ref = F.rms_norm(x, (576,), w, 1e-5).float()
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -7).all()
    out = torch.randn(3, 5, 15 * 64, generator=g).bfloat16()  # a qkv output (9 q, 3 k, 3 v heads of 64)
    qk = out[..., :12 * 64].view(3, 5, 12, 64)
    angle = torch.randn(3, 5, 1, 32, generator=g).repeat(1, 1, 1, 2)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    r = gemv.rope(qk, cos, sin)
    assert r.dtype == torch.bfloat16
    assert torch.equal(r, gemv.rope(qk.float(), cos.float(), sin.float()).bfloat16())
    # HF rounds both products and their sum to bf16 (each off by at most u = 2^-8 of its size, |cos|, |sin| <=
    # 1), ours the exact result once: apart by at most 3u (|x| + |rotate_half(x)|)
    hf = (qk * cos + _rotate_half(qk) * sin).float()
    assert ((r.float() - hf).abs() <= 3 * 2 ** -8 * (qk.float().abs() + _rotate_half(qk).float().abs())).all()


@needs_kernel
def test_rope_equals_hf_rotary_on_a_strided_view():
    from projected_grpo.sampling.decode_step import _rotate_half

    g = torch.Generator().manual_seed(0)
    N, T, H, Hkv, D = 3, 5, 9, 3, 64
    out = torch.randn(N, T, (H + 2 * Hkv) * D, generator=g)  # a qkv matmul's output: q and k heads, then v
    qk = out[..., :(H + Hkv) * D].view(N, T, H + Hkv, D)  # strided: each (n, t) row is (H + 2 Hkv) * D apart
    angle = torch.randn(N, T, 1, D // 2, generator=g).repeat(1, 1, 1, 2)  # HF's cos/sin: each half repeated
    cos, sin = angle.cos(), angle.sin()
    y = gemv.rope(qk, cos, sin)
    ref = qk.double() * cos.double() + _rotate_half(qk.double()) * sin.double()
    assert y.shape == (N, T, H + Hkv, D) and (y.double() - ref).abs().max() < 1e-5
    # by hand at D 2 (half 1): x = (a, b) -> (a cos - b sin, b cos + a sin), the plane rotation
    x2 = torch.tensor([1.0, 2.0]).view(1, 1, 1, 2)
    c, s = torch.full((1, 1, 1, 2), 0.6), torch.full((1, 1, 1, 2), 0.8)
    assert torch.allclose(gemv.rope(x2, c, s).flatten(), torch.tensor([0.6 - 1.6, 1.2 + 0.8]), atol=1e-6)
