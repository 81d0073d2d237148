"""One exchange of a hylo store, step by step: reduce, encode, exchange, finish, write.

``StepPipeline.pushpull(layers, values, outs, momentum)``, for each layer:

1. reduce: the per-device gradients are summed on the first device (a worker with
   several devices compresses once: hierarchical aggregation);
2. encode: the layer's stages (kvstore.stages: warm-up, momentum correction, error
   feedback around its codec) turn the gradient into the payload this worker sends;
3. exchange: the transport moves the payload and returns the aggregate of all
   workers' decoded payloads (kvstore.transport_local in one process,
   kvstore.transport_ps over MXNet's parameter server, kvstore.transport_horovod);
4. finish: the stages rewrite the aggregate where they must (momentum correction);
   once the aggregates are written, a shared-scale codec sets the next step's scale
   from what the pull agreed;
5. write: the float32 aggregate is copied into every output (cast to its dtype).

Each layer goes to step 3 as soon as it is encoded (the servers start while later
layers are still being encoded), and every aggregate is complete before step 5 writes,
so outputs may alias inputs or each other. The layers are taken in the order their
gradients are written (kvstore.readiness): a Trainer's step starts its exchange while
backward is still running. A non-finite gradient makes step 2 raise
FloatingPointError for that layer (its residual left as it was); layers before it in
the same call have been exchanged already, and a distributed worker ends (see
transport_ps: the other workers would wait for its pushes).
"""
import time

import mxnet as mx
import numpy as np

from . import readiness
from .memory import ResidualMemory
from .stages import Step, WarmUp, chain
from .stats import TrafficStats

# seconds an exchange waits for one more gradient of backward before it fails
GRADIENT_WAIT_BOUND_S = 900.0


class Layer:
    """A key's LayerPlan (its codec) and its stages, fixed until a re-plan."""
    __slots__ = ("key", "plan", "stages")

    def __init__(self, key, plan, stages):
        self.key, self.plan, self.stages = key, plan, stages

    @property
    def warms_up(self):
        """Whether its first exchanges travel dense (a WarmUp stage)."""
        return isinstance(self.stages, WarmUp)


