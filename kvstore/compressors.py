"""Compressors: encode one layer's gradient (with its residual) and decode payloads.

A Compressor knows one codec; it does not know where bytes go (that is the
transport's job) nor which layer gets which codec (the policy's). ``encode`` folds
the residual in and leaves what was not sent in it; ``decode`` writes or adds a
payload into a dense float32 array, so a receiver aggregates any number of payloads
(each worker's own threshold or kernel choice) by decoding with accumulate=True.

make_compressors() builds the registry: the policy's strategy names -> instances.
PullEncoder runs the same codecs on an aggregate, with residuals of its own (the
compressed pull).
"""
from dataclasses import dataclass
from typing import Tuple

import mxnet as mx
import numpy as np

from .. import ops
from .memory import ResidualMemory
from .policy import LayerPlan


@dataclass
class Payload:
    """One worker's encoded gradient of one layer.

    strategy: the codec's name; shape: the dense gradient's shape;
    arrays: the encoded tensors (NDArrays); scalars: small float header values.
    """
    strategy: str
    shape: Tuple[int, ...]
    arrays: Tuple[mx.nd.NDArray, ...]
    scalars: Tuple[float, ...] = ()

    @property
    def nbytes(self):
        """Encoded size in bytes: the arrays as they are plus 4 bytes per header scalar."""
        return sum(a.size * np.dtype(a.dtype).itemsize for a in self.arrays) + 4 * len(self.scalars)


def _raise_non_finite(name, count, size):
    raise FloatingPointError(
        "non-finite gradient in layer %r: %d of %d elements are NaN or Inf. The step is "
        "abandoned and the layer's residual left as it was. With fp16, use "
        "loss scaling (mxhylo.LARSTrainer skips overflowing steps before they are sent)."
        % (name, count, size))


def _abandon(compressor, payload, grad, residual):
    """Undo an encode whose gradient had non-finite elements, then raise.

    The operators have already left residual <- grad + residual - sent for the finite
    elements (non-finite ones keep their residual); adding back what was not sent and
    taking the gradient out again restores the residual to within float32 rounding.
    The check comes after the operator because it is a by-product of the same pass.
    """
    sent = mx.nd.zeros(residual.shape, ctx=residual.context, dtype=np.float32)
    compressor.decode(payload, sent)
    g = grad.astype(np.float32)
    finite = mx.nd.contrib.isfinite(g)
    residual[:] = mx.nd.where(finite, residual + sent - mx.nd.where(finite, g, sent), residual)


class Compressor:
    """Interface of a codec. ``name`` is the strategy name the policy uses."""
    name = None

    def encode(self, plan, grad, memory):
        """Encode NDArray ``grad`` of layer ``plan`` -> Payload; updates ``memory``."""
        raise NotImplementedError

    def decode(self, payload, out, accumulate=False):
        """Write (or with accumulate, add) the decoded payload into float32 NDArray ``out``."""
        raise NotImplementedError

    def zero_sent(self, payload, values, out):
        """``out[:] = values`` with every element the payload sent set to 0 (float32
        NDArrays of the payload's shape; momentum factor masking). Sent: decoded != 0."""
        sent = mx.nd.zeros(values.shape, ctx=values.context, dtype=np.float32)
        self.decode(payload, sent)
        mx.nd.elemwise_mul(values, sent == 0, out=out)


class NoCompression(Compressor):
    """Small layers travel as they are (float32), with no residual."""
    name = "none"

    def encode(self, plan, grad, memory):
        if grad.dtype != np.float32:
            grad = grad.astype(np.float32)
        return Payload(self.name, tuple(grad.shape), (grad,))

    def decode(self, payload, out, accumulate=False):
        (dense,) = payload.arrays
        if accumulate:
            out += dense.reshape(out.shape)
        else:
            out[:] = dense.reshape(out.shape)


