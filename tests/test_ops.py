"""mxhylo.ops: C++ operators == NDArray reference == an independent numpy oracle.

The numpy functions below restate the contract from scratch (they do not call
the library). Every operator test runs twice, once through mxhylo.ops (the C++
path on CPU) and once through mxhylo.ops.reference. Bitwise equality where the
math is the same float32 operations (codes, indices, residuals, values);
statistics are sums in different orders (rtol 1e-5).
"""
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest

import mxhylo.ops as ops
from mxhylo.ops import build, reference

F32 = np.float32
FORCED_REFERENCE = os.environ.get("MXHYLO_OPS", "").lower() == "reference"


# --------------------------------------------------------------- numpy oracle
def np_quantize(g, r, t):
    """-> (codes int32 (ceil(n/16),), new residual, stats float64 (2,))."""
    t = F32(t)
    with np.errstate(invalid="ignore", over="ignore"):
        a = g.astype(F32) + r
        fin = np.isfinite(a)
        pos = fin & (a >= t)
        neg = fin & (a <= -t)
        q = np.where(pos, t, np.where(neg, -t, F32(0))).astype(F32)
        r_new = np.where(fin, a - q, r).astype(F32)
    code = (pos * 1 + neg * 2).astype(np.uint32).ravel()
    words = -(-code.size // 16)
    code = np.concatenate([code, np.zeros(words * 16 - code.size, np.uint32)]).reshape(words, 16)
    packed = np.bitwise_or.reduce(code << (2 * np.arange(16, dtype=np.uint32)), axis=1)
    stats = np.array([np.abs(a[fin]).astype(np.float64).sum(), (~fin).sum()])
    return packed.astype(np.uint32).view(np.int32), r_new, stats


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
    """Like impl, plus the C++ library with its AVX-512 kernels switched off."""
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
    want_codes, want_r, want_stats = np_quantize(g, r, t)
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, t)
    assert codes.dtype == np.int32 and codes.shape == want_codes.shape
    assert stats.dtype == np.float32 and stats.shape == (2,)
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
    np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


def test_quantize_zeros_and_threshold_rounding(quant_impl):
    g = np.zeros(40, F32)
    res = nd(np.zeros(40, F32))
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 1.0)
    assert not codes.asnumpy().any() and not res.asnumpy().any()
    np.testing.assert_array_equal(stats.asnumpy(), [0, 0])
    # 0.1 is not a float32: both sides must use float32(0.1)
    g = np.full(3, F32(0.1), F32)
    res = nd(np.zeros(3, F32))
    codes, _ = quant_impl.quantize_2bit(nd(g), res, 0.1)
    np.testing.assert_array_equal(codes.asnumpy(), np_quantize(g, np.zeros(3, F32), 0.1)[0])
    assert not res.asnumpy().any()  # exactly +t sent, nothing left


def test_quantize_nonfinite(quant_impl):
    n = 50
    g, r = data((n,), seed=3)
    g[[0, 15, 16, 49]] = [np.nan, np.inf, -np.inf, np.nan]
    g[20], r[20] = F32(3e38), F32(3e38)  # finite inputs, a overflows to +inf
    want_codes, want_r, want_stats = np_quantize(g, r, 0.5)
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 0.5)
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    got_r = res.asnumpy()
    np.testing.assert_array_equal(bits(got_r), bits(want_r))
    bad = [0, 15, 16, 20, 49]
    np.testing.assert_array_equal(bits(got_r[bad]), bits(r[bad]))  # residual untouched
    decoded = np_dequantize(codes.asnumpy(), 0.5, (n,))
    assert not decoded[bad].any()  # code 0
    assert stats.asnumpy()[1] == 5
    np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


def test_quantize_large_values(quant_impl):
    g = np.array([1e30, -1e30, 1e-30, 1.5e38, -1.5e38, 1.0], F32)  # sum |a| < float32 max
    r = np.array([1e30, 0, 0, 0, 0, -1.0], F32)
    want_codes, want_r, want_stats = np_quantize(g, r, 1e29)
    res = nd(r)
    codes, stats = quant_impl.quantize_2bit(nd(g), res, 1e29)
    np.testing.assert_array_equal(codes.asnumpy(), want_codes)
    np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
    np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)


