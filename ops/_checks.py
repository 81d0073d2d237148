"""Argument validation shared by the C++ dispatch and the NDArray reference.

Every check reads only NDArray metadata (dtype, shape, context), never data,
so validation never waits for MXNet's engine. Wrong types/dtypes raise
TypeError, wrong values/shapes ValueError; messages name the argument.
"""
import math
import numbers
import types

import mxnet as mx
import numpy as np

from . import formats

GRAD_DTYPES = (np.float32, np.float16)


def ndarray(x, name, dtypes, op):
    """Require a dense mx.nd.NDArray whose dtype is one of `dtypes`."""
    if not isinstance(x, mx.nd.NDArray):
        raise TypeError("%s: %s must be an mx.nd.NDArray, got %s" % (op, name, type(x).__name__))
    if x.stype != "default":
        raise TypeError("%s: %s must be a dense NDArray, got stype %r" % (op, name, x.stype))
    if x.dtype not in dtypes:
        raise TypeError("%s: %s must have dtype %s, got %s" % (
            op, name, " or ".join(np.dtype(d).name for d in dtypes), np.dtype(x.dtype).name))
    if 0 in x.shape:        # (not x.size: MXNet's is np.prod of the shape, 25 us a call)
        raise ValueError("%s: %s is empty (shape %s)" % (op, name, x.shape))
    return x


def same_context(op, *named):
    """Require all (name, array) pairs on one context."""
    ctx = named[0][1].context
    for name, x in named[1:]:
        if x.context != ctx:
            raise ValueError("%s: %s is on %s but %s is on %s" % (
                op, name, x.context, named[0][0], ctx))


def grad_residual(grad, residual, op, name="residual"):
    """grad float32|float16 and ``name`` (residual) float32 of the same shape and
    context."""
    ndarray(grad, "grad", GRAD_DTYPES, op)
    ndarray(residual, name, (np.float32,), op)
    if grad.shape != residual.shape:
        raise ValueError("%s: grad shape %s and %s shape %s differ" % (
            op, grad.shape, name, residual.shape))
    same_context(op, ("grad", grad), (name, residual))


def threshold32(threshold, op, what="threshold"):
    """Round a positive float (named ``what`` in errors) to float32; return
    (np.float32 t, attribute text that parses back to t)."""
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, numbers.Real):
        raise TypeError("%s: %s must be a real number, got %r" % (op, what, threshold))
    t = np.float32(threshold)
    if not (math.isfinite(float(t)) and t > 0):
        raise ValueError("%s: %s must be finite and > 0 as float32, got %r" % (
            op, what, threshold))
    text = "%.9g" % float(t)  # 9 significant digits identify any float32
    assert np.float32(text) == t
    return t, text


def finite32(value, name, op):
    """Round to float32; return (np.float32 v, attribute text that parses back to v)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError("%s: %s must be a real number, got %r" % (op, name, value))
    v = np.float32(value)
    if not math.isfinite(float(v)):
        raise ValueError("%s: %s must be finite as float32, got %r" % (op, name, value))
    text = "%.9g" % float(v)
    assert np.float32(text) == v
    return v, text


def same_shape(op, *named):
    """Require all (name, array) pairs to have one shape and one context."""
    shape = named[0][1].shape
    for name, x in named[1:]:
        if x.shape != shape:
            raise ValueError("%s: %s has shape %s but %s has shape %s" % (
                op, name, x.shape, named[0][0], shape))
    same_context(op, *named)


def shape_tuple(shape, op):
    """A tuple of positive ints."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError("%s: shape must be a tuple of ints, got %r" % (op, shape)) from None
    if not dims or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool)
                           and d > 0 for d in dims):
        raise ValueError("%s: shape must be a non-empty tuple of positive ints, got %r" % (
            op, shape))
    return tuple(int(d) for d in dims)


def shape_text(shape):
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def num_words(n):
    """int32 words holding n 2-bit codes."""
    return (n + 15) // 16