class TwoBit(Compressor):
    """Fully connected layers: every element as {-t, 0, +t} in 2 bits, error feedback.

    Threshold: t = threshold_scale * mean(|g + r|). The mean is a by-product of the
    quantization pass (ops.quantize_2bit returns sum |g + r|), so step s quantizes with
    the mean measured at step s-1 and no extra pass over the gradient is needed; the
    very first step measures it with ops.l1_stats. Payload: int32 codes (16 per word)
    and the threshold.
    """
    name = "fc_2bit"

    def __init__(self, threshold_scale=1.0):
        self.threshold_scale = float(threshold_scale)

    def _threshold(self, stats, plan):
        total, bad = (float(v) for v in stats.asnumpy())
        if bad:
            _raise_non_finite(plan.name, int(bad), plan.size)
        return self._scaled(total, plan)

    def _scaled(self, total, plan):
        t = self.threshold_scale * total / max(plan.size, 1)
        # An all-zero layer has mean 0; any positive threshold then sends all zeros.
        return max(t, float(np.finfo(np.float32).tiny))

    def encode(self, plan, grad, memory):
        residual = memory.residual(plan.name, grad)
        t = memory.scalar(plan.name, "threshold")
        if t is None:
            t = self._threshold(ops.l1_stats(grad, residual), plan)
        t = float(np.float32(t))
        codes, stats = ops.quantize_2bit(grad, residual, t)
        payload = Payload(self.name, tuple(grad.shape), (codes,), (t,))
        total, bad = (float(v) for v in stats.asnumpy())
        if bad:
            _abandon(self, payload, grad, residual)
            _raise_non_finite(plan.name, int(bad), plan.size)
        memory.set_scalar(plan.name, "threshold", self._scaled(total, plan))
        return payload

    def decode(self, payload, out, accumulate=False):
        (codes,) = payload.arrays
        ops.dequantize_2bit(codes, payload.scalars[0], payload.shape, out=out,
                            accumulate=accumulate)


class ConvTopK(Compressor):
    """Convolution layers: the k output filters of largest L2 norm of (g + r).

    Payload: int32 filter indices (k,) and their float32 values (k, I*kh*kw); the
    filters not sent stay in the residual.
    """
    name = "conv_topk"

    def encode(self, plan, grad, memory):
        residual = memory.residual(plan.name, grad)
        indices, values, stats = ops.select_kernels(grad, residual, plan.k)
        payload = Payload(self.name, tuple(grad.shape), (indices, values))
        bad = float(stats.asnumpy()[1])
        if bad:
            _abandon(self, payload, grad, residual)
            _raise_non_finite(plan.name, int(bad), plan.size)
        return payload

    def decode(self, payload, out, accumulate=False):
        indices, values = payload.arrays
        ops.scatter_kernels(indices, values, payload.shape, out=out, accumulate=accumulate)

    def zero_sent(self, payload, values, out):
        """Every element of a sent filter counts as sent (one pass, no decode)."""
        indices = payload.arrays[0]
        filters = payload.shape[0]
        if not indices.size:
            out[:] = values
            return
        keep = 1 - mx.nd.one_hot(indices, filters).sum(axis=0)     # (filters,) 0 or 1
        mx.nd.broadcast_mul(values.reshape((filters, -1)), keep.reshape((filters, 1)),
                            out=out.reshape((filters, -1)))


class PullEncoder:
    """Error feedback for an aggregate on its way back (compress_pull 'layer' / '2bit'):
    encodes aggregates with a residual each, on the servers (kvstore.server) or, in one
    process, in the store (kvstore.transport_local).

    The codecs are the workers' own (this module) and so is the residual store
    (kvstore.memory), keyed by the name the caller gives a chunk or layer: residual <-
    aggregate + residual - sent, exactly as a worker does.
    """

    def __init__(self, threshold_scale=1.0):
        self.memory = ResidualMemory()
        self.set_threshold_scale(threshold_scale)

    def set_threshold_scale(self, threshold_scale):
        self.compressors = make_compressors(threshold_scale)

    def encode(self, name, codec, aggregate, k=None):
        """Payload of float32 NDArray ``aggregate`` (plus ``name``'s residual) with
        ``codec`` ('fc_2bit', or 'conv_topk' sending k rows of its first axis)."""
        plan = LayerPlan(name, tuple(aggregate.shape), codec, k=k)
        return self.compressors[codec].encode(plan, aggregate, self.memory)

    def state(self, name, shape):
        """(residual as float32 numpy of ``shape``, 2-bit threshold or None) of ``name``."""
        residual = self.memory.residual(name, mx.nd.zeros(shape, dtype=np.float32))
        return residual.asnumpy(), self.memory.scalar(name, "threshold")

    def set_state(self, name, residual, threshold):
        """Replace ``name``'s residual (numpy) and threshold (None: measure anew)."""
        res = self.memory.residual(name, mx.nd.zeros(residual.shape, dtype=np.float32))
        res[:] = residual
        self.memory.set_scalar(name, "threshold", threshold)


def make_compressors(threshold_scale=1.0):
    """The registry: strategy name -> Compressor instance."""
    return {c.name: c for c in (NoCompression(), TwoBit(threshold_scale), ConvTopK())}