class StepPipeline:
    """The exchange of one worker (see the module docstring).

    transport: a kvstore.transport.Transport; compressors: strategy -> Compressor;
    warmup_steps: of the WarmUp stage; order: 'written' (as backward writes the
    gradients), 'given' (the order of the call) or 'after' (as given, once every
    gradient is written). memory and traffic are this pipeline's own.
    """

    def __init__(self, transport, compressors, warmup_steps, order):
        self.transport = transport
        self.compressors = compressors
        self.warmup_steps = warmup_steps
        self.order = order
        self.memory = ResidualMemory()
        self.traffic = TrafficStats()
        self.layers = {}          # key -> Layer
        self._aggregates = {}     # key -> float32 buffer, where an output cannot be one

    def layer(self, key, plan):
        """A new Layer of ``key`` under LayerPlan ``plan`` (the key's first use)."""
        layer = self.layers[key] = Layer(key, plan, chain(plan, self.compressors,
                                                           self.warmup_steps, self.memory))
        return layer

    def replan(self, layer, plan):
        """``layer`` travels under ``plan`` from the next exchange (collective: every
        worker at the same point, between exchanges). A layer that starts compressing
        starts as after its warm-up: no second warm-up mid-run."""
        new = Layer(layer.key, plan, chain(plan, self.compressors, self.warmup_steps,
                                           self.memory))
        self.transport.replan(layer, new)
        self.layers[layer.key] = new
        if plan.strategy != "none":
            self.memory.set_scalar(plan.name, "warmup_done", self.warmup_steps)

    def broadcast(self, layers, values, outs):
        """Rank 0's ``values`` (one per layer) into every array of ``outs`` (a list per
        layer); the layers' keys are made first, all at once."""
        self.transport.broadcast(layers, values, outs)

    def pushpull(self, layers, values, outs, momentum=None):
        """Sum ``values`` (per layer, its per-device NDArrays) over devices and workers
        through the layers' stages; write each sum into every array of ``outs``.
        momentum: the Trainer step's MomentumContext, or None."""
        step = Step(self.memory, momentum)
        aggregates = self._aggregate_into(layers, values, outs)
        order, encode_s = [], [0.0] * len(layers)

        def encode_each():                                  # 1. reduce, 2. encode
            # a generator: the transport pushes each layer as soon as it is encoded
            for i in self._encode_order(layers, values):
                order.append(i)
                clock = time.perf_counter()
                payload = layers[i].stages.encode(layers[i], _reduce(values[i]), step)
                encode_s[i] = time.perf_counter() - clock
                self.traffic.time("encode", clock)
                yield layers[i], payload, aggregates[i]

        clock = start = time.perf_counter()
        in_order = self.transport.exchange(layers, encode_each())        # 3. exchange
        traffic = [None] * len(layers)      # (the transport reports in encode order)
        for i, t in zip(order, in_order):
            traffic[i] = t
        clock = self.traffic.time("exchange", clock)
        for layer, agg in zip(layers, aggregates):                        # 4. finish
            layer.stages.finish(layer, agg, step)
        self.transport.wait(layers, aggregates, traffic)   # bounded: kvstore.watchdog
        clock = self.traffic.time("wait", clock)
        for layer, t in zip(layers, traffic):
            if t.agreed is not None:    # a shared scale: the next step's (codec_shared)
                self.compressors[layer.plan.strategy].agree(
                    layer.plan, t.agreed, self.transport.num_workers, self.memory)
        for layer, t, enc in zip(layers, traffic, encode_s):
            self.traffic.record(layer.plan, t.pushed, t.pulled, t.messages, t.per_server,
                                seconds=enc + t.pull_s,
                                push_s=None if t.pushed_at is None else t.pushed_at - start)
        for agg, os_ in zip(aggregates, outs):                           # 5. write
            for o in os_:
                if o is agg:
                    continue
                if o.dtype == agg.dtype:
                    agg.copyto(o)
                else:
                    o[:] = agg.astype(o.dtype)
        self.traffic.time("write", clock)

    def _encode_order(self, layers, values):
        """Item indices in the order to encode them (see the class docstring)."""
        if self.order == "after":
            for vals in values:
                for v in vals:
                    v.wait_to_read()
        if self.order != "written" or len(layers) == 1:
            return range(len(layers))
        return readiness.ReadyOrder(values, [l.plan.name for l in layers],
                                    GRADIENT_WAIT_BOUND_S)

    def _aggregate_into(self, layers, values, outs):
        """Where each key's float32 aggregate is assembled: its first output itself
        when that is float32 on the first value's device and no output of this call
        is another key's input (an in-process decode of key A into an array that key B
        still has to read would change B's input); a buffer otherwise."""
        inputs = [{v.handle.value for v in vals} for vals in values]
        every_input = set().union(*inputs) if inputs else set()
        aliased = any(o.handle.value in every_input - mine
                      for os_, mine in zip(outs, inputs) for o in os_)
        aggregates = []
        for layer, vals, os_ in zip(layers, values, outs):
            ctx, first = vals[0].context, os_[0]
            if not aliased and first.dtype == np.float32 and first.context == ctx:
                aggregates.append(first)
                continue
            agg = self._aggregates.get(layer.key)
            if agg is None or agg.context != ctx:
                agg = self._aggregates[layer.key] = mx.nd.zeros(
                    layer.plan.shape, ctx=ctx, dtype=np.float32)
            aggregates.append(agg)
        return aggregates


def _reduce(vals):
    """Sum of the per-device arrays on the first one's device (the array itself if
    there is one: nothing writes to it before step 5, after every read)."""
    if len(vals) == 1:
        return vals[0]
    ctx = vals[0].context
    return mx.nd.add_n(*[v.as_in_context(ctx) for v in vals])


def normalize_call(key, value, out, what):
    """A KVStoreBase call's (key, value, out) as three lists of equal length: keys, per
    key its values (one NDArray per device), per key its outputs (the values
    themselves where out is None); an error naming the problem for anything a hylo
    store cannot take (``what``: the call, for the message)."""
    if isinstance(key, (list, tuple)):
        values = [_as_list(v) for v in value]
        if len(values) != len(key):
            raise ValueError("%s: %d keys but %d values" % (what, len(key), len(values)))
        outs = values if out is None else [_as_list(o) for o in out]
        if len(outs) != len(key):
            raise ValueError("%s: %d keys but %d outputs" % (what, len(key), len(outs)))
        keys = list(key)
    else:
        keys, values = [key], [_as_list(value)]
        outs = values if out is None else [_as_list(out)]
    for k, vals, os_ in zip(keys, values, outs):
        if not isinstance(k, (int, np.integer, str)):
            raise TypeError("%s: keys must be int or str, got %r" % (what, type(k)))
        shape = vals[0].shape
        for a in list(vals) + list(os_):
            if not isinstance(a, mx.nd.NDArray):
                raise TypeError("%s: values must be NDArrays, got %r" % (what, type(a)))
            if a.shape != shape:
                raise ValueError("%s of key %r: shape %s differs from %s"
                                 % (what, k, a.shape, shape))
            if a.stype != "default":
                raise ValueError("%s of key %r: hylo compresses dense gradients; got "
                                 "storage type %r" % (what, k, a.stype))
    return keys, values, outs


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]
