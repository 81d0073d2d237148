"""shared_2bit: 2-bit codes with a scale every worker shares, so that the servers can sum
the codes themselves (THC's tensor-homomorphic idea) and the pull does not grow with W.

Every element of a = g + r goes out as c * v, c in {-1, 0, +1}: c = sign(a) where
|a| >= v, else 0; r <- a - c * v (error feedback, on the workers only). Unlike fc_2bit,
whose threshold and value are each worker's own, v is the same on every worker at a
step, so the aggregate is v * (sum of the codes), an integer in [-W, W] per
element: the servers add the codes as integers (mxhylo.ops.formats, the 'sum' pull) and
every worker decodes the one sum. Exact: v times the integer, rounded once.

The scale, agreed with no extra round trip. Each worker's push carries, beside its
codes, sum |a| of its own a. The servers sum it with the codes; after the pull every
worker holds the same total and sets the next step's scale from it:

    t = v = (sum over workers of sum |a|) / (W * n)    the mean |a| over all workers

fc_2bit's threshold rule pooled over the workers, one step late as fc_2bit's already
is. The value sent is the threshold itself (Hylo's original code), not the mean of
what is sent: every sent element has |a| >= t = v, so its residual keeps its sign and
shrinks (|a| - v < |a|): error feedback never sends more than an element holds. With
a pooled mean as the value, an element just over a pooled threshold
was sent at up to twice its size and came back with the opposite sign: 16 simulated
workers on conv_net (lr 0.05, seed 4) fell to 69.3% where dense reached 92.2% and
v = t 92.2%. A layer's first step has no agreed scale yet: it sends no codes, only
its sum, and its whole gradient waits one step in the residual.

Payload scalars: (v, sum |a|). A 'gather' or dense pull decodes each worker's payload
with its v (the same on all), so the codec travels any way a 'slots' codec does; only
the 'sum' pull needs the shared v.
"""
import numpy as np

from .. import ops
from .codec import Payload, undo_encode, raise_non_finite
from .compressors import TwoBit

# the first step's threshold: no |a| reaches it, so nothing is sent
NOTHING_SENT = float(np.finfo(np.float32).max)


class SharedTwoBit(TwoBit):
    """Any large layer: 2-bit codes, one threshold and value agreed by all workers (see
    the module docstring). Payload: int32 codes (16 per word) and two scalars."""
    name = "shared_2bit"
    wire = "slots"
    scalars = 2         # v, this worker's sum |a|
    summable = True     # the servers may add the codes of all workers (pull 'sum')

    def encode(self, plan, grad, memory):
        v = memory.scalar(plan.name, "shared_value")
        v = float(np.float32(NOTHING_SENT if v is None else v))
        residual = memory.residual(plan.name, grad)
        # one pass: a = g + r, c where |a| >= v, r <- a - c * v
        codes, stats = ops.quantize_2bit(grad, residual, v, value=v)
        total, bad, _ = (float(x) for x in stats.asnumpy())
        # float32, as the slots carry them: every reader sums the same numbers
        payload = Payload(self.name, tuple(grad.shape), (codes,),
                          (v, float(np.float32(total))))
        if bad:
            undo_encode(self, payload, grad, residual)
            raise_non_finite(plan.name, int(bad), plan.size)
        return payload

    def decode(self, payload, out, accumulate=False):
        (codes,) = payload.arrays
        ops.dequantize_2bit(codes, payload.scalars[0], payload.shape, out=out,
                            accumulate=accumulate)

    @staticmethod
    def agree(plan, totals, num_workers, memory):
        """Set layer ``plan``'s next value from ``totals``: the payload scalars summed
        over the workers (what every worker pulls alike)."""
        v = totals[1] / (num_workers * max(plan.size, 1))
        # an all-zero layer: any positive value sends zeros
        memory.set_scalar(plan.name, "shared_value", max(v, float(np.finfo(np.float32).tiny)))
