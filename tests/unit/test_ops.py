"""mxhylo.ops: C++ operators == NDArray reference == an independent numpy oracle.

The numpy functions below restate the contract from scratch (they do not call
the library). Every operator test runs through mxhylo.ops (the C++ path on
CPU, with select_kernels' AVX-512 row kernel on and off where the build has
it) and through mxhylo.ops.reference. Bitwise equality where the math is the
same float32 operations (codes, indices, residuals, values); the C++ sum of
|a| follows a documented order, which np_l1_ordered restates bit for bit; the
reference sums in another order (rtol 1e-5).

CPU-dependent paths: the library is compiled per ISA level (native,
x86-64-v3 = AVX2, x86-64 = SSE2 baseline; mxhylo.ops.build). One process can
load one build, so test_isa_builds_agree_bitwise runs every level this CPU
can run in its own subprocess on the same inputs (random, and the edges:
zeros, NaN/Inf, sizes 1 and 17, odd tails, every float16 bit pattern) and
requires every output to be bitwise identical. On an AVX-512 machine the
x86-64-v3 build is the AVX2 path (test_avx2_build_has_no_avx512 checks its
machine code has no AVX-512 register); on a CPU with AVX2 and no AVX-512 the
native build is that path, and x86-64-v3 is not built again. Levels the CPU
cannot run are skipped with the missing features named.
"""
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest

import mxhylo.ops as ops
from mxhylo.ops import build, formats as sums, reference

F32 = np.float32
FORCED_REFERENCE = os.environ.get("MXHYLO_OPS", "").lower() == "reference"


# --------------------------------------------------------------- numpy oracle
def np_quantize(g, r, t, v=None):
    """-> (codes int32 (ceil(n/16),), new residual, stats float64 (3,)).

    v: the value sent; None: the mean |a| of the sent elements (float64, then float32)."""
    t = F32(t)
    with np.errstate(invalid="ignore", over="ignore"):
        a = g.astype(F32) + r
        fin = np.isfinite(a)
        pos = fin & (a >= t)
        neg = fin & (a <= -t)
        sent = pos | neg
        if v is None:
            v = np.abs(a[sent]).astype(np.float64).mean() if sent.any() else t
        v = F32(v)
        q = np.where(pos, v, np.where(neg, -v, F32(0))).astype(F32)
        r_new = np.where(fin, a - q, r).astype(F32)
    code = (pos * 1 + neg * 2).astype(np.uint32).ravel()
    words = -(-code.size // 16)
    code = np.concatenate([code, np.zeros(words * 16 - code.size, np.uint32)]).reshape(words, 16)
    packed = np.bitwise_or.reduce(code << (2 * np.arange(16, dtype=np.uint32)), axis=1)
    stats = np.array([np.abs(a[fin]).astype(np.float64).sum(), (~fin).sum(), v])
    return packed.astype(np.uint32).view(np.int32), r_new, stats


def np_l1_ordered(g, r):
    """float32 sum of |a| over finite a in the C++ order (hylo_ops.cc, kChunk):
    element i to float32 lane i % 16, summed in element order per chunk of 1024
    elements; a chunk's 16 lanes added in lane order; chunks added in order in
    float64; the total rounded to float32. Bitwise what every build returns."""
    with np.errstate(invalid="ignore", over="ignore"):
        a = g.astype(F32).ravel() + r.ravel()
    return F32(_sum_ordered(np.where(np.isfinite(a), np.abs(a), F32(0)).astype(F32)))


def np_value_ordered(g, r, t):
    """float32 value quantize_2bit sends by default, as C++ computes it: the sum of
    the sent |a| (|a| >= t, finite) in the order of np_l1_ordered, over their count in
    float64; t if none; float32 max if the float32 lane sums overflow."""
    t = F32(t)
    with np.errstate(invalid="ignore", over="ignore"):
        a = g.astype(F32).ravel() + r.ravel()
        sent = np.isfinite(a) & (np.abs(a) >= t)
        if not sent.any():
            return t
        total = _sum_ordered(np.where(sent, np.abs(a), F32(0)).astype(F32))
    mean = total / sent.sum()
    return F32(mean) if mean <= np.finfo(F32).max else np.finfo(F32).max


def _sum_ordered(x):
    """float64 total of float32 x (n,) in the C++ order (np_l1_ordered)."""
    chunks = -(-x.size // 1024)
    x = np.concatenate([x, np.zeros(chunks * 1024 - x.size, F32)]).reshape(chunks, 64, 16)
    lanes = np.zeros((chunks, 16), F32)
    with np.errstate(over="ignore"):
        for i in range(64):  # element order within a lane
            lanes += x[:, i, :]
    sums = np.zeros(chunks, F32)
    with np.errstate(over="ignore"):
        for j in range(16):  # lane order
            sums += lanes[:, j]
    total = 0.0
    for v in sums.astype(np.float64):  # chunk order, float64
        total += v
    return total


def np_dequantize(codes, t, shape):
    n = int(np.prod(shape))
    words = codes.view(np.uint32)[:, None]
    c = (words >> (2 * np.arange(16, dtype=np.uint32))) & 3
    lut = np.array([0, F32(t), -F32(t), 0], F32)
    return lut[c.ravel()[:n]].reshape(shape)


def np_select(g, r, k):
    """-> (indices int32 (k,), values (k, F), new residual, stats (2,))."""
    rows = g.shape[0]
    width = g.size // rows
    with np.errstate(invalid="ignore", over="ignore"):
        a = (g.astype(F32) + r).reshape(rows, width)
    fin = np.isfinite(a)
    a0 = np.where(fin, a, F32(0))
    norm2 = (a0.astype(np.float64) ** 2).sum(axis=1)
    order = np.lexsort((np.arange(rows), -norm2))  # largest norm first, then lower index
    idx = np.sort(order[:k]).astype(np.int32)
    r_new = np.where(fin, a, r.reshape(rows, width))
    r_new[idx] = np.where(fin[idx], F32(0), r_new[idx])
    stats = np.array([norm2.sum(), (~fin).sum()])
    return idx, a0[idx], r_new.reshape(g.shape).astype(F32), stats


def np_scatter(idx, values, shape):
    dense = np.zeros((shape[0], int(np.prod(shape[1:]))), F32)
    dense[idx] = values
    return dense.reshape(shape)


def canon(x):
    """float32 bits with every NaN as one quiet NaN: which of two NaN operands an add
    passes on (and its sign) is the compiler's operand order, not part of a contract."""
    x = np.array(x, dtype=F32)
    x[np.isnan(x)] = np.nan
    return bits(x)


def np_velocity(g, u, m):
    """v = u * float32(m) + float32(g), one rounding after each operation."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (u * F32(m)).astype(F32) + g.astype(F32)


def np_correct(a, p, f):
    """-> (a - p * float32(f), a): the new aggregate and the new previous."""
    with np.errstate(invalid="ignore", over="ignore"):
        return a - (p * F32(f)).astype(F32), a.copy()


# ------------------------------------------------------------------ helpers
@pytest.fixture(params=["cpp", "reference"])
def impl(request):
    """The module under test: mxhylo.ops (C++ on CPU) or mxhylo.ops.reference."""
    if request.param == "cpp":
        if FORCED_REFERENCE:
            pytest.skip("MXHYLO_OPS=reference")
        assert ops.backend() == "cpp", "the C++ operator library did not build/load"
        return ops
    return reference


@pytest.fixture(params=["cpp", "cpp_portable", "reference"])
def quant_impl(request):
    """Like impl, plus the C++ library with its AVX-512 kernel (select_kernels'
    row norms; builds without AVX-512 have only the portable loop) switched off."""
    if request.param == "reference":
        yield reference
        return
    if FORCED_REFERENCE:
        pytest.skip("MXHYLO_OPS=reference")
    assert ops.backend() == "cpp", "the C++ operator library did not build/load"
    if request.param == "cpp":
        yield ops
        return
    build.set_simd(False)
    try:
        yield ops
    finally:
        build.set_simd(True)


def nd(x):
    return mx.nd.array(x, dtype=x.dtype)


def bits(x):
    """float32 array as uint32 bit patterns (so -0.0 != 0.0 and NaN == NaN)."""
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def data(shape, seed, dtype=F32, scale=1.0):
    rng = np.random.RandomState(seed)
    g = (rng.randn(*shape) * scale).astype(dtype)
    r = (rng.randn(*shape) * scale * 0.3).astype(F32)
    return g, r


SHAPES = [(1,), (16,), (17,), (33,), (1000,), (5, 3, 3, 3), (1, 1, 1, 1), (7, 1)]


# ------------------------------------------------------------- quantize_2bit
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_matches_numpy(quant_impl, shape, dtype):
    g, r = data(shape, seed=len(shape) * 100 + shape[0], dtype=dtype)
    t = 0.7
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, t)
    assert codes.dtype == np.int32 and stats.dtype == np.float32 and stats.shape == (3,)
    v = stats.asnumpy()[2]      # the value sent: the mean |a| of the sent elements
    np.testing.assert_allclose(np_quantize(g, r, t)[2], stats.asnumpy(), rtol=1e-5)
    want_codes, want_r, want_stats = np_quantize(g, r, t, v)
    assert codes.shape == want_codes.shape
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
    if quant_impl is not reference:
        assert bits(stats.asnumpy()[0]) == bits(np_l1_ordered(g, r))
        assert bits(v) == bits(np_value_ordered(g, r, t))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_given_value(quant_impl, dtype):
    """value= sends that magnitude; value=threshold is Hylo's original code (+-t)."""
    g, r = data((5, 3, 3, 3), seed=9, dtype=dtype)
    for t, v in [(0.7, 0.7), (0.7, 0.3), (0.25, 2.5)]:
        res = nd(r)
        codes, stats = quant_impl.quantize_2bit(nd(g), res, t, value=v)
        want_codes, want_r, want_stats = np_quantize(g, r, t, v)
        np.testing.assert_array_equal(codes.asnumpy(), want_codes)
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
        assert bits(stats.asnumpy()[2]) == bits(F32(v))
        np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


def test_quantize_value_keeps_the_sent_l1_mass(quant_impl):
    """Default value: the sent elements' decoded L1 mass equals their |a| sum (it is
    their mean), where sending t would send less."""
    g, r = data((4000,), seed=13)
    t = F32(0.5)
    a = g + r
    sent = np.abs(a) >= t
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, t)
    decoded = quant_impl.dequantize_2bit(codes, stats.asnumpy()[2], (4000,)).asnumpy()
    np.testing.assert_allclose(np.abs(decoded).sum(), np.abs(a[sent]).sum(), rtol=1e-5)
    assert np.abs(decoded).sum() > 1.2 * t * sent.sum()
    np.testing.assert_array_equal(np.sign(decoded[sent]), np.sign(a[sent]))


def test_quantize_zeros_and_threshold_rounding(quant_impl):
    g = np.zeros(40, F32)
    res = nd(np.zeros(40, F32))
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 1.0)
    assert not codes.asnumpy().any() and not res.asnumpy().any()
    np.testing.assert_array_equal(stats.asnumpy(), [0, 0, 1.0])  # nothing sent: v = t
    # 0.1 is not a float32: both sides must use float32(0.1)
    g = np.full(3, F32(0.1), F32)
    res = nd(np.zeros(3, F32))
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 0.1)
    np.testing.assert_array_equal(codes.asnumpy(), np_quantize(g, np.zeros(3, F32), 0.1)[0])
    assert stats.asnumpy()[2] == F32(0.1)
    assert not res.asnumpy().any()  # exactly +t sent, nothing left


