"""fp16: a layer's gradient (plus residual) sent as IEEE half precision, 2 bytes per
element, what fp16 cannot hold kept in the residual (error feedback).

A codec in one file: the class below plus its entry in kvstore.compressors.CODECS.
Nothing else in the store, the transports or the servers names it. Choose it with the
policy, e.g. ``mxhylo.create(policy={'dense.*weight': 'fp16'})``.

Values beyond fp16's range (|v| > 65504) are clipped to it and the excess stays in the
residual; a NaN or Inf gradient raises FloatingPointError naming the layer, with the
residual left as it was, as the other codecs do.
"""
import mxnet as mx
import numpy as np

from .codec import Compressor, Payload, raise_non_finite

FP16_MAX = 65504.0


class Float16(Compressor):
    """Any layer: every element of (g + r) rounded to float16; r <- (g + r) - sent."""
    name = "fp16"
    wire = "slots"

    def payload_nbytes(self, plan):
        return 2 * plan.size

    def encode(self, plan, grad, memory):
        residual = memory.residual(plan.name, grad)
        total = grad.astype(np.float32) + residual
        bad = int((mx.nd.contrib.isfinite(total) == 0).sum().asscalar())
        if bad:
            raise_non_finite(plan.name, bad, plan.size)      # residual not touched yet
        half = mx.nd.clip(total, -FP16_MAX, FP16_MAX).astype(np.float16)
        residual[:] = total - half.astype(np.float32)
        return Payload(self.name, tuple(grad.shape), (half,))

    def decode(self, payload, out, accumulate=False):
        (half,) = payload.arrays
        values = half.astype(np.float32).reshape(out.shape)
        if accumulate:
            out += values
        else:
            out[:] = values

    def to_bytes(self, payload):
        return payload.arrays[0].asnumpy().reshape(-1).view(np.uint8)

    def byte_span(self, lo, hi):
        return 2 * lo, 2 * hi

    def piece_payload(self, data, scalars, size):
        half = np.ascontiguousarray(data[:2 * size]).view(np.float16)
        return Payload(self.name, (size,), (mx.nd.array(half, dtype=np.float16),))
