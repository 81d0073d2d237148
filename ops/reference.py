"""NDArray reference implementation of the compression operators.

The oracle for the C++ library and its fallback (non-CPU contexts, a failed
build, or MXHYLO_OPS=reference). Composed of mx.nd operations only, so it
runs wherever MXNet does; about 10-40x slower than the C++ path on CPU.
Same signatures and semantics as mxhylo.ops (see its docstrings); these
functions validate their arguments too, so they can be called directly.

Exactness: a = float32(grad) + residual and residual <- a - q are the same
float32 operations as in C++, so residuals, codes, indices and values are
bit-identical; the statistics are sums in a different order (rtol ~1e-6).
Row norms are summed in float64, so tie breaking only differs from C++ for
two rows whose float64 norms differ by a rounding error; equal rows tie in
both.
"""
import numpy as np
import mxnet as mx

from . import _checks, formats

_TWO32 = float(2 ** 32)
_TWO31 = float(2 ** 31)


def _fold(grad, residual):
    """a = float32(grad) + residual, and the finite mask of a (float32 1/0)."""
    a = grad.astype(np.float32, copy=False) + residual
    return a, mx.nd.contrib.isfinite(a)


def _stats(absum, finite):
    """float32 (2,): [absum, count of non-finite]."""
    bad = finite.size - mx.nd.sum(finite)
    return mx.nd.concat(absum.reshape((1,)).astype(np.float32), bad.reshape((1,)), dim=0)


def _l1(a, finite):
    return mx.nd.sum(mx.nd.where(finite, mx.nd.abs(a), mx.nd.zeros_like(a)))


def _pack_codes(code, n):
    """float32 codes in {0,1,2} (n,) -> int32 words, 16 codes per word, LSB first.

    Each word is built as two 16-bit halves, sums that float32 holds exactly,
    so the per-element passes stay float32; only the per-word combine runs in
    float64 (exact below 2^53).
    """
    words = _checks.num_words(n)
    c = code.reshape((-1,))
    if words * 16 > n:
        c = mx.nd.concat(c, mx.nd.zeros((words * 16 - n,), ctx=c.context), dim=0)
    halves = mx.nd.sum(mx.nd.broadcast_mul(c.reshape((words, 2, 8)), _weights(c.context)),
                       axis=2).astype(np.float64)
    lo = mx.nd.slice_axis(halves, axis=1, begin=0, end=1)
    hi = mx.nd.slice_axis(halves, axis=1, begin=1, end=2)
    value = (lo + hi * 65536.0).reshape((words,))
    return (value - (value >= _TWO31) * _TWO32).astype(np.int32)  # same bits as uint32


def _unpack_codes(codes, n):
    """int32 words -> float32 (n,) of {0, +1, -1} (code 3 -> 0)."""
    words = codes.shape[0]
    v = codes.astype(np.float64)
    v = v + (v < 0) * _TWO32  # the uint32 bit pattern, exact in float64
    hi = mx.nd.floor(v / 65536.0)
    halves = mx.nd.stack(v - hi * 65536.0, hi, axis=1).astype(np.float32)  # (words, 2), exact
    c = mx.nd.floor(mx.nd.broadcast_div(halves.reshape((words, 2, 1)), _weights(codes.context))) % 4
    sign = (c == 1) - (c == 2)
    return mx.nd.slice_axis(sign.reshape((-1,)), axis=0, begin=0, end=n)


def _weights(ctx):
    """float32 (1, 1, 8): 4^j, the place value of code j within a 16-bit half."""
    return mx.nd.array((4.0 ** np.arange(8)).reshape((1, 1, 8)), ctx=ctx)


def quantize_2bit(grad, residual, threshold, value=None, pending=None, defer=False):
    """See mxhylo.ops.quantize_2bit."""
    t, _ = _checks.threshold32(threshold, "quantize_2bit")
    v = None if value is None else float(_checks.threshold32(value, "quantize_2bit",
                                                             what="value")[0])
    _checks.grad_residual(grad, residual, "quantize_2bit")
    if pending is not None:
        pending = _checks.pending(pending, "quantize_2bit")[0]
    return _quantize_2bit(grad, residual, float(t), v, pending, bool(defer))


