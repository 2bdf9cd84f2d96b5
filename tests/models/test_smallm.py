"""The small-row CPU kernels (``dgemma/models/smallm.py``, fp32 and bf16): their products against fp64
and ``linear``, their sums independent of the other rows and of the thread count, where the decoder
sends them work, and what happens where they cannot be built."""

import pytest
import torch
import torch.nn.functional as F

from dgemma.models import primitives, smallm
from dgemma.models.primitives import Linear, fast_linear

needs_kernel = pytest.mark.skipif(smallm.kernel() is None, reason="no AVX2/FMA or no C compiler here")
needs_bf16 = pytest.mark.skipif(not smallm.bf16_kernel(), reason="no AVX512-BF16 (or no kernel) here")


def on_other_thread_count(fn):
    """``fn()`` with 2 threads where the tests run 1 (else 1), the count restored after."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        return fn()
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(8, 8), (13, 64), (1000, 640), (96, 2048)])
def test_product_equals_fp64_and_linear(m, n, k):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = smallm.smallm_linear(x, w)
    want = (x.double() @ w.double().T)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    near = F.linear(x, w)  # MKL's order of the same sums: within fp32 rounding of each other
    torch.testing.assert_close(got, near, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_each_row_is_the_same_sum_whatever_the_batch_and_threads():
    """Batch-invariant to the bit: a row's outputs do not depend on the rows beside it (the blocking
    of 3, 2, 1 or 8 rows) or on how many threads split the weight."""
    torch.manual_seed(0)
    x, w = torch.randn(11, 640), torch.randn(1003, 640)
    whole = smallm.smallm_linear(x, w)
    for i in range(11):
        assert torch.equal(smallm.smallm_linear(x[i:i + 1].contiguous(), w)[0], whole[i])
    assert torch.equal(smallm.smallm_linear(x[4:9].contiguous(), w), whole[4:9])
    assert torch.equal(on_other_thread_count(lambda: smallm.smallm_linear(x, w)), whole)


def test_fits_only_what_the_kernel_computes():
    w = torch.randn(64, 64)
    ok = smallm.kernel() is not None
    assert smallm.fits(torch.randn(1, 64), w) == ok
    assert smallm.fits(torch.randn(64, 64), w) == ok
    assert not smallm.fits(torch.randn(65, 64), w)  # more rows: a prefill, MKL's
    assert not smallm.fits(torch.randn(0, 64), w)
    assert not smallm.fits(torch.randn(2, 60), torch.randn(64, 60))  # K not a multiple of 8
    assert not smallm.fits(torch.randn(64, 2).t(), w)  # rows not packed
    assert not smallm.fits(torch.randn(2, 64), torch.randn(64, 64).t())  # a transposed weight (the signal's E.T)
    assert not smallm.fits(torch.randn(2, 64), torch.randn(64, 72))  # shapes that do not multiply
    assert not smallm.fits(torch.randn(2, 64).double(), w.double())  # fp64: linear's
    with torch.no_grad(), pytest.raises(RuntimeError):  # and linear says what is wrong
        fast_linear(torch.randn(2, 64), torch.randn(64, 72))


@needs_kernel
def test_decoder_products_take_the_kernel_in_fp32_inference_only(monkeypatch):
    calls = []
    real = smallm.smallm_linear
    monkeypatch.setattr(smallm, "smallm_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=False)
    with torch.no_grad():
        for shape in [(1, 1, 64), (2, 16, 64), (1, 64, 64), (1, 65, 64)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
        assert calls == [1, 32, 64]  # 65 rows: MKL
        calls.clear()
        lin.double()(torch.randn(3, 64).double())  # the exactness tests' fp64
        Linear(64, 96).eval()(torch.randn(3, 64))  # a bias
    lin.float()(torch.randn(3, 64, requires_grad=True)).sum().backward()  # training
    assert calls == [] and lin.weight.grad is not None


def test_without_the_kernel_the_decoder_keeps_onednn_and_mkl(monkeypatch):
    monkeypatch.setattr(smallm, "kernel", lambda: None)
    calls = []
    real = primitives._onednn
    monkeypatch.setattr(primitives, "_onednn", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    lin = Linear(64, 96, bias=False)
    with torch.no_grad():
        for rows in (1, 4, 40):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast_linear(torch.randn(1, 64), lin.weight).shape, torch.Size([1, 96]))
    assert calls == ([4, 1] if primitives._ONEDNN_LINEAR else [])  # one row of a projection: MKL


def test_a_failed_build_says_why_and_decoding_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.raises(RuntimeError, match="false"):
        smallm.build(tmp_path / "kernels")
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written left behind
    monkeypatch.setattr(smallm, "supported", lambda: True)
    smallm.kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="small-row CPU kernel is unavailable"):
            assert smallm.kernel() is None
        lin = Linear(64, 96, bias=False)
        with torch.no_grad():
            x = torch.randn(3, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    finally:
        smallm.kernel.cache_clear()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DGEMMA_SMALLM", "0")
    assert not smallm.supported()


def test_bf16_asks_for_the_kernel_only_on_a_cpu_with_avx512_bf16(monkeypatch):
    """A bf16 model on a CPU without AVX512-BF16 (or on a GPU) never builds the kernel: a machine
    without a compiler sees no warning."""
    def refuse():
        raise AssertionError("the kernel was asked for")
    monkeypatch.setattr(smallm, "kernel", refuse)
    monkeypatch.setattr(smallm, "linux_cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    smallm.bf16_kernel.cache_clear()
    try:
        lin = Linear(64, 96, bias=False).bfloat16()
        with torch.no_grad():
            x = torch.randn(1, 64).bfloat16()
            assert torch.equal(lin(x), F.linear(x, lin.weight))
    finally:
        smallm.bf16_kernel.cache_clear()
    assert not smallm.takes(1, torch.empty(8, 8, device="meta"))  # not a CPU weight: never asks


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 32])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 64), (1000, 640), (96, 2048)])
def test_bf16_product_is_fp64_rounded_once(m, n, k):
    """fp32 sums of exact bf16 products, rounded once to bf16: within half a bf16 step of the fp64
    product (plus fp32's error), and at most a step from oneDNN's bf16 ``linear``."""
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    got = smallm.smallm_linear(x, w)
    want = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8 + 1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(got, F.linear(x, w), rtol=2 ** -7, atol=1e-5 * k ** 0.5)


@needs_bf16
def test_bf16_rows_are_the_same_sums_whatever_the_batch_and_threads():
    torch.manual_seed(1)
    x, w = torch.randn(13, 640).bfloat16(), torch.randn(1003, 640).bfloat16()
    whole = smallm.smallm_linear(x, w)
    for i in range(13):
        assert torch.equal(smallm.smallm_linear(x[i:i + 1].contiguous(), w)[0], whole[i])
    assert torch.equal(smallm.smallm_linear(x[3:10].contiguous(), w), whole[3:10])
    assert torch.equal(on_other_thread_count(lambda: smallm.smallm_linear(x, w)), whole)


@needs_bf16
def test_bf16_fits_and_dispatch(monkeypatch):
    w = torch.randn(64, 64).bfloat16()
    assert smallm.fits(torch.randn(32, 64).bfloat16(), w)
    assert not smallm.fits(torch.randn(33, 64).bfloat16(), w)  # oneDNN's from here
    assert not smallm.fits(torch.randn(2, 48).bfloat16(), torch.randn(64, 48).bfloat16())  # K not a multiple of 32
    assert not smallm.fits(torch.randn(2, 64), w)  # fp32 rows against a bf16 weight
    calls = []
    real = smallm.smallm_linear
    monkeypatch.setattr(smallm, "smallm_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    lin = Linear(64, 96, bias=False).bfloat16()
    with torch.no_grad():
        for rows in (1, 32, 33):
            x = torch.randn(1, rows, 64).bfloat16()
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=2 ** -7, atol=1e-3)
    lin(torch.randn(3, 64).bfloat16().requires_grad_()).float().sum().backward()  # training: linear
    assert calls == [1, 32] and lin.weight.grad is not None


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 6, 64])
@pytest.mark.parametrize("v,d", [(5, 8), (4099, 64), (9000, 640)])
def test_signal_product_equals_fp64_and_is_batch_and_thread_invariant(m, v, d):
    """``probs @ E`` (the self-conditioning signal): vocabularies that end inside a chunk or a group of 4."""
    torch.manual_seed(m + v + d)
    p, e = torch.softmax(torch.randn(m, v) * 3, -1), torch.randn(v, d)
    got = smallm.probs_embed(p, e)
    want = p.double() @ e.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(smallm.probs_embed(p[-1:].contiguous(), e)[0], got[-1])
    assert torch.equal(on_other_thread_count(lambda: smallm.probs_embed(p, e)), got)


def test_signal_product_fits_and_dispatch(monkeypatch):
    from dgemma.models.selfcond import embed_probs

    e = torch.randn(100, 64)
    ok = smallm.kernel() is not None
    assert smallm.probs_fit(torch.rand(2, 100), e) == ok
    assert not smallm.probs_fit(torch.rand(65, 100), e)
    assert not smallm.probs_fit(torch.rand(1, 100), e)  # one row: oneDNN's
    assert not smallm.probs_fit(torch.rand(2, 99), e)  # the vocabularies differ
    assert not smallm.probs_fit(torch.rand(2, 100), torch.randn(100, 60))  # D not a multiple of 8
    assert not smallm.probs_fit(torch.rand(2, 100), torch.randn(64, 100).t())  # not packed
    calls = []
    real = smallm.probs_embed
    monkeypatch.setattr(smallm, "probs_embed", lambda p, w: calls.append(p.shape[0]) or real(p, w))
    probs = torch.softmax(torch.randn(2, 3, 100), -1)
    with torch.no_grad():
        torch.testing.assert_close(embed_probs(probs, e), probs @ e, rtol=1e-5, atol=1e-6)
    z = torch.randn(2, 100, requires_grad=True)  # training: the signal's input wants a gradient
    embed_probs(torch.softmax(z, -1), e).sum().backward()
    assert calls == ([6] if ok else []) and z.grad is not None


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 5, 24])
@pytest.mark.parametrize("v,d", [(5, 32), (4099, 64), (9001, 640)])
def test_bf16_signal_product_is_fp64_rounded_once(m, v, d):
    """The bf16 signal: pairs of vocabulary rows per lane, the columns put back in order, an odd
    vocabulary's last row, chunks that end inside a block."""
    torch.manual_seed(m + v + d)
    p, e = torch.softmax(torch.randn(m, v) * 3, -1).bfloat16(), torch.randn(v, d).bfloat16()
    got = smallm.probs_embed(p, e)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), p.double() @ e.double(), rtol=2 ** -8 + 1e-5, atol=1e-6)
    assert torch.equal(smallm.probs_embed(p[-1:].contiguous(), e)[0], got[-1])
    assert torch.equal(on_other_thread_count(lambda: smallm.probs_embed(p, e)), got)
    assert not smallm.probs_fit(torch.rand(25, v).bfloat16(), e)  # oneDNN's from here
    assert not smallm.probs_fit(p, torch.randn(v, d + 8).bfloat16())  # D not a multiple of 32


@needs_bf16
def test_bf16_signal_takes_the_kernel_except_with_amx(monkeypatch):
    """Where AMX reads the embedding at memory speed (the padded oneDNN product) it keeps that."""
    from dgemma.models import selfcond

    calls = []
    real = smallm.probs_embed
    monkeypatch.setattr(smallm, "probs_embed", lambda p, w: calls.append(p.shape[0]) or real(p, w))
    e = torch.randn(100, 64).bfloat16()
    probs = torch.softmax(torch.randn(4, 100), -1)
    with torch.no_grad():
        got = selfcond.embed_probs(probs, e)
        torch.testing.assert_close(got, probs.bfloat16() @ e, rtol=2 ** -7, atol=1e-3)
        monkeypatch.setattr(selfcond, "cpu_bf16_features", lambda: ("amx_bf16",))
        selfcond.embed_probs(probs, e)
    assert calls == [4]