def positive_int(x, name, op):
    """Require an int >= 1 (bools refused); return it as int."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError("%s: %s must be an int, got %r" % (op, name, x))
    if x < 1:
        raise ValueError("%s: %s must be >= 1, got %d" % (op, name, x))
    return int(x)


def sum_codes(c, size, op):
    """sum_2bit's arguments: int32 codes (W, ceil(size/16)), 1 <= W <= 127; returns
    size as an int."""
    size = positive_int(size, "size", op)
    ndarray(c, "codes", (np.int32,), op)
    if c.ndim != 2 or c.shape[1] != num_words(size) or \
            not 1 <= c.shape[0] <= formats.MAX_WORKERS:
        raise ValueError("%s: codes must have shape (W, %d) for %d elements, 1 <= W <= %d, "
                         "got %s" % (op, num_words(size), size, formats.MAX_WORKERS, c.shape))
    return size


def packed_sums(packed, shape, num_workers, op):
    """decode_sums' packed uint8 sums of prod(shape) elements of num_workers workers;
    returns (shape as a tuple, num_workers as an int)."""
    shape = shape_tuple(shape, op)
    w = positive_int(num_workers, "num_workers", op)
    if w > formats.MAX_WORKERS:
        raise ValueError("%s: num_workers must be at most %d, got %d"
                         % (op, formats.MAX_WORKERS, w))
    ndarray(packed, "packed", (np.uint8,), op)
    want = formats.packed_nbytes(int(np.prod(shape)), w)
    if packed.shape != (want,):
        raise ValueError("%s: packed sums of %d elements of %d workers must have shape "
                         "(%d,), got %s" % (op, int(np.prod(shape)), w, want, packed.shape))
    return shape, w


def decode_sums(packed, scale, shape, num_workers, out, op="decode_sums"):
    """decode_sums' arguments; returns (shape as a tuple, num_workers as an int)."""
    shape, w = packed_sums(packed, shape, num_workers, op)
    ndarray(scale, "scale", (np.float32,), op)
    if scale.ndim != 1:
        raise ValueError("%s: scale must be 1-D, got shape %s" % (op, scale.shape))
    same_context(op, ("packed", packed), ("scale", scale))
    out_array(out, shape, packed.context, op)
    return shape, w


def unpack_bytes(values, nbytes, op="unpack_bytes"):
    """unpack_bytes' arguments; returns nbytes as an int."""
    nbytes = positive_int(nbytes, "nbytes", op)
    ndarray(values, "values", (np.float32,), op)
    need = formats.carrier_values(nbytes)
    if values.ndim not in (1, 2) or values.shape[-1] < need:
        raise ValueError("%s: values must be (m,) or (rows, m) with m >= %d to carry %d "
                         "bytes, got shape %s" % (op, need, nbytes, values.shape))
    return nbytes


def codes(c, n, op):
    ndarray(c, "codes", (np.int32,), op)
    if c.shape != (num_words(n),):
        raise ValueError("%s: codes must have shape (%d,) for %d elements, got %s" % (
            op, num_words(n), n, c.shape))


def pending(p, op):
    """quantize_2bit's ``pending``: a (threshold, value) pair -> ((t, v) as floats rounded
    to float32, (their attribute texts))."""
    if not isinstance(p, (tuple, list)) or len(p) != 2:
        raise TypeError("%s: pending must be the (threshold, value) pair of an earlier call "
                        "with defer=True, got %r" % (op, type(p).__name__))
    t, ttext = threshold32(p[0], op, what="pending threshold")
    v, vtext = threshold32(p[1], op, what="pending value")
    return (float(t), float(v)), (ttext, vtext)


def out_array(out, shape, ctx, op):
    """`out` (if given) must be float32 of `shape` on `ctx`."""
    if out is None:
        return
    ndarray(out, "out", (np.float32,), op)
    if out.shape != shape:
        raise ValueError("%s: out has shape %s, expected %s" % (op, out.shape, shape))
    if out.context != ctx:
        raise ValueError("%s: out is on %s but the input is on %s" % (op, out.context, ctx))


def host_out(out, size, op):
    """A host-side function's output: ``out`` if given (writable contiguous float32
    numpy (size,)), else a new array. ValueError naming ``op`` otherwise."""
    if out is None:
        return np.empty(size, np.float32)
    if out.dtype != np.float32 or out.shape != (size,) or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise ValueError("%s: out must be writable contiguous float32 (%d,), got %s %s"
                         % (op, size, out.dtype, out.shape))
    return out


def rows_and_width(shape):
    """(O, F): the array viewed as O rows (output filters) of F elements."""
    rows = shape[0]
    width = 1
    for d in shape[1:]:
        width *= d
    return rows, width