def test_quantize_nonfinite(quant_impl):
    n = 50
    g, r = data((n,), seed=3)
    g[[0, 15, 16, 49]] = [np.nan, np.inf, -np.inf, np.nan]
    g[20], r[20] = F32(3e38), F32(3e38)  # finite inputs, a overflows to +inf
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 0.5)
    v = stats.asnumpy()[2]
    assert np.isfinite(v) and v >= F32(0.5)
    want_codes, want_r, want_stats = np_quantize(g, r, 0.5, v)
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    got_r = res.asnumpy()
    np.testing.assert_array_equal(bits(got_r), bits(want_r))
    bad = [0, 15, 16, 20, 49]
    np.testing.assert_array_equal(bits(got_r[bad]), bits(r[bad]))  # residual untouched
    decoded = np_dequantize(codes.asnumpy(), v, (n,))
    assert not decoded[bad].any()  # code 0
    assert stats.asnumpy()[1] == 5
    np.testing.assert_allclose(stats.asnumpy(), np_quantize(g, r, 0.5)[2], rtol=1e-5)


def deferred_chain(impl, steps, r0, thresholds):
    """The store's protocol (kvstore TwoBit): quantize with defer=True; the next call
    pays the debt through pending=(t, v), unless the call saw a non-finite a: then it
    is settled by its codes at once. Returns [(codes, stats)] and the residual, settled."""
    residual, owed, out = nd(r0), None, []
    for g, t in zip(steps, thresholds):
        codes, stats = impl.quantize_2bit(nd(g), residual, t, pending=owed, defer=True)
        st = stats.asnumpy()
        out.append((codes.asnumpy(), st))
        owed = (t, st[2])
        if st[1]:
            impl.settle_2bit(codes, st[2], residual)
            owed = None
    if owed is not None:
        assert impl.settle_2bit(codes, owed[1], residual) is residual
    return out, residual.asnumpy()


@pytest.mark.parametrize("shape", [(1,), (17,), (33,), (1025,), (5, 3, 3, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_deferred_chain_is_bitwise_the_eager_one(quant_impl, shape, dtype):
    """defer=True leaves residual <- a (q owed); the next call pays it through
    ``pending`` in its own pass, settle_2bit pays it alone: four steps of that give
    the eager chain's codes, stats and residual bit for bit, NaN/Inf/-0 included."""
    n = int(np.prod(shape))
    steps = [data(shape, seed=40 + k, dtype=dtype)[0] for k in range(4)]
    r0 = data(shape, seed=40, dtype=dtype)[1]
    r0.reshape(-1)[::3] = -0.0
    steps[2].reshape(-1)[::4] = 0
    if n >= 17:
        steps[1].reshape(-1)[[0, 16]] = [np.nan, -np.inf]
    thresholds = [0.7, 0.6, 0.5, 0.4]
    eager, want = nd(r0), []
    for g, t in zip(steps, thresholds):
        codes, stats = quant_impl.quantize_2bit(nd(g), eager, t)
        want.append((codes.asnumpy(), stats.asnumpy()))
    got, residual = deferred_chain(quant_impl, steps, r0, thresholds)
    for (cg, sg), (cw, sw) in zip(got, want):
        np.testing.assert_array_equal(cg, cw)
        assert bits(sg).tolist() == bits(sw).tolist()
    np.testing.assert_array_equal(bits(residual), bits(eager.asnumpy()))
    # nothing owed before the first call: residual <- a, the old r where a is not finite
    res = nd(r0)
    quant_impl.quantize_2bit(nd(steps[0]), res, 0.7, defer=True)
    with np.errstate(invalid="ignore", over="ignore"):
        a = steps[0].astype(F32) + r0
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(np.where(np.isfinite(a), a, r0)))


def test_quantize_pending_owes_by_the_residual_sign(quant_impl):
    """pending=(t, v): where |r| >= t the residual owes +-v by its sign, elsewhere
    nothing (against numpy, at the threshold's edge and at -0)."""
    g, r = data((50,), seed=5)
    r[:6] = [0.5, -0.5, np.nextafter(F32(0.5), F32(0)), -0.0, 0.0, 2.0]
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 0.3, pending=(0.5, 0.25))
    owed = np.where(np.abs(r) >= F32(0.5), np.where(r > 0, F32(0.25), F32(-0.25)), F32(0))
    paid = (r - owed.astype(F32)).astype(F32)
    want_codes, want_r, _ = np_quantize(g, paid, 0.3, stats.asnumpy()[2])
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))


def test_pending_validation_errors(impl):
    g, r = nd(np.ones(20, F32)), nd(np.zeros(20, F32))
    with pytest.raises(TypeError, match="pending must be the \\(threshold, value\\) pair"):
        impl.quantize_2bit(g, r, 1.0, pending=nd(np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="pending threshold must be finite and > 0"):
        impl.quantize_2bit(g, r, 1.0, pending=(0.0, 1.0))
    with pytest.raises(ValueError, match="pending value must be finite and > 0"):
        impl.quantize_2bit(g, r, 1.0, pending=(1.0, float("inf")))
    with pytest.raises(ValueError, match="settle_2bit: codes must have shape"):
        impl.settle_2bit(nd(np.zeros(1, np.int32)), 1.0, r)
    with pytest.raises(ValueError, match="settle_2bit: value must be finite"):
        impl.settle_2bit(nd(np.zeros(2, np.int32)), float("nan"), r)


def test_quantize_large_values(quant_impl):
    g = np.array([1e30, -1e30, 1e-30, 1.5e38, -1.5e38, 1.0], F32)  # sum |a| < float32 max
    r = np.array([1e30, 0, 0, 0, 0, -1.0], F32)
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 1e29)
    want_codes, want_r, want_stats = np_quantize(g, r, 1e29, stats.asnumpy()[2])
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
    np.testing.assert_allclose(stats.asnumpy(), np_quantize(g, r, 1e29)[2], rtol=1e-5)


