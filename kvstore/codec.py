"""What a codec is: the Payload it produces and the Compressor interface it implements.

A codec is one class (the built-in ones in kvstore.compressors, others in a file of
their own, such as kvstore.codec_fp16) plus one entry in the registry,
kvstore.compressors.CODECS. Its class attributes tell the parameter-server transport
how its payload travels (``wire``, kvstore.wire):

* ``'dense'``: the payload is one float32 array the servers may sum (no compression);
* ``'rows'``: (int32 indices, float32 rows): the servers' row_sparse sum is the
  scatter-add of every worker's rows (conv_topk);
* ``'slots'``: opaque bytes plus a few float32 header scalars: each worker owns a slot
  of the key, the servers gather the slots and decode each with the codec (fc_2bit,
  fp16). Such a codec also says how its payload looks as bytes (``to_bytes``,
  ``byte_span``, ``piece_payload``), since large layers travel cut into chunks.
"""
from dataclasses import dataclass
from typing import Tuple

import mxnet as mx
import numpy as np

from ..ops import formats


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


def raise_non_finite(name, count, size):
    raise FloatingPointError(
        "non-finite gradient in layer %r: %d of %d elements are NaN or Inf. The step is "
        "abandoned and the layer's residual left as it was. With fp16, use "
        "loss scaling (mxhylo.LARSTrainer skips overflowing steps before they are sent)."
        % (name, count, size))


def undo_encode(compressor, payload, grad, residual):
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
    """Interface of a codec. ``name`` is the strategy name the policy uses; ``wire``
    how its payload travels (module docstring)."""
    name = None
    wire = "dense"
    scalars = 0         # 'slots' codecs: header values every payload carries
    # the stages' work this codec's encode does in its own pass (kvstore.stages, "Fused
    # stages"): "velocity" (encode takes velocity=, a kvstore.momentum.Velocity) and
    # "bound" (bound=, BoundedResidual's row bound)
    fuses = ()

    def encode(self, plan, grad, memory, **fused):
        """Encode NDArray ``grad`` of layer ``plan`` -> Payload; updates ``memory``.
        ``fused``: the stages' work listed in ``fuses``, given only to such a codec."""
        raise NotImplementedError

    def decode(self, payload, out, accumulate=False):
        """Write (or with accumulate, add) the decoded payload into float32 NDArray ``out``."""
        raise NotImplementedError

    def payload_nbytes(self, plan):
        """Payload.nbytes of an encode of layer ``plan``, known before encoding (the
        cost model's bytes). Default: the layer as float32."""
        return 4 * plan.size + 4 * self.scalars

    def to_bytes(self, payload):
        """'slots' codecs: the whole payload's data as bytes (uint8 numpy)."""
        raise NotImplementedError

    def byte_span(self, lo, hi):
        """'slots' codecs: the bytes [a, b) of to_bytes() that carry elements [lo, hi)
        of the flat layer (lo a multiple of 16: kvstore.wire cuts layers there)."""
        raise NotImplementedError

    def piece_payload(self, data, scalars, size):
        """'slots' codecs: the Payload of a piece of ``size`` elements from its bytes
        ``data`` (uint8 numpy, at least byte_span(0, size)[1] of them) and its header
        ``scalars`` (the payload's own, as travelled: float32)."""
        raise NotImplementedError

    def decode_slots(self, slots, size, out):
        """'slots' codecs, a 'gather' pull: ``out`` (float32 NDArray (size,)) <- every
        worker's payload of a piece of ``size`` elements, decoded and added in rank
        order. slots: float32 numpy (W, m), row w worker w's slot as kvstore.wire's
        push_slot writes it (the header scalars, then the bytes in carriers).
        ValueError if a slot was altered on the way. Here: each slot's piece_payload
        decoded in turn; a codec may do it in one pass (TwoBit)."""
        nbytes = self.byte_span(0, size)[1]
        out[:] = 0
        for slot in slots:
            data = formats.unpack_bytes(slot[self.scalars:], nbytes)
            self.decode(self.piece_payload(data, slot[:self.scalars], size), out,
                        accumulate=True)
