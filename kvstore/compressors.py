"""Compressors: encode one layer's gradient (with its residual) and decode payloads.

A Compressor knows one codec; it does not know where bytes go (that is the
transport's job) nor which layer gets which codec (the policy's). ``encode`` folds
the residual in and leaves what was not sent in it; ``decode`` writes or adds a
payload into a dense float32 array, so a receiver aggregates any number of payloads
(each worker's own threshold or kernel choice) by decoding with accumulate=True.

CODECS is the registry (a new codec: one file and one entry there); make_compressors()
builds it: the policy's strategy names -> instances.
"""
import mxnet as mx
import numpy as np

from .. import ops
from .codec import Compressor, Payload, undo_encode, raise_non_finite
from .codec_fp16 import Float16


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
    """Fully connected and conv weights: every element as {-v, 0, +v} in 2 bits, error
    feedback.

    Threshold: an element of a = g + r is sent where |a| >= t, t = mean(|a|). The mean
    is a by-product of the quantization pass (ops.encode_2bit returns sum |a|), so step
    s quantizes with the mean measured at step s-1; the very first step measures it
    with ops.l1_stats.
    Value: the sent elements travel as +-v, v = the mean |a| of those elements, measured
    in the same pass. Sending t itself (Hylo's code) sends less than the elements hold
    (t is the smallest of them), and the rest waits in the residual; in the accuracy
    study (docs/BENCHMARKS.md), v converges in fewer steps.
    Fuses the velocity of momentum correction and the residual's row bound
    (kvstore.stages): one operator, two passes over the layer.
    Payload: int32 codes (16 per word) and v.
    """
    name = "fc_2bit"
    wire = "slots"
    scalars = 1         # the value sent
    fuses = ("velocity", "bound")

    def _threshold(self, stats, plan):
        total, bad = (float(v) for v in stats.asnumpy())
        if bad:
            raise_non_finite(plan.name, int(bad), plan.size)
        return self._scaled(total, plan)

    def _scaled(self, total, plan):
        t = total / max(plan.size, 1)
        # An all-zero layer has mean 0; any positive threshold then sends all zeros.
        return max(t, float(np.finfo(np.float32).tiny))

    def encode(self, plan, grad, memory, velocity=None, bound=None):
        residual = memory.residual(plan.name, grad)
        t = memory.scalar(plan.name, "threshold")
        if t is None:           # the first step: the velocity formed first, for its mean
            grad, velocity = _formed(grad, velocity), None
            t = self._threshold(ops.l1_stats(grad, residual), plan)
        codes, stats, value = self._encode(plan, grad, residual, t, None, velocity, bound)
        total = stats[0]
        memory.set_scalar(plan.name, "threshold", self._scaled(total, plan))
        return Payload(self.name, tuple(grad.shape), (codes,), (value,))

    def _encode(self, plan, grad, residual, t, value, velocity, bound):
        """ops.encode_2bit of layer ``plan`` at threshold ``t`` (``value``: None for the
        mean of what is sent) -> (codes, ops.encode_2bit's stats as floats, the value
        sent). A non-finite element: the residual restored, then FloatingPointError
        naming the layer."""
        codes, stats, _ = ops.encode_2bit(
            grad, residual, float(np.float32(t)), value=value,
            velocity=None if velocity is None else velocity.previous,
            momentum=None if velocity is None else velocity.momentum,
            velocity_out=None if velocity is None else velocity.out, bound=bound)
        stats = [float(v) for v in stats.asnumpy()]
        value = stats[2] if value is None else value
        if stats[1]:
            payload = Payload(self.name, tuple(grad.shape), (codes,), (value,))
            encoded = grad if velocity is None else velocity.out    # what it encoded
            undo_encode(self, payload, encoded, residual)
            raise_non_finite(plan.name, int(stats[1]), plan.size)
        return codes, stats, value

    def decode(self, payload, out, accumulate=False):
        (codes,) = payload.arrays
        ops.dequantize_2bit(codes, payload.scalars[0], payload.shape, out=out,
                            accumulate=accumulate)

    def payload_nbytes(self, plan):
        return 4 * -(-plan.size // 16) + 4 * self.scalars     # int32 words of 16 codes

    def to_bytes(self, payload):
        codes = payload.arrays[0]
        view = ops.host_view(codes)         # read in place: the codes are never rewritten
        return (codes.asnumpy() if view is None else view).view(np.uint8)

    def byte_span(self, lo, hi):
        return lo // 4, 4 * -(-hi // 16)        # whole int32 words of 16 codes

    def piece_payload(self, data, scalars, size):
        words = np.ascontiguousarray(data[:self.byte_span(0, size)[1]]).view(np.int32)
        return Payload(self.name, (size,), (mx.nd.array(words, dtype=np.int32),),
                       tuple(float(v) for v in scalars))

    def decode_slots(self, slots, size, out):
        """One C++ pass over every worker's carried codes (ops.decode_carried_2bit):
        bitwise each payload decoded in turn, without W NDArray copies and operators,
        written straight into ``out``'s memory where it is the host's (ops.host_view)."""
        view = ops.host_view(out, write=True)
        summed, bad = ops.decode_carried_2bit(slots, self.scalars, size, out=view)
        if bad.any():
            raise ValueError("the 2-bit slots of worker rank(s) %s hold values no "
                             "pack_bytes writes: the payload was altered on the way"
                             % ", ".join(str(w) for w in np.flatnonzero(bad)))
        if view is None:                        # a GPU's array: one copy through MXNet
            out[:] = summed

    def decode_gathered(self, data, spans, size, out):
        """Every worker's payload of an allgather (``data``: the gathered bytes,
        ``spans``: a wire.BlobSpan per worker, rank order) decoded and summed into
        ``out`` in one C++ pass (ops.decode_gathered_2bit), read where the gathered
        bytes hold it: bitwise each payload decoded in turn."""
        values = [span.scalars[0] for span in spans]
        view = ops.host_view(out, write=True)
        if view is not None:
            view = view.reshape(-1)             # (contiguous: a view, no copy)
        summed = ops.decode_gathered_2bit(data, [span.body_at for span in spans], values,
                                          size, out=view)
        if view is None:                        # a GPU's array: one copy through MXNet
            out[:] = summed.reshape(out.shape)


class ConvTopK(Compressor):
    """Convolution layers: the k output filters of largest L2 norm of (g + r).

    Payload: int32 filter indices (k,) and their float32 values (k, I*kh*kw); the
    filters not sent stay in the residual.
    """
    name = "conv_topk"
    wire = "rows"

    def encode(self, plan, grad, memory):
        residual = memory.residual(plan.name, grad)
        indices, values, stats = ops.select_kernels(grad, residual, plan.k)
        payload = Payload(self.name, tuple(grad.shape), (indices, values))
        bad = float(stats.asnumpy()[1])
        if bad:
            undo_encode(self, payload, grad, residual)
            raise_non_finite(plan.name, int(bad), plan.size)
        return payload

    def payload_nbytes(self, plan):
        row = plan.size // plan.shape[0]
        return plan.k * (4 + 4 * row)               # int32 index + float32 filter each

    def decode(self, payload, out, accumulate=False):
        indices, values = payload.arrays
        ops.scatter_kernels(indices, values, payload.shape, out=out, accumulate=accumulate)


def _formed(grad, velocity):
    """The velocity formed now (ops.momentum_velocity into its spare), or ``grad``
    where there is none."""
    if velocity is None:
        return grad
    return ops.momentum_velocity(grad, velocity.previous, velocity.momentum, out=velocity.out)


# (imported here, not at the top: the shared-scale codec extends TwoBit above)
from .codec_shared import SharedTwoBit  # noqa: E402

# The registry: every codec the policy can name (a strategy), one entry each.
CODECS = (NoCompression, TwoBit, ConvTopK, Float16, SharedTwoBit)
CODEC_NAMES = tuple(c.name for c in CODECS)


def make_compressors():
    """Strategy name -> Compressor instance, for every codec of CODECS."""
    return {c.name: c() for c in CODECS}
