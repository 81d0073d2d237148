"""shared_2bit: 2-bit codes with a scale every worker shares, so that the servers can sum
the codes themselves (THC's tensor-homomorphic idea) and the pull does not grow with W.

Every element of a = g + r goes out as c * v, c in {-1, 0, +1}: c = sign(a) where
|a| >= t, else 0; r <- a - c * v (error feedback, on the workers only). Unlike fc_2bit,
whose threshold and value are each worker's own, t and v are the same on every worker
at a step, so the aggregate is v * (sum of the codes), an integer in [-W, W] per
element: the servers add the codes as integers (kvstore.sums, the 'sum' pull) and
every worker decodes the one sum. Exact: v times the integer, rounded once.

The scale, agreed with no extra round trip. Each worker's push carries, beside its
codes, three statistics of its own a: sum |a|, sum |a| over the elements it sent, and
how many it sent. The servers sum them with the codes; after the pull every worker
holds the same totals and sets the next step's scale from them:

    t = (sum over workers of sum |a|) / (W * n)   the mean |a| over all workers
    v = (sum of sent |a|) / (count sent)          the mean |a| of what was sent
                                                  (t if nothing was sent)

which is fc_2bit's own rule (t the mean |a|, v the mean sent |a|) pooled over the
workers and one step late, as fc_2bit's threshold already is. Why it converges: each
worker's residual is bounded as under fc_2bit (t tracks the mean |a| of the workers,
so an element holding more than a step's mean goes out within a step of two), and the
pooled v keeps what is sent equal, in L1 over all workers, to what was over the
threshold. A layer's first step has no agreed scale yet: it sends no codes, only its
statistics, and its whole gradient waits one step in the residual.

Payload scalars: (v, sum |a|, sum of sent |a|, count sent). A 'gather' or dense pull
decodes each worker's payload with its v (the same on all), so the codec travels any
way a 'slots' codec does; only the 'sum' pull needs the shared v.
"""
import numpy as np

from .. import ops
from .codec import Payload, undo_encode, raise_non_finite
from .compressors import TwoBit
from .memory import Owed

# the first step's threshold: no |a| reaches it, so nothing is sent
NOTHING_SENT = float(np.finfo(np.float32).max)


class SharedTwoBit(TwoBit):
    """Any large layer: 2-bit codes, one threshold and value agreed by all workers (see
    the module docstring). Payload: int32 codes (16 per word) and four scalars."""
    name = "shared_2bit"
    wire = "slots"
    scalars = 4         # v, sum |a|, sum of sent |a|, count sent
    summable = True     # the servers may add the codes of all workers (pull 'sum')

    def encode(self, plan, grad, memory):
        t = memory.scalar(plan.name, "shared_threshold")
        v = memory.scalar(plan.name, "shared_value")
        if t is None:
            t = v = NOTHING_SENT
        t, v = float(np.float32(t)), float(np.float32(v))
        residual, owed = memory.residual_owing(plan.name, grad)
        pending = None if owed is None else (owed.threshold, owed.value)
        # one pass: r <- a, the subtraction of c * v owed to the next step's pass; the
        # op's own value (stats[2], the mean sent |a|) is this worker's statistic only
        codes, stats = ops.quantize_2bit(grad, residual, t, pending=pending, defer=True)
        memory.set_owed(plan.name, None)
        total, bad, own_value = (float(x) for x in stats.asnumpy())
        # a sent element's code is 1 or 2: one set bit each
        sent = int(np.unpackbits(codes.asnumpy().view(np.uint8)).sum()) \
            if t != NOTHING_SENT else 0
        # float32, as the slots carry them: every reader sums the same numbers
        scalars = tuple(float(np.float32(x)) for x in (v, total, own_value * sent, sent))
        payload = Payload(self.name, tuple(grad.shape), (codes,), scalars)
        if bad:
            ops.settle_2bit(codes, v, residual)
            undo_encode(self, payload, grad, residual)
            raise_non_finite(plan.name, int(bad), plan.size)
        memory.set_owed(plan.name, Owed(codes, t, v))
        return payload

    def decode(self, payload, out, accumulate=False):
        (codes,) = payload.arrays
        ops.dequantize_2bit(codes, payload.scalars[0], payload.shape, out=out,
                            accumulate=accumulate)

    @staticmethod
    def agree(plan, totals, num_workers, memory):
        """Set layer ``plan``'s next threshold and value from ``totals``: the payload
        scalars summed over the workers (what every worker pulls alike)."""
        _, absum, sent_absum, sent = totals
        t = absum / (num_workers * max(plan.size, 1))
        # an all-zero layer: any positive threshold sends zeros
        t = max(t, float(np.finfo(np.float32).tiny))
        v = sent_absum / sent if sent else t
        memory.set_scalar(plan.name, "shared_threshold", t)
        memory.set_scalar(plan.name, "shared_value", max(v, float(np.finfo(np.float32).tiny)))