def test_quantize_value_sum_overflow_stays_finite(quant_impl):
    """48 elements of 3e38: the C++ float32 lane sums overflow (v = float32 max), the
    reference's float64 sum does not (v = 3e38); either way nothing becomes Inf."""
    g = np.full(48, 3e38, F32)
    res = nd(np.zeros(48, F32))
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 1.0)
    v = stats.asnumpy()[2]
    assert np.isfinite(v) and v >= F32(3e38)
    if quant_impl is not reference:
        assert v == np_value_ordered(g, np.zeros(48, F32), 1.0) == np.finfo(F32).max
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(np_quantize(g, 0 * g, 1.0, v)[1]))
    assert np.isfinite(res.asnumpy()).all()


def test_quantize_roundtrip(quant_impl):
    shape = (37, 29)
    g, r = data(shape, seed=11)
    t = F32(0.6)
    a = g + r
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, t)
    v = stats.asnumpy()[2]
    decoded = quant_impl.dequantize_2bit(codes, v, shape).asnumpy()
    new_r = res.asnumpy()
    # the residual is exactly what was not sent, in float32 arithmetic ...
    np.testing.assert_array_equal(bits(new_r), bits(a - decoded))
    # ... and sent + kept == a exactly where nothing was sent, or where Sterbenz
    # makes a - q exact (v/2 <= |a| <= 2v)
    small = (decoded == 0) | ((np.abs(a) >= v / 2) & (np.abs(a) <= 2 * v))
    assert small.sum() > 100
    np.testing.assert_array_equal((decoded + new_r)[small], a[small])
    np.testing.assert_array_max_ulp(decoded + new_r, a, maxulp=1)


def test_l1_stats(quant_impl):
    g, r = data((5, 3, 3, 3), seed=5, dtype=np.float16)
    g[0, 0, 0, 0] = np.nan
    gnd, rnd = nd(g), nd(r)
    stats = quant_impl.l1_stats(gnd, rnd)
    assert stats.shape == (2,)
    np.testing.assert_allclose(stats.asnumpy(), np_quantize(g, r, 1.0)[2][:2], rtol=1e-5)
    np.testing.assert_array_equal(bits(rnd.asnumpy()), bits(r))  # no writes
    np.testing.assert_array_equal(gnd.asnumpy(), g)


