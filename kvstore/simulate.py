"""W workers' exchanges in one process, with the arithmetic of W processes.

``SimulatedWorkers(W)`` keeps what each of W workers keeps (its residual memory, its
stages around the codec: kvstore.stages) and aggregates their payloads as the
parameter servers and the workers' pulls do:

* a shared-scale codec (kvstore.codec_shared): the integer sums of the codes and the
  summed header (kvstore.wire.sum_payloads), decoded as v * sum. Bitwise what a real
  job's 'sum' pull gives, in any order the pushes arrive;
* any other compressed codec: every payload decoded and added in rank order, bitwise
  a real job's 'gather' pull;
* dense payloads (a small layer, a warm-up step): float32 sums in rank order. The
  servers add pushes in the order they arrive, so from 3 workers on a real job's dense
  sums differ from these in the last bit now and then.

After the aggregate, each worker agrees on its shared scale and runs its stages'
finish (momentum correction), as its pipeline would. What it measures: accuracy and
bytes at W = 16 or 64 on a machine that cannot run as many processes, each simulated
worker with its own data shard (the caller's), residuals and encodes.
"""
import mxnet as mx
import numpy as np

from .compressors import make_compressors
from .memory import ResidualMemory
from .stages import Step, chain
from .wire import decode_sums, sum_payloads


class _Layer:
    """What the stages read of a layer: its LayerPlan."""
    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan


class SimulatedWorkers:
    """num_workers workers' memories and stages (see the module docstring);
    warmup_steps: the store's WarmUp stage."""

    def __init__(self, num_workers, warmup_steps=0):
        self.num_workers = int(num_workers)
        self.warmup_steps = int(warmup_steps)
        self.compressors = make_compressors()
        self.memories = [ResidualMemory() for _ in range(self.num_workers)]
        self._stages = {}           # (worker, layer name, strategy) -> stages
        self.pushed = self.pulled = 0    # bytes per worker, summed over exchanges

    def stages(self, worker, plan):
        key = (worker, plan.name, plan.strategy)
        if key not in self._stages:
            self._stages[key] = chain(plan, self.compressors, self.warmup_steps,
                                      self.memories[worker])
        return self._stages[key]

    def exchange(self, plan, grads, momentum=None):
        """One exchange of the layer of LayerPlan ``plan``: ``grads``, worker w's
        gradient (NDArray of the layer's shape) at index w; ``momentum``: the step's
        kvstore.momentum.MomentumContext or None. Returns the float32 aggregate every
        worker ends with (NDArray of the layer's shape)."""
        if len(grads) != self.num_workers:
            raise ValueError("%d gradients for %d simulated workers"
                             % (len(grads), self.num_workers))
        layer = _Layer(plan)
        steps = [Step(m, momentum) for m in self.memories]
        payloads = [self.stages(w, plan).encode(layer, g, steps[w])
                    for w, g in enumerate(grads)]
        aggregate, agreed = self.aggregate(plan, payloads)
        self.pushed += payloads[0].nbytes
        out = None
        for w in range(self.num_workers):
            if agreed is not None:
                self.compressors[plan.strategy].agree(plan, agreed, self.num_workers,
                                                      self.memories[w])
            mine = aggregate.copy()
            self.stages(w, plan).finish(layer, mine, steps[w])
            out = mine if out is None else out
        return out

    def aggregate(self, plan, payloads):
        """(float32 NDArray of the layer's shape, the shared-scale header or None) of
        the workers' ``payloads``, as a real job's pull decodes them."""
        codec = self.compressors[payloads[0].strategy]
        if getattr(codec, "summable", False):
            header, packed = sum_payloads(payloads, plan.size)
            return decode_sums(header, packed, plan.shape, self.num_workers), header
        out = mx.nd.zeros(plan.shape, dtype=np.float32)
        for p in payloads:          # rank order, as a 'gather' pull decodes
            codec.decode(p, out, accumulate=True)
        return out, None