def _quantize_2bit(grad, residual, t, v, pending=None, defer=False):
    if pending is not None:      # owed: +-v by sign where |r| >= the pending threshold
        pt, pv = pending
        owes = mx.nd.abs(residual) >= pt
        residual[:] = residual - owes * ((residual > 0) - (residual < 0)) * pv
    a, finite = _fold(grad, residual)
    pos = (a >= t) * finite
    neg = (a <= -t) * finite
    if v is None:
        v = _mean_sent(a, pos + neg, t)
    if defer:
        residual[:] = mx.nd.where(finite, a, residual)
    else:
        residual[:] = mx.nd.where(finite, a - (pos - neg) * v, residual)  # q: +v, -v, +0
    codes = _pack_codes(pos + 2 * neg, a.size)
    stats = mx.nd.concat(_stats(_l1(a, finite), finite),
                         mx.nd.array([v], ctx=a.context, dtype=np.float32), dim=0)
    return codes, stats


def encode_2bit(grad, residual, threshold, value=None, velocity=None, momentum=None,
                velocity_out=None, bound=None):
    """See mxhylo.ops.encode_2bit."""
    a = _checks.encode_2bit(grad, residual, threshold, value, velocity, momentum,
                            velocity_out, bound)
    return _encode_2bit(grad, residual, a.threshold, a.value, velocity, a.momentum,
                        velocity_out, a.bound)


def _encode_2bit(grad, residual, t, v, velocity, m, velocity_out, bound):
    """mxhylo.ops.encode_2bit as its composition (see there)."""
    u = grad if velocity is None else _momentum_velocity(grad, velocity, m, velocity_out)
    mean = None
    if v is not None:       # stats[2]: the mean sent |a| whatever value settles
        a, finite = _fold(u, residual)
        mean = _mean_sent(a, ((a >= t) + (a <= -t)) * finite, t)
    codes, stats = _quantize_2bit(u, residual, t, v)
    if mean is not None:
        stats[2] = mean
    cut = 0.0
    if bound is not None and not float(stats[1].asscalar()):
        cut = float(_bound_rows(residual, u, bound).asscalar())
    stats = mx.nd.concat(stats, mx.nd.array([cut], ctx=stats.context, dtype=np.float32),
                         dim=0)
    return codes, stats, None if velocity is None else u


def split_sections(x, offsets, outs):
    """See mxhylo.ops.split_sections."""
    return _split_sections(x, _checks.sections(x, offsets, outs, "split_sections"), outs)


def _split_sections(x, offsets, outs):
    ends = list(offsets[1:]) + [x.shape[0]]
    for o, start, end in zip(outs, offsets, ends):
        o[:] = x[start:end]
    return outs


def settle_2bit(codes, value, residual):
    """See mxhylo.ops.settle_2bit."""
    t, _ = _checks.threshold32(value, "settle_2bit", what="value")
    _checks.codes(codes, residual.size, "settle_2bit")
    _checks.ndarray(residual, "residual", (np.float32,), "settle_2bit")
    return _settle_2bit(codes, float(t), residual)


def _settle_2bit(codes, t, residual):
    """residual -= decoded codes (0 as +0: r - (+0) keeps r bit for bit)."""
    residual[:] = residual - (_unpack_codes(codes, residual.size) * t).reshape(residual.shape)
    return residual


def _mean_sent(a, sent, t):
    """float32 v: mean |a| over the sent elements (``sent`` 1/0), t if none, float32
    max if the sum overflows (summed in float64 here, in float32 lanes in C++)."""
    count = float(mx.nd.sum(sent).asscalar())
    if not count:
        return t
    total = float(mx.nd.sum(mx.nd.where(sent > 0, mx.nd.abs(a), mx.nd.zeros_like(a))
                            .astype(np.float64)).asscalar())
    mean = float(np.float32(min(total / count, float(np.finfo(np.float32).max))))
    return mean


def l1_stats(grad, residual):
    """See mxhylo.ops.l1_stats."""
    _checks.grad_residual(grad, residual, "l1_stats")
    return _l1_stats(grad, residual)


def _l1_stats(grad, residual):
    a, finite = _fold(grad, residual)
    return _stats(_l1(a, finite), finite)


def dequantize_2bit(codes, value, shape, out=None, accumulate=False):
    """See mxhylo.ops.dequantize_2bit."""
    t, _ = _checks.threshold32(value, "dequantize_2bit", what="value")
    shape = _checks.shape_tuple(shape, "dequantize_2bit")
    n = int(np.prod(shape))
    _checks.codes(codes, n, "dequantize_2bit")
    _checks.out_array(out, shape, codes.context, "dequantize_2bit")
    return _dequantize_2bit(codes, float(t), shape, out, accumulate)


def _dequantize_2bit(codes, t, shape, out, accumulate):
    n = int(np.prod(shape))
    dense = (_unpack_codes(codes, n) * t).reshape(shape)
    if out is None:
        return dense
    if accumulate:
        out += dense
    else:
        out[:] = dense
    return out