# ----------------------------------------------------------- dequantize_2bit
@pytest.mark.parametrize("shape", [(1,), (16,), (17,), (33,), (5, 3, 3, 3), (7, 1)])
def test_dequantize_matches_numpy(impl, shape):
    n = int(np.prod(shape))
    rng = np.random.RandomState(n)
    words = -(-n // 16)
    # every code, 3 included (decodes to 0); tail bits set too (ignored)
    codes = rng.randint(-2 ** 31, 2 ** 31 - 1, size=words, dtype=np.int64).astype(np.int32)
    want = np_dequantize(codes, 0.25, shape)
    got = impl.dequantize_2bit(nd(codes), 0.25, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(bits(got.asnumpy()), bits(want))
    out = nd(np.full(shape, 7.0, F32))
    assert impl.dequantize_2bit(nd(codes), 0.25, shape, out=out) is out
    np.testing.assert_array_equal(bits(out.asnumpy()), bits(want))


def test_dequantize_accumulate_several_workers(impl):
    shape = (33, 5)
    base = np.random.RandomState(1).randn(*shape).astype(F32)
    want = base.copy()
    out = nd(base)
    for worker, t in enumerate([0.5, 0.125, 1.75]):
        g, r = data(shape, seed=20 + worker)
        codes, _, _ = np_quantize(g, r, t, t)
        want += np_dequantize(codes, t, shape)  # float32 adds in the same order
        assert impl.dequantize_2bit(nd(codes), t, shape, out=out, accumulate=True) is out
    np.testing.assert_array_equal(bits(out.asnumpy()), bits(want))


# ------------------------------------------------------------ select_kernels
SELECT_CASES = [((5, 3, 3, 3), [0, 1, 2, 5]), ((1, 1, 1, 1), [0, 1]), ((7, 1), [0, 3, 7]),
                ((7,), [2]), ((64, 33), [1, 10, 64]), ((10, 4, 1, 1), [4])]


@pytest.mark.parametrize("shape,ks", SELECT_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_select_matches_numpy(quant_impl, shape, ks, dtype):
    for k in ks:
        g, r = data(shape, seed=k + shape[0], dtype=dtype)
        want_idx, want_val, want_r, want_stats = np_select(g, r, k)
        res = nd(r)
        idx, val, stats = quant_impl.select_kernels(nd(g), res, k)
        width = int(np.prod(shape[1:]))
        assert idx.dtype == np.int32 and idx.shape == (k,)
        assert val.dtype == np.float32 and val.shape == (k, width)
        np.testing.assert_array_equal(idx.asnumpy(), want_idx)
        np.testing.assert_array_equal(bits(val.asnumpy()), bits(want_val))
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
        np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


def test_select_ties_lower_index_wins(impl):
    row = np.arange(12, dtype=F32).reshape(3, 4) / 7
    g = np.stack([row, row * 2, row, row * 2, row, -row * 2])  # norms: x, 2x, x, 2x, x, 2x
    r = np.zeros_like(g)
    for k, want in [(1, [1]), (2, [1, 3]), (3, [1, 3, 5]), (4, [0, 1, 3, 5]), (5, [0, 1, 2, 3, 5])]:
        idx, _, _ = impl.select_kernels(nd(g), nd(r), k)
        np.testing.assert_array_equal(idx.asnumpy(), want)
    idx, val, stats = impl.select_kernels(nd(np.zeros((6, 2), F32)), nd(np.zeros((6, 2), F32)), 4)
    np.testing.assert_array_equal(idx.asnumpy(), [0, 1, 2, 3])
    assert not val.asnumpy().any() and not stats.asnumpy().any()


def test_select_nonfinite(quant_impl):
    impl = quant_impl
    shape = (6, 2, 3)
    g, r = data(shape, seed=9)
    g[0, 0, 0] = 100.0  # row 0 chosen (largest norm) and holds a NaN
    g[0, 1, 2] = np.nan
    g[3, 0, 1] = -np.inf  # row 3: not chosen, holds an Inf
    g[5, 1, 1], r[5, 1, 1] = F32(3e38), F32(3e38)  # overflow to +inf
    want_idx, want_val, want_r, want_stats = np_select(g, r, 2)
    res = nd(r)
    idx, val, stats = impl.select_kernels(nd(g), res, 2)
    assert 0 in idx.asnumpy()
    np.testing.assert_array_equal(idx.asnumpy(), want_idx)
    np.testing.assert_array_equal(bits(val.asnumpy()), bits(want_val))
    got_r = res.asnumpy()
    np.testing.assert_array_equal(bits(got_r), bits(want_r))
    for pos in [(0, 1, 2), (3, 0, 1), (5, 1, 1)]:
        assert bits(got_r[pos]) == bits(r[pos])  # residual untouched
    assert np.isfinite(val.asnumpy()).all()
    assert stats.asnumpy()[1] == 3
    np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


# ----------------------------------------------------------- scatter_kernels
def test_scatter_matches_numpy(impl):
    shape = (9, 2, 3)
    rng = np.random.RandomState(4)
    for idx in [[], [0], [2, 5, 8], list(range(9))]:
        idx = np.array(idx, np.int32)
        values = rng.randn(len(idx), 6).astype(F32)
        want = np_scatter(idx, values, shape)
        got = impl.scatter_kernels(nd(idx), nd(values), shape)
        assert got.dtype == np.float32 and got.shape == shape
        np.testing.assert_array_equal(bits(got.asnumpy()), bits(want))
        out = nd(np.full(shape, 3.0, F32))
        assert impl.scatter_kernels(nd(idx), nd(values), shape, out=out) is out
        np.testing.assert_array_equal(bits(out.asnumpy()), bits(want))


def test_scatter_accumulate_several_workers(impl):
    shape = (12, 5)
    rng = np.random.RandomState(6)
    base = rng.randn(*shape).astype(F32)
    want = base.copy()
    out = nd(base)
    for k in [3, 0, 12, 5]:
        g, r = data(shape, seed=30 + k)
        idx, values, _, _ = np_select(g, r, k)
        want[idx] += values
        assert impl.scatter_kernels(nd(idx), nd(values), shape, out=out, accumulate=True) is out
    np.testing.assert_array_equal(bits(out.asnumpy()), bits(want))


def test_select_scatter_roundtrip(impl):
    shape = (16, 3, 3, 3)
    g, r = data(shape, seed=12)
    a = g + r
    res = nd(r)
    idx, values, _ = impl.select_kernels(nd(g), res, 5)
    sent = impl.scatter_kernels(idx, values, shape).asnumpy()
    np.testing.assert_array_equal(sent + res.asnumpy(), a)  # one side is 0 everywhere


@pytest.mark.parametrize("idx", [[1, 1], [3, 2], [-1], [9]])
def test_scatter_rejects_bad_indices(impl, idx):
    idx = np.array(idx, np.int32)
    values = np.ones((len(idx), 2), F32)
    out = nd(np.zeros((9, 2), F32))
    with pytest.raises((ValueError, mx.base.MXNetError), match="strictly increasing"):
        impl.scatter_kernels(nd(idx), nd(values), (9, 2), out=out, accumulate=True)
        out.asnumpy()  # the C++ op reports asynchronously, at the next sync
    assert not out.asnumpy().any()  # checked before any write


# ------------------------------------------------------ host views
def test_host_view_is_the_arrays_own_memory_after_the_engine():
    """host_view reads what the engine wrote (a pending operation is waited for), a
    write through it is the NDArray's (a slice's view covers only the slice), and the
    view keeps its array alive."""
    whole = mx.nd.zeros((6, 7))
    flat = whole.reshape((-1,))
    piece = flat[9:30]
    mx.nd.elemwise_add(mx.nd.ones((21,)), mx.nd.ones((21,)), out=piece)   # queued
    view = ops.host_view(piece)
    assert view.dtype == F32 and view.shape == (21,)
    np.testing.assert_array_equal(view, np.full(21, 2, F32))
    written = ops.host_view(piece, write=True)
    written[:] = np.arange(21, dtype=F32)
    expected = np.zeros(42, F32)
    expected[9:30] = np.arange(21)
    np.testing.assert_array_equal(whole.asnumpy().reshape(-1), expected)
    kept = ops.host_view(mx.nd.array(np.arange(5, dtype=np.int32), dtype=np.int32))
    np.testing.assert_array_equal(kept, np.arange(5))       # its NDArray is gone by now
    with pytest.raises(TypeError, match="dense NDArray"):
        ops.host_view(mx.nd.zeros((4, 2)).tostype("row_sparse"))


# ------------------------------------------------------ momentum correction
MOMENTUM_EDGES = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, -3e38, 1e-45]


def _with_edges(x, seed):
    if x.size >= 17:
        flat = x.reshape(-1)
        flat[np.random.RandomState(seed).choice(flat.size, 8, replace=False)] = MOMENTUM_EDGES
    return x


@pytest.mark.parametrize("shape", SHAPES + [(70001,)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_momentum_velocity_matches_numpy(impl, shape, dtype):
    g, u = data(shape, seed=shape[0] + 7, dtype=dtype)
    g, u = _with_edges(g, 1), _with_edges(u, 2)
    for m in (0.9, 0.0, 1.0 / 3.0):
        v = impl.momentum_velocity(nd(g), nd(u), m)
        assert v.dtype == F32 and v.shape == shape
        np.testing.assert_array_equal(canon(v.asnumpy()), canon(np_velocity(g, u, m)))
    out, before = nd(u), u.copy()          # out may be the velocity itself
    impl.momentum_velocity(nd(g), out, 0.9, out=out)
    np.testing.assert_array_equal(canon(out.asnumpy()), canon(np_velocity(g, before, 0.9)))


@pytest.mark.parametrize("shape", SHAPES + [(70001,)])
def test_momentum_correct_matches_numpy(impl, shape):
    a, p = data(shape, seed=shape[0] + 11)
    a, p = _with_edges(a, 3), _with_edges(p.astype(F32), 4)
    f = 0.9 * 0.123 / 0.777
    agg, prev = nd(a), nd(p)
    got = impl.momentum_correct(agg, prev, f)
    want_a, want_p = np_correct(a, p, f)
    assert got is agg
    np.testing.assert_array_equal(canon(agg.asnumpy()), canon(want_a))
    np.testing.assert_array_equal(canon(prev.asnumpy()), canon(want_p))


def test_momentum_ops_are_mxnets_own_arithmetic(impl):
    """The fused passes give the bits of the NDArray expressions they replace."""
    g, u = data((4099,), seed=5)
    m = 0.9
    v = impl.momentum_velocity(nd(g), nd(u), m)
    np.testing.assert_array_equal(canon(v.asnumpy()), canon((nd(u) * m + nd(g)).asnumpy()))
    f = 0.9 * 0.3 / 0.7
    agg, prev = nd(g), nd(u)
    impl.momentum_correct(agg, prev, f)
    np.testing.assert_array_equal(canon(agg.asnumpy()), canon((nd(g) - nd(u) * f).asnumpy()))


def test_momentum_validation_errors(impl):
    g, u = nd(np.ones((4, 3), F32)), nd(np.zeros((4, 3), F32))
    with pytest.raises(TypeError, match="velocity must have dtype"):
        impl.momentum_velocity(g, u.astype(np.float16), 0.9)
    with pytest.raises(ValueError, match="shape"):
        impl.momentum_velocity(g, nd(np.zeros(12, F32)), 0.9)
    for bad in [float("nan"), float("inf"), 1e39]:
        with pytest.raises(ValueError, match="momentum must be finite"):
            impl.momentum_velocity(g, u, bad)
    with pytest.raises(TypeError, match="momentum must be a real number"):
        impl.momentum_velocity(g, u, None)
    with pytest.raises(TypeError, match="aggregate must have dtype"):
        impl.momentum_correct(g.astype(np.float16), u, 0.5)
    with pytest.raises(ValueError, match="previous has shape"):
        impl.momentum_correct(g, nd(np.zeros(12, F32)), 0.5)
    with pytest.raises(ValueError, match="factor must be finite"):
        impl.momentum_correct(g, u, float("inf"))


# --------------------------------------------------------------- encode_2bit
def encode_by_parts(impl, g, r, t, value=None, u=None, m=None, bound=None):
    """encode_2bit's contract, op by op: the velocity, quantize_2bit (settled), and
    bound_rows where bound is given and nothing was non-finite. -> (codes, stats (4,),
    residual, velocity or None); stats[2] the mean sent |a| as quantize_2bit's
    value-less call reports it."""
    x = nd(g) if u is None else impl.momentum_velocity(nd(g), nd(u), m)
    res = nd(r)
    codes, stats = impl.quantize_2bit(x, res, t, value=value)
    stats = stats.asnumpy()
    if value is not None:
        stats[2] = impl.quantize_2bit(x, nd(r), t)[1].asnumpy()[2]
    cut = 0.0
    if bound is not None and not stats[1]:
        cut = float(impl.bound_rows(res, x, bound).asnumpy()[0])
    return (codes.asnumpy(), np.append(stats, F32(cut)), res.asnumpy(),
            None if u is None else x.asnumpy())


ENCODE_SHAPES = [(1,), (17,), (5, 3), (7, 2049), (64, 147), (3, 7, 3, 3), (33, 5, 1, 1)]


@pytest.mark.parametrize("shape", ENCODE_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("bound", [None, 1.0, 0.25])
def test_encode_2bit_is_bitwise_its_parts(quant_impl, shape, dtype, momentum, bound):
    """The fused operator of a 2-bit layer's stages gives the bits of the stages' own
    operators (velocity, quantize, row bound), with rows cut and rows kept."""
    rng = np.random.RandomState(sum(shape))
    g = rng.randn(*shape).astype(dtype)
    # rows of every scale: the bound cuts some rows and leaves others
    rows = shape[0] if len(shape) > 1 else 1
    scale = 10.0 ** rng.randint(-1, 2, size=rows)
    r = (rng.randn(rows, g.size // rows) * scale[:, None]).astype(F32).reshape(shape)
    u = None if momentum is None else rng.randn(*shape).astype(F32)
    for value in (None, 0.6):
        want = encode_by_parts(quant_impl, g, r, 0.8, value, u, momentum, bound)
        res, out = nd(r), None if u is None else nd(np.zeros(shape, F32))
        codes, stats, vel = quant_impl.encode_2bit(
            nd(g), res, 0.8, value=value, velocity=None if u is None else nd(u),
            momentum=momentum, velocity_out=out, bound=bound)
        np.testing.assert_array_equal(codes.asnumpy(), want[0])
        np.testing.assert_array_equal(bits(stats.asnumpy()), bits(want[1]))
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want[2]))
        if u is None:
            assert vel is None
        else:
            assert vel is out
            np.testing.assert_array_equal(bits(vel.asnumpy()), bits(want[3]))
    if bound == 1.0 and len(shape) > 1 and shape[0] >= 7:
        assert 0 < want[1][3] < shape[0]        # some rows cut, some kept


def test_encode_2bit_nonfinite_settles_and_does_not_bound(quant_impl):
    """A non-finite element: the residual is what quantize_2bit leaves (settled, not
    bounded: the caller undoes the step), the count in stats[1], no row counted cut."""
    rng = np.random.RandomState(5)
    g, u = rng.randn(6, 40).astype(F32), rng.randn(6, 40).astype(F32)
    r = (rng.randn(6, 40) * 100).astype(F32)          # far over the bound
    g[2, 7], g[4, 0] = np.nan, np.inf
    res = nd(r)
    codes, stats, vel = quant_impl.encode_2bit(nd(g), res, 0.5, velocity=nd(u), momentum=0.9,
                                               bound=1.0)
    want = encode_by_parts(quant_impl, g, r, 0.5, None, u, 0.9, None)
    np.testing.assert_array_equal(codes.asnumpy(), want[0])
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want[2]))
    assert stats.asnumpy()[1] == 2 and stats.asnumpy()[3] == 0


def test_encode_2bit_matches_numpy(quant_impl):
    """Against numpy (not the package's own parts): velocity, codes, residual, bound."""
    rng = np.random.RandomState(8)
    g, u = rng.randn(9, 50).astype(F32), rng.randn(9, 50).astype(F32)
    r = (rng.randn(9, 50) * 3).astype(F32)
    res = nd(r)
    codes, stats, vel = quant_impl.encode_2bit(nd(g), res, 0.7, velocity=nd(u), momentum=0.9,
                                               bound=0.5)
    x = (u * F32(0.9)).astype(F32) + g
    np.testing.assert_array_equal(bits(vel.asnumpy()), bits(x))
    v = np_value_ordered(x, r, 0.7) if quant_impl is ops else stats.asnumpy()[2]
    want_codes, settled, _ = np_quantize(x, r, 0.7, v)
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    allowed = 0.5 * np.sqrt((x.astype(np.float64) ** 2).sum(1))
    held = np.sqrt((settled.astype(np.float64) ** 2).sum(1))
    want = settled * np.minimum(1.0, allowed / held)[:, None]
    np.testing.assert_allclose(res.asnumpy(), want, rtol=1e-6, atol=1e-7)
    assert stats.asnumpy()[3] == (held > allowed).sum() > 0


def test_encode_2bit_validation_errors(impl):
    g, r, u = (nd(np.ones((4, 3), F32)) for _ in range(3))
    with pytest.raises(ValueError, match="velocity and momentum go together"):
        impl.encode_2bit(g, r, 1.0, velocity=u)
    with pytest.raises(ValueError, match="must not be velocity itself"):
        impl.encode_2bit(g, r, 1.0, velocity=u, momentum=0.9, velocity_out=u)
    with pytest.raises(ValueError, match="velocity_out without a velocity"):
        impl.encode_2bit(g, r, 1.0, velocity_out=u)
    with pytest.raises(ValueError, match="bound must be >= 0"):
        impl.encode_2bit(g, r, 1.0, bound=-1.0)
    with pytest.raises(ValueError, match="shape"):
        impl.encode_2bit(g, r, 1.0, velocity=nd(np.ones(12, F32)), momentum=0.9)


# ------------------------------------------------------------ split_sections
@pytest.mark.parametrize("sizes", [[1], [5], [3, 1, 7], [16] * 40 + [1000, 1]])
def test_split_sections_writes_each_section(impl, sizes):
    """Each output gets its section of x, bit for bit (NaN, -0 and Inf included)."""
    x = np.random.RandomState(len(sizes)).randn(sum(sizes)).astype(F32)
    x[:3] = [np.nan, -0.0, np.inf][:min(3, x.size)]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    outs = [nd(np.full(s, 7, F32)) for s in sizes]
    assert impl.split_sections(nd(x), offsets, outs) is outs
    for o, start, size in zip(outs, offsets, sizes):
        np.testing.assert_array_equal(bits(o.asnumpy()), bits(x[start:start + size]))


def test_split_sections_validation_errors(impl):
    x = nd(np.ones(10, F32))
    outs = [nd(np.zeros(4, F32)), nd(np.zeros(6, F32))]
    with pytest.raises(ValueError, match="ascending from 0"):
        impl.split_sections(x, [1, 4], outs)
    with pytest.raises(ValueError, match="ascending from 0"):
        impl.split_sections(x, [0, 4, 4], outs + [nd(np.zeros(0 + 1, F32))])
    with pytest.raises(ValueError, match="2 offsets but 1 outputs"):
        impl.split_sections(x, [0, 4], outs[:1])
    with pytest.raises(ValueError, match=r"out has shape \(4,\), expected \(6,\)"):
        impl.split_sections(x, [0, 6], outs)
    with pytest.raises(ValueError, match="1-D"):
        impl.split_sections(nd(np.ones((2, 5), F32)), [0], [nd(np.zeros(10, F32))])


# ---------------------------------------------------------------- validation
def test_validation_errors(impl):
    g, r = nd(np.ones((4, 3), F32)), nd(np.zeros((4, 3), F32))
    with pytest.raises(TypeError, match="grad must have dtype"):
        impl.quantize_2bit(g.astype(np.float64), r, 1.0)
    with pytest.raises(TypeError, match="residual must have dtype"):
        impl.select_kernels(g, r.astype(np.float16), 1)
    with pytest.raises(ValueError, match="shape"):
        impl.quantize_2bit(g, nd(np.zeros(12, F32)), 1.0)
    for bad in [0.0, -1.0, float("nan"), float("inf"), 1e-50]:
        with pytest.raises(ValueError, match="threshold"):
            impl.quantize_2bit(g, r, bad)
    with pytest.raises(TypeError, match="threshold"):
        impl.quantize_2bit(g, r, True)
    for bad in [0.0, -2.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="quantize_2bit: value must be finite and > 0"):
            impl.quantize_2bit(g, r, 1.0, value=bad)
        with pytest.raises(ValueError, match="dequantize_2bit: value must be finite and > 0"):
            impl.dequantize_2bit(nd(np.zeros(1, np.int32)), bad, (4, 3))
    for k in [-1, 5]:
        with pytest.raises(ValueError, match="k=%d is out of range" % k):
            impl.select_kernels(g, r, k)
    with pytest.raises(ValueError, match="codes must have shape"):
        impl.dequantize_2bit(nd(np.zeros(2, np.int32)), 1.0, (4, 3))
    with pytest.raises(ValueError, match="out has shape"):
        impl.dequantize_2bit(nd(np.zeros(1, np.int32)), 1.0, (4, 3), out=nd(np.zeros(12, F32)))
    with pytest.raises(ValueError, match=r"values \(k, 3\)"):
        impl.scatter_kernels(nd(np.zeros(1, np.int32)), nd(np.zeros((1, 2), F32)), (4, 3))
    with pytest.raises(TypeError, match="NDArray"):
        impl.l1_stats(np.ones(3, F32), r)


# ------------------------------------------------------------ build/dispatch
def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "MXHYLO_OPS"}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    return out


def test_forced_reference_backend():
    out = run_python("""
        import warnings
        import mxnet as mx, mxhylo.ops as ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ops.backend() == "reference", ops.backend()
            codes, stats = ops.quantize_2bit(mx.nd.ones((20,)), mx.nd.zeros((20,)), 0.5)
        assert codes.shape == (2,) and not hasattr(mx.nd, "hylo_quantize_2bit")
        assert not [w for w in caught if "mxhylo" in str(w.message)]  # chosen, not a failure
        print("ok")
    """, MXHYLO_OPS="reference")
    assert "ok" in out


def test_build_failure_falls_back_with_one_warning(tmp_path):
    out = run_python("""
        import warnings
        import mxnet as mx, mxhylo.ops as ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ops.backend() == "reference"
            ops.quantize_2bit(mx.nd.ones((20,)), mx.nd.zeros((20,)), 0.5)
            ops.select_kernels(mx.nd.ones((4, 2)), mx.nd.zeros((4, 2)), 1)
            assert ops.backend() == "reference"
        ours = [w for w in caught if "mxhylo" in str(w.message)]  # (scipy warns too)
        assert len(ours) == 1, [str(w.message) for w in caught]
        print("WARNING:", ours[0].message)
    """, MXHYLO_CXX="/bin/false", MXHYLO_BUILD_DIR=str(tmp_path))
    assert "/bin/false" in out and "reference" in out


FAKE_CXX = """
import sys, time
args = sys.argv[1:]
with open(%r, "a") as log:
    log.write("compile\\n")
time.sleep(1.0)  # long enough for the other processes to queue on the lock
with open(args[args.index("-o") + 1], "wb") as f:
    f.write(b"not really a library")
"""


def test_concurrent_builds_compile_once(tmp_path):
    """Several roles starting at once: one compile, everyone gets the same file."""
    log = tmp_path / "compiles.log"
    script = tmp_path / "fake_cxx.py"
    script.write_text(FAKE_CXX % str(log))
    env = dict(os.environ, MXHYLO_CXX="%s %s" % (sys.executable, script),
               MXHYLO_BUILD_DIR=str(tmp_path / "cache"))
    code = "from mxhylo.ops import build; print(build.build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
             for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].decode().strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and os.path.exists(paths.pop())
    assert log.read_text().count("compile") == 1
    leftovers = [f for f in os.listdir(tmp_path / "cache") if f.startswith(".")]
    assert not leftovers  # temporary outputs renamed or removed


def test_cache_key_tracks_flags_and_compiler():
    key = build.cache_key(["g++"], build.BASE_FLAGS)
    assert key == build.cache_key(["g++"], list(build.BASE_FLAGS))
    assert key != build.cache_key(["g++"], build.BASE_FLAGS + ["-DX"])
    assert key != build.cache_key(["clang++"], build.BASE_FLAGS)


@pytest.mark.parametrize("simd", [True, False])
def test_large_arrays_match_numpy(simd):
    """Arrays of many 1024-element chunks, non-finite values far apart."""
    if FORCED_REFERENCE:
        pytest.skip("MXHYLO_OPS=reference")
    assert ops.backend() == "cpp"
    build.set_simd(simd)
    shape = (600, 8, 8, 8)  # 307200 elements
    g, r = data(shape, seed=42, scale=0.01)
    g[1, 0, 0, 0] = np.nan
    g[590, 7, 7, 7] = np.inf
    try:
        res = nd(r)
        codes, stats = ops.quantize_2bit(nd(g), res, 0.004)
        v = stats.asnumpy()[2]
        assert bits(v) == bits(np_value_ordered(g, r, 0.004))
        want_codes, want_r, want_stats = np_quantize(g, r, 0.004, v)
        np.testing.assert_array_equal(codes.asnumpy(), want_codes)
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
        np.testing.assert_allclose(stats.asnumpy(), np_quantize(g, r, 0.004)[2], rtol=1e-5)
        assert bits(stats.asnumpy()[0]) == bits(np_l1_ordered(g, r))
        assert stats.asnumpy()[1] == 2
        out = nd(np.ones(shape, F32))
        ops.dequantize_2bit(codes, v, shape, out=out, accumulate=True)
        np.testing.assert_array_equal(out.asnumpy(), 1 + np_dequantize(want_codes, v, shape))

        res = nd(r)
        idx, val, stats = ops.select_kernels(nd(g), res, 100)
        want_idx, want_val, want_r, want_stats = np_select(g, r, 100)
        np.testing.assert_array_equal(idx.asnumpy(), want_idx)
        np.testing.assert_array_equal(bits(val.asnumpy()), bits(want_val))
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
        np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)
        out = nd(np.ones(shape, F32))
        ops.scatter_kernels(idx, val, shape, out=out, accumulate=True)
        want = np.ones(shape, F32)
        want.reshape(600, -1)[want_idx] += want_val
        np.testing.assert_array_equal(out.asnumpy(), want)
    finally:
        build.set_simd(True)


