"""shared_2bit: 2-bit codes with a scale every worker shares, so that the servers can sum
the codes themselves (THC's tensor-homomorphic idea) and the pull does not grow with W.

Every element of a = g + r goes out as c * v, c in {-1, 0, +1}: c = sign(a) where
|a| >= t, else 0; r <- a - c * v (error feedback, on the workers only). Unlike fc_2bit,
whose threshold and value are each worker's own, t and v are the same on every worker
at a step, so the aggregate is v * (sum of the codes), an integer in [-W, W] per
element: the servers add the codes as integers (mxhylo.ops.formats, the 'sum' pull)
and every worker decodes the one sum. Exact: v times the integer, rounded once.

The threshold and the value, agreed with no extra round trip. Each worker's push
carries, beside its codes, sum |a| of its own a and the mean |a| of the elements it
sent. The servers sum them with the codes; after the pull every worker holds the same
totals and sets the next step's threshold and value from them:

    t = (sum over workers of sum |a|) / (W * n)          the mean |a| over all workers
    v = (sum over workers of its sent elements' mean |a|) / W

fc_2bit's rule (threshold the mean |a|, value the mean of what is sent), pooled over
the workers and one step late. A layer's first step has no agreed scale yet: it sends
no codes, only its sums, and its whole gradient waits one step in the residual; the
next step sends at v = t.

Why it converges: every worker pulls the same sums, so all hold the same t and v,
bitwise. A sent element leaves |a| - v (same sign) or, just over t, v - |a| (the sign
changes); while v < 2t both are smaller than |a|, so the codec never leaves an element
more than it held: error feedback's condition for converging as the uncompressed
method does. v / t is 1.7 for normally distributed a and 2 for Laplace-distributed a;
heavier tails can pass 2, and there the residual's row bound (kvstore.stages,
BoundedResidual) caps what a row holds.

Why this value: sending t itself (Hylo's v = t: no sign change) delivers about 40% of
a layer's L1 mass a step where fc_2bit's value delivers about 70%; the rest waits, and
the row bound drops what no longer fits. With 16 simulated workers on conv_net (no
BatchNorm, 5 paired seeds; docs/BENCHMARKS.md, "Pull bytes and accuracy past one
rack") v = t trailed dense by 1.51 points on average and by 7.6 on one seed; the pooled
mean of what is sent ended 0.36 point above dense.

Payload scalars: (v, sum |a|, mean |a| of the sent elements). A 'gather' or dense pull
decodes each worker's payload with its v (the same on all), so the codec travels any
way a 'slots' codec does; only the 'sum' pull needs the shared v.
"""
import numpy as np

from .. import ops
from .codec import Payload
from .compressors import TwoBit

# the first step's threshold: no |a| reaches it, so nothing is sent
NOTHING_SENT = float(np.finfo(np.float32).max)


class SharedTwoBit(TwoBit):
    """Any large layer: 2-bit codes, one threshold and value agreed by all workers (see
    the module docstring). Payload: int32 codes (16 per word) and three scalars."""
    name = "shared_2bit"
    wire = "slots"
    scalars = 3         # v; this worker's sum |a|; the mean |a| of what it sent
    summable = True     # the servers may add the codes of all workers (pull 'sum')

    def encode(self, plan, grad, memory, velocity=None, bound=None):
        t = memory.scalar(plan.name, "shared_threshold")
        first = t is None
        t = float(np.float32(NOTHING_SENT if first else t))
        v = float(np.float32(memory.scalar(plan.name, "shared_value") or t))
        # One operator, as fc_2bit's: a = g + r, codes where |a| >= t, r <- a - c * v
        # with the agreed v (the codes do not depend on the value, only the residual
        # does); it measures this worker's sum |a| and the mean |a| of what it sent.
        codes, stats, _ = self._encode(plan, grad, memory.residual(plan.name, grad), t, v,
                                       velocity, bound)
        total, sent_mean = stats[0], stats[2]
        # float32, as the slots carry them: every reader sums the same numbers; at the
        # first step nothing is sent, and its mean (t, float32 max) must not be summed
        return Payload(self.name, tuple(grad.shape), (codes,),
                       (v, float(np.float32(total)),
                        0.0 if first else float(np.float32(sent_mean))))

    def decode(self, payload, out, accumulate=False):
        (codes,) = payload.arrays
        ops.dequantize_2bit(codes, payload.scalars[0], payload.shape, out=out,
                            accumulate=accumulate)

    @staticmethod
    def agree(plan, totals, num_workers, memory):
        """Set layer ``plan``'s next threshold and value from ``totals``: the payload
        scalars summed over the workers (what every worker pulls alike)."""
        tiny = float(np.finfo(np.float32).tiny)     # an all-zero layer: sends zeros
        t = max(totals[1] / (num_workers * max(plan.size, 1)), tiny)
        # after the first step (nothing sent, no means pushed): v = t, Hylo's value
        v = totals[2] / num_workers if totals[2] > 0 else t
        memory.set_scalar(plan.name, "shared_threshold", t)
        memory.set_scalar(plan.name, "shared_value", max(v, tiny))