def k_in_range(k, rows, op):
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral):
        raise TypeError("%s: k must be an int, got %r" % (op, k))
    if not 0 <= k <= rows:
        raise ValueError("%s: k=%d is out of range [0, %d] (O = shape[0])" % (op, k, rows))
    return int(k)


def kernels(indices, values, shape, op):
    """indices int32 (k,), values float32 (k, F) for an array of `shape`."""
    ndarray_or_empty(indices, "indices", (np.int32,), op)
    ndarray_or_empty(values, "values", (np.float32,), op)
    rows, width = rows_and_width(shape)
    if indices.ndim != 1 or values.shape != (indices.shape[0], width):
        raise ValueError("%s: need indices (k,) and values (k, %d) for shape %s, got %s and %s"
                         % (op, width, shape, indices.shape, values.shape))
    if indices.shape[0] > rows:
        raise ValueError("%s: %d indices for %d rows" % (op, indices.shape[0], rows))
    same_context(op, ("indices", indices), ("values", values))


def ndarray_or_empty(x, name, dtypes, op):
    """Like ndarray() but allows zero size (k = 0 payloads)."""
    if not isinstance(x, mx.nd.NDArray):
        raise TypeError("%s: %s must be an mx.nd.NDArray, got %s" % (op, name, type(x).__name__))
    if x.dtype not in dtypes:
        raise TypeError("%s: %s must have dtype %s, got %s" % (
            op, name, " or ".join(np.dtype(d).name for d in dtypes), np.dtype(x.dtype).name))


def encode_2bit(grad, residual, threshold, value, velocity, momentum, velocity_out, bound):
    """Validate encode_2bit's arguments (see mxhylo.ops.encode_2bit) -> its scalars as
    float32-rounded floats (None where not given) and the attribute texts that parse
    back to them, as a SimpleNamespace."""
    op = "encode_2bit"
    t, ttext = threshold32(threshold, op)
    v, vtext = (None, None) if value is None else threshold32(value, op, what="value")
    grad_residual(grad, residual, op)
    m, mtext = None, None
    if (velocity is None) != (momentum is None):
        raise ValueError("%s: velocity and momentum go together" % op)
    if velocity is not None:
        m, mtext = finite32(momentum, "momentum", op)
        grad_residual(grad, velocity, op, "velocity")
        out_array(velocity_out, grad.shape, grad.context, op)
        if velocity_out is not None and velocity_out.handle.value == velocity.handle.value:
            raise ValueError("%s: velocity_out must not be velocity itself (a failed "
                             "encode keeps the old velocity)" % op)
    elif velocity_out is not None:
        raise ValueError("%s: velocity_out without a velocity" % op)
    b, btext = None, None
    if bound is not None:
        b, btext = finite32(bound, "bound", op)
        if b < 0:
            raise ValueError("%s: bound must be >= 0, got %r" % (op, bound))
    f = lambda x: None if x is None else float(x)       # noqa: E731
    return types.SimpleNamespace(threshold=float(t), threshold_text=ttext, value=f(v), value_text=vtext,
                      momentum=f(m), momentum_text=mtext, bound=f(b), bound_text=btext)


def sections(x, offsets, outs, op, outputs=True):
    """split_sections' arguments: x float32 1-D, offsets ascending ints from 0 below
    x's size, one float32 1-D output of each section's size on x's device -> offsets
    as a tuple of ints. outputs=False checks their number only (the C++ path: MXNet's
    shape inference checks them at the call, and on an error there the caller checks
    them here by name)."""
    ndarray(x, "x", (np.float32,), op)
    if len(x.shape) != 1:
        raise ValueError("%s: x must be 1-D, got shape %s" % (op, x.shape))
    offsets = tuple(int(o) for o in offsets)
    n = x.shape[0]
    if (not offsets or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:]))
            or offsets[-1] >= n):
        raise ValueError("%s: offsets must be ascending from 0 and below %d, got %s"
                         % (op, n, offsets))
    if len(outs) != len(offsets):
        raise ValueError("%s: %d offsets but %d outputs" % (op, len(offsets), len(outs)))
    if outputs:
        for i, (o, start) in enumerate(zip(outs, offsets)):
            end = offsets[i + 1] if i + 1 < len(offsets) else n
            out_array(o, (end - start,), x.context, op)
    return offsets