def select_kernels(grad, residual, k):
    """See mxhylo.ops.select_kernels."""
    _checks.grad_residual(grad, residual, "select_kernels")
    k = _checks.k_in_range(k, grad.shape[0], "select_kernels")
    return _select_kernels(grad, residual, k)


def _select_kernels(grad, residual, k):
    rows, width = _checks.rows_and_width(grad.shape)
    ctx = grad.context
    a, finite = _fold(grad.reshape((rows, width)), residual.reshape((rows, width)))
    a0 = mx.nd.where(finite, a, mx.nd.zeros_like(a))
    norm2 = mx.nd.sum(mx.nd.square(a0.astype(np.float64)), axis=1)  # (O,) float64
    stats = _stats(mx.nd.sum(norm2), finite)
    if k == 0:
        residual[:] = mx.nd.where(finite, a, residual.reshape((rows, width))).reshape(grad.shape)
        return (mx.nd.empty((0,), ctx=ctx, dtype=np.int32),
                mx.nd.empty((0, width), ctx=ctx, dtype=np.float32), stats)
    # MXNet's CPU topk is not stable, so ties are broken by hand: rank rows by
    # (class, -index) with class 2 = norm above the k-th largest, 1 = equal to
    # it, 0 = below. The key is unique, so topk's ordering of ties is moot.
    kth = mx.nd.slice_axis(mx.nd.topk(norm2, k=k, ret_typ="value"), axis=0, begin=k - 1, end=k)
    klass = 2 * mx.nd.broadcast_greater(norm2, kth) + mx.nd.broadcast_equal(norm2, kth)
    key = klass * (rows + 1) + (rows - mx.nd.arange(rows, ctx=ctx, dtype=np.float64))
    chosen = mx.nd.topk(key, k=k, ret_typ="indices", dtype=np.float64)
    indices = mx.nd.sort(chosen).astype(np.int32)
    values = mx.nd.take(a0, indices, axis=0)
    picked = mx.nd.scatter_nd(mx.nd.ones((k,), ctx=ctx), indices.reshape((1, k)), shape=(rows,))
    kept = mx.nd.where(picked, mx.nd.zeros_like(a), a)
    residual[:] = mx.nd.where(finite, kept, residual.reshape((rows, width))).reshape(grad.shape)
    return indices, values, stats


def scatter_kernels(indices, values, shape, out=None, accumulate=False):
    """See mxhylo.ops.scatter_kernels."""
    shape = _checks.shape_tuple(shape, "scatter_kernels")
    _checks.kernels(indices, values, shape, "scatter_kernels")
    _checks.out_array(out, shape, indices.context, "scatter_kernels")
    return _scatter_kernels(indices, values, shape, out, accumulate)


def check_indices(indices, rows, op="scatter_kernels"):
    """Indices strictly increasing in [0, rows): what the C++ op checks too."""
    idx = indices.asnumpy()
    if idx.size and (idx[0] < 0 or idx[-1] >= rows or np.any(np.diff(idx) <= 0)):
        raise ValueError("%s: indices must be strictly increasing and in [0, %d), got %s" % (
            op, rows, idx))


def _scatter_kernels(indices, values, shape, out, accumulate):
    rows, width = _checks.rows_and_width(shape)
    ctx = values.context
    k = indices.shape[0]
    check_indices(indices, rows)
    if k == 0:
        if out is None:
            return mx.nd.zeros(shape, ctx=ctx)
        if not accumulate:
            out[:] = 0
        return out
    where = indices.reshape((1, k))
    if out is not None and accumulate:
        out2d = out.reshape((rows, width))  # a view: writes land in out
        summed = mx.nd.take(out2d, indices, axis=0) + values
        mx.nd._internal._scatter_set_nd(lhs=out2d, rhs=summed, indices=where,
                                        shape=(rows, width), out=out2d)
        return out
    dense = mx.nd.scatter_nd(values, where, shape=(rows, width)).reshape(shape)
    if out is None:
        return dense
    out[:] = dense
    return out


def momentum_velocity(grad, velocity, momentum, out=None):
    """See mxhylo.ops.momentum_velocity."""
    m, _ = _checks.finite32(momentum, "momentum", "momentum_velocity")
    _checks.grad_residual(grad, velocity, "momentum_velocity", "velocity")
    _checks.out_array(out, grad.shape, grad.context, "momentum_velocity")
    return _momentum_velocity(grad, velocity, float(m), out)


