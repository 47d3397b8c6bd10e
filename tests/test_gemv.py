"""gemv.py: the few-row fp32 kernel computes x·Wᵀ (a hand-worked example, then F.linear within fp32
rounding at every row-tile and k-slice boundary), and it is bit-reproducible by construction: a row's output
does not depend on the thread count, on the other rows in the batch, or on the run. Where this machine has a
C++ compiler and ninja, the kernel must build (so CI catches a broken build rather than quietly sampling with
the slower fallback)."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import warnings

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
    with pytest.warns(UserWarning, match="no c\\+\\+.*oneDNN"):
        lin = packed.packed_linear(torch.randn(5, 3), None, torch.float32, rows=1)
    assert lin.kernel == ("onednn" if packed.packs_on_cpu(torch.float32) else "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert packed.packed_linear(torch.randn(5, 3), None, torch.bfloat16, rows=1).kernel != "blocked"


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
def test_refuses_a_graph_it_cannot_differentiate():
    x = torch.randn(2, 8, requires_grad=True)
    Wb = gemv.block(torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="no backward.*no_grad"):
        gemv.matmul(x, Wb, 5)
    with torch.no_grad():
        assert gemv.matmul(x, Wb, 5).shape == (2, 5)
