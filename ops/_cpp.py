"""Thin calls into the C++ operators (mx.nd.hylo_*), arguments already validated.

The library must be loaded (build.load()) before these are called. Zero-size
results (k = 0) are made here: MXNet 1.x shape inference treats a 0 dimension
as "unknown", so an operator cannot return a (0,) array; the C++ op returns
one dummy row that is dropped.
"""
import mxnet as mx
import numpy as np

from . import _checks


def quantize_2bit(grad, residual, threshold_text, value_text, pending_texts, defer):
    """pending_texts: None or the (threshold, value) attribute texts."""
    attrs = {"threshold": threshold_text, "defer": "1" if defer else "0"}
    if value_text is not None:
        attrs["value"] = value_text
    if pending_texts is not None:
        attrs["pending_threshold"], attrs["pending_value"] = pending_texts
    codes, stats = mx.nd.hylo_quantize_2bit(grad, residual, **attrs)
    return codes, stats


def encode_2bit(grad, residual, threshold_text, value_text, velocity, momentum_text,
                velocity_out, bound_text):
    attrs = {"threshold": threshold_text}
    if value_text is not None:
        attrs["value"] = value_text
    if bound_text is not None:
        attrs["bound"] = bound_text
    if velocity is None:
        codes, stats = mx.nd.hylo_encode_2bit(grad, residual, **attrs)
        return codes, stats, None
    attrs["momentum"] = momentum_text
    if velocity_out is None:
        codes, stats, u = mx.nd.hylo_encode_2bit(grad, residual, velocity, **attrs)
        return codes, stats, u
    codes = mx.nd.empty(((grad.size + 15) // 16,), ctx=grad.context, dtype=np.int32)
    stats = mx.nd.empty((4,), ctx=grad.context, dtype=np.float32)
    mx.nd.hylo_encode_2bit(grad, residual, velocity, out=[codes, stats, velocity_out],
                           **attrs)
    return codes, stats, velocity_out


def split_sections(x, offsets, outs):
    mx.nd.hylo_split_sections(x, offsets=str(offsets), out=list(outs))
    return outs


def settle_2bit(codes, value_text, residual):
    # in place: MXNet hands `residual` to the op as input and output
    return mx.nd.hylo_settle_2bit(codes, residual, value=value_text, out=residual)


def l1_stats(grad, residual):
    return mx.nd.hylo_l1_stats(grad, residual)


def dequantize_2bit(codes, value_text, shape, out, accumulate):
    if out is not None and accumulate:
        # in place: MXNet hands `out` to the op as input and output
        return mx.nd.hylo_dequantize_2bit_add(codes, out, value=value_text, out=out)
    return mx.nd.hylo_dequantize_2bit(codes, value=value_text,
                                      shape=_checks.shape_text(shape), out=out)


def select_kernels(grad, residual, k):
    indices, values, stats = mx.nd.hylo_select_kernels(grad, residual, k=str(k))
    if k == 0:
        width = values.shape[1]
        indices = mx.nd.empty((0,), ctx=grad.context, dtype=np.int32)
        values = mx.nd.empty((0, width), ctx=grad.context, dtype=np.float32)
    return indices, values, stats


def scatter_kernels(indices, values, shape, out, accumulate):
    if indices.shape[0] == 0:  # see module docstring
        if out is None:
            return mx.nd.zeros(shape, ctx=values.context)
        if not accumulate:
            out[:] = 0
        return out
    if out is not None and accumulate:
        return mx.nd.hylo_scatter_kernels_add(indices, values, out, out=out)
    return mx.nd.hylo_scatter_kernels(indices, values, shape=_checks.shape_text(shape), out=out)


def momentum_velocity(grad, velocity, momentum_text, out):
    return mx.nd.hylo_momentum_velocity(grad, velocity, momentum=momentum_text, out=out)


def momentum_correct(aggregate, previous, factor_text):
    # in place: MXNet hands `aggregate` to the op as input and output
    return mx.nd.hylo_momentum_correct(aggregate, previous, factor=factor_text, out=aggregate)


def bound_rows(residual, grad, bound_text):
    # in place: MXNet hands `residual` to the op as a mutated input
    return mx.nd.hylo_bound_rows(residual, grad, bound=bound_text)


def sum_2bit(codes, size):
    return mx.nd.hylo_sum_2bit(codes, size=str(size))


def decode_sums(packed, scale, shape, num_workers, out):
    return mx.nd.hylo_decode_sums(packed, scale, shape=_checks.shape_text(shape),
                                  workers=str(num_workers), out=out)


def unpack_bytes(values, nbytes):
    data, bad = mx.nd.hylo_unpack_bytes(values, nbytes=str(nbytes))
    return data, bad