def _momentum_velocity(grad, velocity, m, out):
    v = velocity * m + grad.astype(np.float32, copy=False)
    if out is None:
        return v
    out[:] = v
    return out


def momentum_correct(aggregate, previous, factor):
    """See mxhylo.ops.momentum_correct."""
    f, _ = _checks.finite32(factor, "factor", "momentum_correct")
    _checks.ndarray(aggregate, "aggregate", (np.float32,), "momentum_correct")
    _checks.ndarray(previous, "previous", (np.float32,), "momentum_correct")
    _checks.same_shape("momentum_correct", ("aggregate", aggregate), ("previous", previous))
    return _momentum_correct(aggregate, previous, float(f))


def _momentum_correct(aggregate, previous, f):
    scaled = previous * f
    previous[:] = aggregate
    aggregate -= scaled
    return aggregate


def bound_rows(residual, grad, bound):
    """See mxhylo.ops.bound_rows."""
    b, _ = _checks.finite32(bound, "bound", "bound_rows")
    _checks.grad_residual(grad, residual, "bound_rows")
    return _bound_rows(residual, grad, float(b))


def _lane_squares(x):
    """Sum of squares of a float32 row in double as the C++ kernel takes it: element j
    in lane j % 8, each lane in order (np.cumsum adds in order), the 8 lanes as a
    fixed tree."""
    v = np.zeros(-(-x.size // 8) * 8, np.float64)
    v[:x.size] = x
    lanes = np.cumsum((v * v).reshape(-1, 8), axis=0)[-1] if v.size else np.zeros(8)
    a = [float(t) for t in lanes]
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def _bound_rows(residual, grad, bound):
    # numpy on the host, the same additions in the same order as the C++ kernel, so
    # the same bits (a reference for any device, not a fast path)
    rows = residual.shape[0] if residual.ndim > 1 else 1
    r = residual.asnumpy().reshape(rows, -1)
    u = grad.asnumpy().astype(np.float32).reshape(rows, -1)
    cut = 0
    for i in range(rows):
        allowed = bound * bound * _lane_squares(u[i])
        sr = _lane_squares(r[i])
        if sr > allowed:
            r[i] *= np.float32(np.sqrt(allowed) / np.sqrt(sr))
            cut += 1
    residual[:] = r.reshape(residual.shape)
    return mx.nd.array([cut], ctx=residual.context, dtype=np.float32)


def sum_2bit(codes, size):
    """See mxhylo.ops.sum_2bit."""
    return _sum_2bit(codes, _checks.sum_codes(codes, size, "sum_2bit"))


def _sum_2bit(codes, size):
    rows = list(codes.asnumpy())
    packed = formats.pack_sums(formats.sum_codes(rows, size), len(rows))
    return mx.nd.array(packed, ctx=codes.context, dtype=np.uint8)


def decode_sums(packed, scale, shape, num_workers, out=None):
    """See mxhylo.ops.decode_sums."""
    shape, w = _checks.decode_sums(packed, scale, shape, num_workers, out)
    return _decode_sums(packed, scale, shape, w, out)


def unpack_bytes(values, nbytes):
    """See mxhylo.ops.unpack_bytes."""
    return _unpack_bytes(values, _checks.unpack_bytes(values, nbytes))


def _decode_sums(packed, scale, shape, num_workers, out):
    n = int(np.prod(shape))
    v = np.float32(scale[0].asscalar())
    d = formats.digits_per_group(num_workers)
    groups = packed.asnumpy().view("<u2")
    written = groups < (2 * num_workers + 1) ** d
    total = formats.unpack_sums(np.where(written, groups, 0).astype("<u2").view(np.uint8),
                                n, num_workers)
    dense = total.astype(np.float32) * v            # one rounding, as in C++
    dense[~np.repeat(written, d)[:n]] = np.nan
    result = mx.nd.array(dense.reshape(shape), ctx=packed.context, dtype=np.float32)
    if out is None:
        return result
    out[:] = result
    return out


def _unpack_bytes(values, nbytes):
    rows = values.asnumpy().reshape(-1, values.shape[-1])[:, :formats.carrier_values(nbytes)]
    exponent = (rows.view(np.uint32) >> 23) & 0xFF
    bad = ((exponent < 1) | (exponent > 64)).sum(axis=1).astype(np.float32)
    data = np.stack([formats.unpack_bytes(r, nbytes, check=False) for r in rows])
    data = data.reshape((nbytes,) if values.ndim == 1 else (len(rows), nbytes))
    return (mx.nd.array(data, ctx=values.context, dtype=np.uint8),
            mx.nd.array(bad, ctx=values.context, dtype=np.float32))