# ------------------------------------------------------------ ISA levels
def test_isa_levels_and_missing_features():
    assert build.normalize_isa("baseline") == "x86-64"
    assert build.normalize_isa("AVX2") == "x86-64-v3"
    with pytest.raises(build.BuildError, match="unknown ISA level 'sse9'.*x86-64-v3"):
        build.normalize_isa("sse9")
    assert "-march=x86-64-v3" in build.flags("x86-64-v3")
    assert "-march=native" in build.flags("native")
    assert "-fopenmp" not in build.flags()  # no threads of ours between exchanges
    avx2_only = {"sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm", "pni", "abm",
                 "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
    assert build.missing_features("x86-64-v3", cpu=avx2_only) == []
    assert build.missing_features("x86-64-v4", cpu=avx2_only) == [
        "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
    assert build.missing_features("x86-64-v3", cpu={"sse2"})[:3] == ["cx16", "lahf_lm", "popcnt"]
    assert build.missing_features("native", cpu=set()) == []
    # the key follows the level; only native builds are tied to the CPU model
    assert build.cache_key(["g++"], build.flags("x86-64")) != build.cache_key(
        ["g++"], build.flags("x86-64-v3"))


def test_level_the_cpu_lacks_is_refused_by_name(tmp_path):
    out = run_python("""
        import warnings
        from mxhylo.ops import build
        import mxhylo.ops as ops
        build.is_x86_64 = lambda: True
        build.cpu_flags = lambda: {"sse2", "avx"}   # a CPU without AVX2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ops.backend() == "reference"
        print("WARNING:", [str(w.message) for w in caught if "mxhylo" in str(w.message)][0])
    """, MXHYLO_ISA="x86-64-v3", MXHYLO_BUILD_DIR=str(tmp_path))
    assert "x86-64-v3 needs CPU features this CPU lacks: " in out and "avx2" in out, out
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".so")]  # nothing compiled


