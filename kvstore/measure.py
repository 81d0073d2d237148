"""The store's one measurement: what the planner needs of this machine and network.

Collective (every worker calls it at the same point; the figures are rank 0's, so
every worker reaches the same plan):

* the wire: dense exchanges of two probe sizes through the real transport, every
  worker at once (kvstore.cost_model.WireCost: latency and seconds per byte);
* the links, where the transport has several (the parameter server: each server's
  link alone, and what one more message costs; kvstore.cost_model.LinkCosts);
* on rank 0: each codec's encode and decode on a synthetic layer, and momentum
  correction's passes (seconds per element).

The probes travel through a StepPipeline of their own (their keys, residuals and
traffic are not the store's). At start-up this takes COST_PROBE_REPEATS dense
exchanges of each probe size (64 KB, 4 MB) and a few milliseconds of codec timing:
under a second at 1 Gbit/s; ``seconds`` in the result says what it took here.
"""
import time
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .cost_model import CodecCost, CostModel, WireCost, time_codec, time_momentum
from .pipeline import StepPipeline

# dense probe layers timed: 64 KB and 4 MB of float32
COST_PROBE_ELEMENTS = (1 << 14, 1 << 20)
COST_PROBE_REPEATS = 3
# dense probes of each aggregation link alone (LinkCosts): 64 KB, 1 MB
LINK_PROBE_ELEMENTS = (1 << 14, 1 << 18)
STRATEGIES = ("conv_topk", "fc_2bit")


@dataclass(frozen=True)
class Measurement:
    """A CostModel of rank 0's figures, and the seconds measuring took on this worker."""
    model: CostModel
    seconds: float


def measure(transport, policy, compressors, pull):
    """Measure (see the module docstring); ``pull``: the cost model's pull ('gather',
    None, or 'allgather' over Horovod)."""
    clock = time.perf_counter()
    probes = StepPipeline(transport, compressors, warmup_steps=0, order="given")
    nbytes, seconds = [], []
    for n in COST_PROBE_ELEMENTS:
        key = "__hylo_cost_probe_%d__" % n
        layer = probes.layer(key, policy.plan_as(key, (n,), "none"))
        value = mx.nd.zeros((n,))
        probes.broadcast([layer], [value], [[value]])
        times = []
        for _ in range(COST_PROBE_REPEATS):
            start = time.perf_counter()
            probes.pushpull([layer], [[value]], [[value]])
            value.wait_to_read()
            times.append(time.perf_counter() - start)
        nbytes.append(4 * n)
        seconds.append(float(np.median(times[1:])))     # the first one warms up
    links = transport.time_links(LINK_PROBE_ELEMENTS, COST_PROBE_REPEATS)
    codecs, momentum_s = {s: CodecCost(0.0, 0.0) for s in STRATEGIES}, 0.0
    if transport.rank == 0:         # (the others' figures are replaced by rank 0's)
        codecs = {s: time_codec(policy, compressors[s]) for s in STRATEGIES}
        momentum_s = time_momentum()
    workers = transport.num_workers
    mine = CostModel(WireCost.fit(nbytes, seconds), codecs, workers, pull,
                     momentum_s=momentum_s, links=links)
    shared = transport.share_from_rank0(mine.to_array(STRATEGIES))
    model = CostModel.from_array(shared, STRATEGIES, workers, pull)
    return Measurement(model, time.perf_counter() - clock)