def test_quantize_roundtrip(quant_impl):
    shape = (37, 29)
    g, r = data(shape, seed=11)
    t = F32(0.6)
    a = g + r
    res = nd(r)
    codes, _ = quant_impl.quantize_2bit(nd(g), res, t)
    decoded = quant_impl.dequantize_2bit(codes, t, shape).asnumpy()
    new_r = res.asnumpy()
    # the residual is exactly what was not sent, in float32 arithmetic ...
    np.testing.assert_array_equal(bits(new_r), bits(a - decoded))
    # ... and sent + kept == a exactly where Sterbenz makes a - q exact (|a| <= 2t)
    small = np.abs(a) <= 2 * t
    assert small.sum() > 100
    np.testing.assert_array_equal((decoded + new_r)[small], a[small])
    np.testing.assert_array_max_ulp(decoded + new_r, a, maxulp=1)


def test_l1_stats(quant_impl):
    g, r = data((5, 3, 3, 3), seed=5, dtype=np.float16)
    g[0, 0, 0, 0] = np.nan
    gnd, rnd = nd(g), nd(r)
    stats = quant_impl.l1_stats(gnd, rnd)
    np.testing.assert_allclose(stats.asnumpy(), np_quantize(g, r, 1.0)[2], rtol=1e-5)
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
        codes, _, _ = np_quantize(g, r, t)
        want += np_dequantize(codes, t, shape)  # float32 adds in the same order
        assert impl.dequantize_2bit(nd(codes), t, shape, out=out, accumulate=True) is out
    np.testing.assert_array_equal(bits(out.asnumpy()), bits(want))


# ------------------------------------------------------------ select_kernels
SELECT_CASES = [((5, 3, 3, 3), [0, 1, 2, 5]), ((1, 1, 1, 1), [0, 1]), ((7, 1), [0, 3, 7]),
                ((7,), [2]), ((64, 33), [1, 10, 64]), ((10, 4, 1, 1), [4])]


@pytest.mark.parametrize("shape,ks", SELECT_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_select_matches_numpy(impl, shape, ks, dtype):
    for k in ks:
        g, r = data(shape, seed=k + shape[0], dtype=dtype)
        want_idx, want_val, want_r, want_stats = np_select(g, r, k)
        res = nd(r)
        idx, val, stats = impl.select_kernels(nd(g), res, k)
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


def test_select_nonfinite(impl):
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
def test_multithreaded_kernels_match_numpy(simd):
    """Arrays large enough for the C++ kernels to split work over threads."""
    if FORCED_REFERENCE:
        pytest.skip("MXHYLO_OPS=reference")
    assert ops.backend() == "cpp"
    build.set_simd(simd)
    shape = (600, 8, 8, 8)  # 307200 elements: several 64K-element blocks
    g, r = data(shape, seed=42, scale=0.01)
    g[1, 0, 0, 0] = np.nan
    g[590, 7, 7, 7] = np.inf  # in the second thread's range
    ops.set_num_threads(2)
    try:
        res = nd(r)
        codes, stats = ops.quantize_2bit(nd(g), res, 0.004)
        want_codes, want_r, want_stats = np_quantize(g, r, 0.004)
        np.testing.assert_array_equal(codes.asnumpy(), want_codes)
        np.testing.assert_array_equal(bits(res.asnumpy()), bits(want_r))
        np.testing.assert_allclose(stats.asnumpy(), want_stats, rtol=1e-5)
        out = nd(np.ones(shape, F32))
        ops.dequantize_2bit(codes, 0.004, shape, out=out, accumulate=True)
        np.testing.assert_array_equal(out.asnumpy(), 1 + np_dequantize(want_codes, 0.004, shape))

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
        ops.set_num_threads(0)
        build.set_simd(True)