ISA_CHILD = """
import sys
sys.path.insert(0, %r)
import test_ops
test_ops.isa_child(%r)
"""


def isa_inputs():
    """name -> (op, args) of every cross-build case: random data and the edges."""
    cases = {}
    rng = np.random.RandomState(123)
    for n in [1, 16, 17, 33, 1000, 1023, 1024, 1025, 4099, 70001]:
        for dtype in (np.float32, np.float16):
            g = (rng.randn(n) * rng.choice([0.01, 1.0])).astype(dtype)
            r = (rng.randn(n) * 0.3).astype(F32)
            if n >= 17:
                g[rng.randint(0, n, 3)] = [np.nan, np.inf, -np.inf]
            cases["q_%d_%s" % (n, np.dtype(dtype).name)] = ("quantize", g, r, 0.7)
    cases["q_zeros"] = ("quantize", np.zeros(40, F32), np.zeros(40, F32), 1.0)
    cases["q_negzeros"] = ("quantize", -np.zeros(33, F32), -np.zeros(33, F32), 1.0)
    g = np.array([1e30, -1e30, 1e-30, 1.5e38, -1.5e38, 3e38, 1.0, -0.0, 1e-45], F32)
    cases["q_large"] = ("quantize", g, np.array([1e30, 0, 0, 0, 0, 3e38, -1, 0, 0], F32), 1e29)
    cases["q_tiny_t"] = ("quantize", (rng.randn(77) * 1e-38).astype(F32), np.zeros(77, F32),
                         1e-40)
    every_half = np.arange(65536, dtype=np.uint16).view(np.float16).copy()  # incl. NaN, Inf
    cases["q_every_half"] = ("quantize", every_half, (rng.randn(65536) * 0.1).astype(F32), 0.05)
    cases["q_all_nan"] = ("quantize", np.full(19, np.nan, F32), np.ones(19, F32), 0.5)
    cases["q_lane_overflow"] = ("quantize", np.full(48, 3e38, F32), np.zeros(48, F32), 1.0)
    for n in [1, 17, 33, 1000, 4099]:
        codes = rng.randint(-2 ** 31, 2 ** 31 - 1, size=-(-n // 16), dtype=np.int64)
        cases["d_%d" % n] = ("dequantize", codes.astype(np.int32), rng.randn(n).astype(F32), 0.25)
    for shape, k in [((5, 3, 3, 3), 2), ((1, 1, 1, 1), 1), ((7, 1), 3), ((64, 33), 10),
                     ((10, 4, 1, 1), 4), ((300, 17), 30), ((9, 2304), 0), ((6, 2, 3), 2)]:
        for dtype in (np.float32, np.float16):
            g = rng.randn(*shape).astype(dtype)
            r = (rng.randn(*shape) * 0.3).astype(F32)
            if g.size >= 17:
                flat = g.reshape(-1)
                flat[rng.randint(0, flat.size, 2)] = [np.nan, -np.inf]
            cases["s_%s_%s" % ("x".join(map(str, shape)), np.dtype(dtype).name)] = (
                "select", g, r, k)
    for n in [1, 17, 33, 1025, 4099]:
        for dtype in (np.float32, np.float16):
            g = _with_edges((rng.randn(n) * 3).astype(dtype), n)
            u = _with_edges(rng.randn(n).astype(F32), n + 1)
            cases["m_%d_%s" % (n, np.dtype(dtype).name)] = ("momentum", g, u, 0.9)
    for shape in [(1, 1), (17,), (5, 4, 3, 3), (9, 1000), (3, 2503)]:
        for dtype in (np.float32, np.float16):
            # rows of every scale, so some are cut and some are not
            r = (rng.randn(*shape) * 10.0 ** rng.randint(-2, 2, shape[:1] + (1,) * (
                len(shape) - 1))).astype(F32)
            g = rng.randn(*shape).astype(dtype)
            if len(shape) > 1 and shape[0] >= 5:
                g[1] = 0                                        # zero input: emptied
                r.reshape(shape[0], -1)[2, 3] = np.nan          # NaN row: untouched
                g.reshape(shape[0], -1)[3, 5] = np.inf          # infinite input: untouched
            cases["b_%s_%s" % ("x".join(map(str, shape)), np.dtype(dtype).name)] = (
                "bound", g, r, 0.7)
    for workers in [1, 2, 4, 16, 127]:
        n = 16 * sums.digits_per_group(workers) * 64 + int(rng.randint(1, 40))
        words = rng.randint(-2 ** 31, 2 ** 31, size=(workers, -(-n // 16)), dtype=np.int64)
        cases["sum_%d" % workers] = ("sums", words.astype(np.int32), np.zeros(n, F32), 0.3)
    return cases


def worker_value(p, w):
    """The value worker w's 2-bit codes were sent with, in the gathered-pull cases: a
    different float32 per worker, so that the order of the adds shows in the bits."""
    return F32(p * (1.0 + w / 3.0))


def gather_slots(carriers, p):
    """Workers' slots of a 'gather' pull (wire.push_slot): each worker's value, then
    its carried code bytes."""
    values = np.array([worker_value(p, w) for w in range(len(carriers))], F32)
    return np.concatenate([values[:, None], carriers], axis=1)


def gathered_blobs(words, p):
    """An allgather's bytes holding each worker's code words (rows of ``words``) after
    a header of 4-12 bytes, as blobs do: (data, offsets, values)."""
    parts, offsets, at = [], [], 0
    for w, row in enumerate(words):
        header = np.full(4 + 4 * (w % 3), 0xAB, np.uint8)
        parts += [header, row.view(np.uint8)]
        offsets.append(at + len(header))
        at += len(header) + row.nbytes
    values = [worker_value(p, w) for w in range(len(words))]
    return np.concatenate(parts), offsets, values


def isa_child(path):
    """Run every isa_inputs() case through this process's build; save the outputs."""
    out = {"build_info": np.array(repr(build.build_info()))}
    assert ops.backend() == "cpp"
    for name, (op, x, y, p) in isa_inputs().items():
        if op == "quantize":
            res = nd(y)
            codes, stats = ops.quantize_2bit(nd(x), res, p)
            out[name + "/codes"] = codes.asnumpy()
            out[name + "/residual"] = res.asnumpy()
            out[name + "/stats"] = stats.asnumpy()
            out[name + "/l1_stats"] = ops.l1_stats(nd(x), nd(y)).asnumpy()
            # the store's chain: two deferred steps (the second pays the first's debt,
            # or the first is settled by its codes if it saw a non-finite a)
            res = nd(y)
            c1, s1 = ops.quantize_2bit(nd(x), res, p, defer=True)
            out[name + "/deferred_residual"] = res.asnumpy()
            (_, _), (c2, s2) = deferred_chain(ops, [x, x], y, [p, p])[0]
            out[name + "/chain_codes"] = c2
            out[name + "/chain_stats"] = s2
            out[name + "/chain_residual"] = deferred_chain(ops, [x, x], y, [p, p])[1]
        elif op == "dequantize":
            n = y.size
            out[name + "/decoded"] = ops.dequantize_2bit(nd(x), p, (n,)).asnumpy()
            acc = nd(y)
            ops.dequantize_2bit(nd(x), p * 3, (n,), out=acc, accumulate=True)
            out[name + "/accumulated"] = acc.asnumpy()
        elif op == "sums":
            packed = ops.sum_2bit(nd(x), y.size)
            out[name + "/packed"] = packed.asnumpy()
            out[name + "/decoded"] = ops.decode_sums(packed, nd(np.array([p], F32)), (y.size,),
                                                     len(x)).asnumpy()
            slots = np.stack([sums.pack_bytes(row.view(np.uint8)) for row in x])
            out[name + "/carried"] = ops.sum_carried_2bit(slots, 0, y.size)[0]
            out[name + "/gathered"] = ops.decode_carried_2bit(gather_slots(slots, p), 1,
                                                              y.size)[0]
            out[name + "/gathered_words"] = ops.decode_gathered_2bit(*gathered_blobs(x, p),
                                                                     y.size)
            out[name + "/uncarried"] = ops.unpack_bytes(nd(slots), 4 * x.shape[1])[0].asnumpy()
            out[name + "/summed_pull"] = ops.decode_carried_sums(
                sums.pack_bytes(packed.asnumpy()), p, y.size, len(x))[0]
            out[name + "/slot"] = ops.pack_bytes(x[-1].view(np.uint8))
        elif op == "bound":
            res = nd(y)
            out[name + "/cut"] = ops.bound_rows(res, nd(x), p).asnumpy()
            out[name + "/residual"] = res.asnumpy()
            res = nd(y)
            codes, stats, vel = ops.encode_2bit(nd(x), res, 0.5, velocity=nd(y * 0.5),
                                                momentum=0.9, bound=p)
            out[name + "/encode_codes"] = codes.asnumpy()
            out[name + "/encode_stats"] = stats.asnumpy()
            out[name + "/encode_residual"] = res.asnumpy()
            out[name + "/encode_velocity"] = canon(vel.asnumpy())
        elif op == "momentum":
            out[name + "/velocity"] = canon(ops.momentum_velocity(nd(x), nd(y), p).asnumpy())
            agg, prev = nd(y), nd(x.astype(F32))
            ops.momentum_correct(agg, prev, p / 3.0)
            out[name + "/corrected"] = canon(agg.asnumpy())
            out[name + "/previous"] = canon(prev.asnumpy())
        else:
            res = nd(y)
            idx, val, stats = ops.select_kernels(nd(x), res, p)
            out[name + "/indices"] = idx.asnumpy()
            out[name + "/values"] = val.asnumpy()
            out[name + "/residual"] = res.asnumpy()
            out[name + "/stats"] = stats.asnumpy()
            out[name + "/scattered"] = ops.scatter_kernels(idx, val, x.shape).asnumpy()
            acc = nd(y)
            ops.scatter_kernels(idx, val, x.shape, out=acc, accumulate=True)
            out[name + "/accumulated"] = acc.asnumpy()
    np.savez(path, **out)


ISA_LEVELS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module")
def isa_outputs(tmp_path_factory):
    """isa -> outputs of isa_child (dict), or the reason the level cannot run here.

    One subprocess per level, started together (the first run compiles each level,
    about 10 s; later runs find the libraries cached). On a CPU without AVX-512 the
    native build is the AVX2 level, so x86-64-v3 is not built a second time."""
    if FORCED_REFERENCE:
        pytest.skip("MXHYLO_OPS=reference")
    tmp = tmp_path_factory.mktemp("isa")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    procs, results = {}, {}
    for isa in ISA_LEVELS:
        missing = build.missing_features(isa)
        if missing:
            results[isa] = "the %s build needs CPU features this CPU lacks: %s" % (
                isa, ", ".join(missing))
            continue
        if isa == "x86-64-v3" and build.missing_features("x86-64-v4"):
            # no AVX-512 here: the native build already is the AVX2 path (the same
            # kernels), compared with the SSE2 baseline below; a second AVX2 build
            # would cost the run about 25 CPU-seconds of compiling for nothing new
            results[isa] = ("this CPU has AVX2 and no AVX-512: its native build is the "
                            "x86-64-v3 level")
            continue
        env = {k: v for k, v in os.environ.items() if k != "MXHYLO_OPS"}
        env.update(MXHYLO_ISA=isa, MXHYLO_OPS="cpp")
        path = str(tmp / ("%s.npz" % isa))
        procs[isa] = (path, subprocess.Popen(
            [sys.executable, "-c", ISA_CHILD % (tests_dir, path)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for isa, (path, proc) in procs.items():
        log = proc.communicate(timeout=600)[0].decode(errors="replace")
        assert proc.returncode == 0, "%s build: %s" % (isa, log[-3000:])
        with np.load(path) as f:
            results[isa] = {k: f[k] for k in f.files}
    return results


def _level(isa_outputs, isa):
    got = isa_outputs[isa]
    if isinstance(got, str):
        pytest.skip(got)
    return got


def test_native_build_matches_numpy(isa_outputs):
    """The subprocess harness itself checked against the oracle (so an agreement
    between builds cannot be an agreement on nothing). The native build runs the
    widest path this CPU has (what lets isa_outputs skip a second AVX2 build)."""
    out = _level(isa_outputs, "native")
    info = eval(str(out["build_info"]))  # noqa: S307 (our own repr of a dict)
    if build.is_x86_64() and build.cpu_flags():
        assert info["avx2"] == (not build.missing_features("x86-64-v3")), info
        assert info["avx512f"] == (not build.missing_features("x86-64-v4")), info
    checked = 0
    for name, (op, x, y, p) in isa_inputs().items():
        if op == "quantize":
            v = np_value_ordered(x, y, p)
            assert bits(out[name + "/stats"][2]) == bits(v), name
            codes, r_new, stats = np_quantize(x, y, p, v)
            np.testing.assert_array_equal(out[name + "/codes"], codes, err_msg=name)
            np.testing.assert_array_equal(bits(out[name + "/residual"]), bits(r_new),
                                          err_msg=name)
            assert bits(out[name + "/stats"][0]) == bits(np_l1_ordered(x, y)), name
            assert bits(out[name + "/l1_stats"][0]) == bits(np_l1_ordered(x, y)), name
            assert out[name + "/stats"][1] == stats[1], name
            with np.errstate(invalid="ignore", over="ignore"):
                a = x.astype(F32) + y
            np.testing.assert_array_equal(bits(out[name + "/deferred_residual"]),
                                          bits(np.where(np.isfinite(a), a, y)), err_msg=name)
            v2 = np_value_ordered(x, r_new, p)    # the eager chain's second step
            codes2, r2, _ = np_quantize(x, r_new, p, v2)
            np.testing.assert_array_equal(out[name + "/chain_codes"], codes2, err_msg=name)
            assert bits(out[name + "/chain_stats"][2]) == bits(v2), name
            np.testing.assert_array_equal(bits(out[name + "/chain_residual"]), bits(r2),
                                          err_msg=name)
        elif op == "dequantize":
            np.testing.assert_array_equal(bits(out[name + "/decoded"]),
                                          bits(np_dequantize(x, p, (y.size,))), err_msg=name)
        elif op == "sums":
            want = sums.pack_sums(sums.sum_codes(list(x), y.size), len(x))
            np.testing.assert_array_equal(out[name + "/packed"], want, err_msg=name)
            decoded = sums.unpack_sums(want, y.size, len(x)).astype(F32) * F32(p)
            np.testing.assert_array_equal(bits(out[name + "/decoded"]), bits(decoded),
                                          err_msg=name)
            np.testing.assert_array_equal(bits(out[name + "/carried"]),
                                          bits(sums.pack_bytes(want)), err_msg=name)
            np.testing.assert_array_equal(out[name + "/uncarried"], x.view(np.uint8),
                                          err_msg=name)
            gathered = np.zeros(y.size, F32)        # each worker's decode added in order
            for w, words in enumerate(x):
                gathered += sums.unpack_codes(words, y.size).astype(F32) * worker_value(p, w)
            np.testing.assert_array_equal(bits(out[name + "/gathered"]), bits(gathered),
                                          err_msg=name)
            np.testing.assert_array_equal(bits(out[name + "/gathered_words"]), bits(gathered),
                                          err_msg=name)
            np.testing.assert_array_equal(bits(out[name + "/slot"]),
                                          bits(sums.pack_bytes(x[-1].view(np.uint8))),
                                          err_msg=name)
        elif op == "bound":
            want = mx.nd.array(y)
            cut = ops.reference.bound_rows(want, mx.nd.array(x, dtype=x.dtype), p)
            np.testing.assert_array_equal(bits(out[name + "/residual"]), bits(want.asnumpy()),
                                          err_msg=name)
            assert out[name + "/cut"][0] == cut.asscalar(), name
        elif op == "momentum":
            np.testing.assert_array_equal(out[name + "/velocity"],
                                          canon(np_velocity(x, y, p)), err_msg=name)
            want_a, want_p = np_correct(y, x.astype(F32), p / 3.0)
            np.testing.assert_array_equal(out[name + "/corrected"], canon(want_a), err_msg=name)
            np.testing.assert_array_equal(out[name + "/previous"], canon(want_p), err_msg=name)
        else:
            idx, val, r_new, stats = np_select(x, y, p)
            np.testing.assert_array_equal(out[name + "/indices"][:p], idx, err_msg=name)
            np.testing.assert_array_equal(bits(out[name + "/residual"]), bits(r_new),
                                          err_msg=name)
        checked += 1
    assert checked == len(isa_inputs()) > 40


@pytest.mark.parametrize("isa", ["x86-64-v3", "x86-64"])
def test_isa_builds_agree_bitwise(isa_outputs, isa):
    """Every output of the level's build is bitwise the native build's."""
    native = _level(isa_outputs, "native")
    other = _level(isa_outputs, isa)
    info = eval(str(other.pop("build_info")))  # noqa: S307 (our own repr of a dict)
    native = dict(native)
    native.pop("build_info")
    assert info["isa"] == isa and not info["openmp"]
    assert info["avx2"] == (isa == "x86-64-v3") and not info["avx512f"]
    assert sorted(other) == sorted(native)
    differ = [k for k in native if native[k].tobytes() != other[k].tobytes()
              or native[k].dtype != other[k].dtype or native[k].shape != other[k].shape]
    assert not differ, "%s differs from native in %s" % (isa, differ[:10])


def test_avx2_build_has_no_avx512(isa_outputs):
    """On an AVX-512 machine the x86-64-v3 library must really be the AVX2 path."""
    import shutil
    _level(isa_outputs, "x86-64-v3")  # built and run above (or skipped with the reason)
    if not shutil.which("objdump"):
        pytest.skip("objdump is not installed")
    path = build.build("x86-64-v3")
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], stdout=subprocess.PIPE,
                         check=True).stdout.decode()
    assert "%ymm" in asm  # AVX2 code is there ...
    assert "%zmm" not in asm and "%k1" not in asm  # ... and no AVX-512 register


# default run: every ISA level's build in its own process, bitwise the native one's
# (test_isa_builds_agree_bitwise), the CPU's features and a level it lacks refused by
# name (test_isa_levels_and_missing_features, test_level_the_cpu_lacks_is_refused_...)
@pytest.mark.slow
def test_bench_ops_smoke(tmp_path):
    """python -m mxhylo.bench ops, tiny: two ISA levels in their own processes, the
    CPU's features, identical outputs, a plot (speed itself is never asserted)."""
    if FORCED_REFERENCE:
        pytest.skip("MXHYLO_OPS=reference")
    report_path = tmp_path / "ops.json"
    env = {k: v for k, v in os.environ.items() if k != "MXHYLO_OPS"}
    proc = subprocess.run([sys.executable, "-m", "mxhylo.bench", "ops", "--size", "40000",
                           "--filter", "100", "--rounds", "1", "--repeats", "1",
                           "--ref-repeats", "1", "--isa", "native,x86-64-v3,sse9"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode != 0 and b"unknown ISA level 'sse9'" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "mxhylo.bench", "ops", "--size", "40000",
                           "--filter", "100", "--rounds", "1", "--repeats", "1",
                           "--ref-repeats", "1", "--isa", "native,x86-64-v3",
                           "--json", str(report_path)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    import json
    report = json.loads(report_path.read_text())
    machine = report["machine"]
    assert machine["cpu"] and "avx2" in machine["cpu_features"]
    missing = build.missing_features("x86-64-v3")
    want = "measured" if not missing else "skipped: this CPU lacks " + ", ".join(missing)
    assert report["isa_status"] == {"native": "measured", "x86-64-v3": want}
    assert report["outputs_identical"] is True
    quant = report["results"]["quantize_2bit"]
    assert set(quant) == {isa for isa, s in report["isa_status"].items() if s == "measured"}
    assert quant["native"]["over_memcpy"]["median"] > 0 and quant["native"]["over_reference"]
    assert report["build_info"]["native"]["openmp"] is False
    assert (tmp_path / "ops.png").is_file()
