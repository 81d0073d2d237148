"""The hylo KVStore: MXNet's KVStoreBase contract, wiring policy, memory, codecs, transport.

One gradient's way through ``pushpull(key, [g_dev0, g_dev1, ...])``:

1. reduce: the per-device gradients are summed on the first device (a worker with
   several devices compresses once: hierarchical aggregation);
2. encode: the layer's plan (kvstore.policy, and where compression would not pay on
   this network kvstore.cost_model) picks a compressor (kvstore.compressors), which
   folds in the layer's residual (kvstore.memory) and leaves there what it does not
   send;
3. exchange: the transport moves the payload and returns the aggregate of all
   workers' decoded payloads (kvstore.transport_local in one process,
   kvstore.transport_ps over MXNet's parameter server);
4. write: the float32 aggregate is copied into every output (cast to its dtype).

With list keys each key goes to step 3 as soon as it is encoded (the servers start
while later keys are still being encoded), and every aggregate is complete before
step 4 writes, so outputs may alias inputs or each other. The keys are taken in the
order their gradients are written (kvstore.readiness): a Trainer's step starts its
exchange while backward is still running, layer by layer as backward produces them.
A non-finite gradient makes step 2 raise FloatingPointError for that key (its
residual left as it was); keys before it in the same call have been exchanged
already, and a distributed worker ends (see transport_ps: the other workers would
wait for its pushes).

Gluon's Trainer passes parameter indices as keys, one key per call, and tells the store
nothing else. kvstore.trainer_hook connects them explicitly: a Trainer whose kvstore is
a hylo store attaches itself (``attach_trainer``: int keys are named by its parameters)
and exchanges its whole step in one call (``exchange_step``). Where compression would
not pay, the store gives the Trainer the servers' route instead (``route_for``,
kvstore.server_route: dist_sync's exchange, the optimizer on the servers).
"""
import contextlib
import dataclasses
import os
import time
import weakref

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from . import momentum as momentum_correction
from .compressors import make_compressors
from .cost_model import (CodecCost, CostModel, ExchangeDrift, RouteChoice, RouteCosts,
                         WireCost, available_memory_bytes, time_codec, time_momentum,
                         time_update)
from .memory import ResidualMemory
from .policy import DEFAULT_SIZE_THRESHOLD, LayerPolicy, compress_pull_mode, pull_codec
from .stats import TrafficStats
from .transport_local import LocalTransport
from .transport_horovod import launched_by_horovodrun    # (imports no horovod)
from .wire import STATEFUL_PULLS
from . import active, readiness, trainer_hook


DEFAULT_WARMUP_STEPS = 30
# dense probe layers the cost model times at start-up: 64 KB and 4 MB of float32
COST_PROBE_ELEMENTS = (1 << 14, 1 << 20)
COST_PROBE_REPEATS = 3
# dense probes of each aggregation link alone (kvstore.cost_model.LinkCosts): 64 KB, 1 MB
LINK_PROBE_ELEMENTS = (1 << 14, 1 << 18)
# Trainer steps between two measurements of the cost model (and re-plans)
DEFAULT_COST_RECHECK_STEPS = 1000
# with the cost model: every this many Trainer steps the workers agree (rank 0's
# figures) whether the exchange has drifted by cost_drift since the last measurement
DRIFT_CHECK_STEPS = 50
DRIFT_WINDOW = 20        # steps of each median compared (ExchangeDrift)
DEFAULT_COST_DRIFT = 2.0
# seconds an exchange waits for one more gradient of backward before it fails
GRADIENT_WAIT_BOUND_S = 900.0
# rounds of timed exchanges (one per route, after one untimed) when the store chooses a
# route (server_update='auto'): a round more while the two routes are close
# (RouteCosts.close), as one exchange of a large model at 1 Gbit/s can be 30% off its
# median; each costs the first step seconds there
ROUTE_MAX_ROUNDS = 3
# the probe layers of hylo's route are named so (their own keys, residuals and stats)
ROUTE_PROBE_PREFIX = "__hylo_route_probe__/"
# Memory of the route choice, in bytes per element of the Trainer's parameters on every
# worker (estimates). The probes at once: the hylo probe's random gradients, residuals,
# velocity, previous aggregate and the step's new velocity (5 x 4), the dense probe's
# pushed and pulled arrays and its keys' initial values (3 x 4). Hylo's route over the
# servers' in steady state: the optimizer's momentum on the worker, and the same four
# arrays of the compressed layers (5 x 4; measured on vgg16: 4.97 GB peak per worker
# against dist_sync's 2.39, 19 bytes per element).
ROUTE_PROBE_BYTES_PER_ELEMENT = 32
ROUTE_WORKERS_BYTES_PER_ELEMENT = 20
# the share of rank 0's host's available memory the probes (or hylo's route) may take,
# every worker counted on that host (the bound where they share it, as in one-machine
# jobs): vgg16's probes, 4 workers, would need 17.7 GB, and ran a 24 GiB machine out
# of memory at the first step
ROUTE_MEMORY_SHARE = 0.8
# float32 elements of a probe layer's random gradient drawn at a time (16 MB of host
# memory, not the layer's: vgg16's fc6 drawn whole took 1.6 GB per worker)
PROBE_DRAW_ELEMENTS = 1 << 22
# optimizers whose update is elementwise and per index: a parameter cut in pieces over
# the servers is updated exactly as a whole one (a layer-wise rule such as LARS is not;
# nor Nadam, whose momentum schedule advances with every update call)
ELEMENTWISE_OPTIMIZERS = ("SGD", "NAG", "Signum", "Adam", "AdaGrad", "RMSProp",
                          "AdaDelta", "Adamax", "Ftrl", "FTML")


class Layer:
    """A key's plan and compressor, fixed at the key's first use."""
    __slots__ = ("key", "plan", "compressor")

    def __init__(self, key, plan, compressor):
        self.key, self.plan, self.compressor = key, plan, compressor


def _random_gradient(shape, rng):
    """A float32 NDArray of ``shape`` drawn from N(0, 0.01) by ``rng`` (a numpy
    Generator), PROBE_DRAW_ELEMENTS at a time: a probe's stand-in gradient."""
    out = mx.nd.empty(shape)
    flat = out.reshape((-1,))
    size = flat.shape[0]
    for lo in range(0, size, PROBE_DRAW_ELEMENTS):
        hi = min(size, lo + PROBE_DRAW_ELEMENTS)
        flat[lo:hi] = rng.standard_normal(hi - lo, dtype=np.float32) * np.float32(0.01)
    return out


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def plan_options_given(policy, size_threshold, conv_rate, compress_pull, distributed):
    """The options among these that a user set to something other than its default:
    names, in order. They fix the plan as given (the cost model, with
    cost_model='auto', then leaves it alone); an option given at its default value
    behaves as the default."""
    given = (("policy", bool(policy)),
             ("size_threshold", size_threshold is not None
              and size_threshold != DEFAULT_SIZE_THRESHOLD),
             ("conv_rate", conv_rate is not None),
             ("compress_pull", compress_pull_mode(compress_pull, distributed)
              != compress_pull_mode("auto", distributed)))
    return [name for name, differs in given if differs]


def _steps_option(name, value, default):
    """A count of steps given as option ``name``: ``default`` for None, else a
    non-negative int (an error naming the option otherwise)."""
    if value is None:
        return default
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError("%s must be a non-negative int, got %r" % (name, value))
    return int(value)


class Hylo(KVStoreBase):
    """Hylo layer-aware gradient compression as an MXNet kvstore.

    Options (see kvstore.policy for the rule they tune):
      size_threshold: layers with fewer elements travel uncompressed (None: 8192).
      conv_rate: None for the layer-adaptive rate, or a fixed fraction of filters.
      policy: dict of name regex -> 'conv_topk' | 'fc_2bit' | 'none', tried in order.
      max_conv_rate, min_conv_rate: bounds of the adaptive conv rate.
      threshold_scale: the 2-bit threshold is this times mean |gradient + residual|.
      compress_pull: how the servers return compressed layers' aggregates: 'gather'
        (the workers' own payloads, gathered: exact, about W times the pushed bytes),
        True / 'layer' (re-compressed with the layer's own codec family, the servers
        keeping what they do not send in residuals of their own: fewest bytes, slower
        convergence), '2bit' (every compressed layer's aggregate as 2-bit), or False
        (dense float32, Hylo as published). The default 'auto' is 'gather' over the
        parameter server and False in one process, where there is no pull to save
        (README, "Accuracy", says why); kvstore.policy.compress_pull_mode.
      warmup_steps: a compressed layer's first this many exchanges travel uncompressed
        (None: DEFAULT_WARMUP_STEPS, 30): early training is where error feedback's delay costs the most
        per step (README, "Accuracy"); 0 turns it off. Counted per layer, checkpointed.
      momentum_correction: 'auto' (default: on when a gluon.Trainer with MXNet's 'sgd'
        optimizer and momentum > 0 drives the store), True (the same, and an error if
        the Trainer's optimizer is not such), False (plain error feedback, Hylo as
        published); see kvstore.momentum.
      momentum_masking: with momentum correction, zero the velocity of what was sent
        (DGC's momentum factor masking). Default False: masking takes most of the
        momentum from layers whose values are sent often, which slowed conv nets per
        step (kvstore.momentum says by how much; README, "Accuracy").
      transport: 'auto' (the parameter server when this process is an MXNet worker,
        DMLC_ROLE=worker; Horovod when horovodrun started it; in-process otherwise),
        'local', 'ps' or 'horovod' (ring allreduce and allgather, no servers, no
        compressed pull: kvstore.transport_horovod).
      cost_model: 'auto' (default: over the parameter server and over Horovod, unless
        policy, size_threshold, conv_rate or compress_pull is given a value other than
        its default, which then rule alone; a default given explicitly is the default),
        True, or False. At start-up the workers time dense exchanges of two probe sizes
        and rank 0 times the codecs; a layer the policy would compress travels dense
        where the model predicts compression does not save at least 10% of its
        exchange time (a fast network). Every worker uses rank 0's numbers, so all
        reach the same plan; stats()['cost_model'] has each layer's prediction.
      cost_recheck_steps: with the cost model, measure again every this many Trainer
        steps (None: DEFAULT_COST_RECHECK_STEPS, 1000; 0: only at start-up) and re-plan:
        a network that got faster or slower mid-run is seen within that many steps. A
        layer that leaves its codec sends its residual with its next exchange; see
        recheck_costs.
      cost_drift: with the cost model, also measure again, at once, when conditions
        change: every DRIFT_CHECK_STEPS (50) steps the workers take rank 0's answer to
        "has the median exchange of the last 20 steps become this many times slower or
        faster than right after the last measurement?" (None: DEFAULT_COST_DRIFT, 2.0;
        0: off; kvstore.cost_model.ExchangeDrift).
      overlap: 'auto' (default), True or False. On: the exchange takes the layers in
        the order backward writes their gradients (kvstore.readiness): each layer is
        encoded and pushed as soon as its gradient exists, while backward goes on, and
        its pull is issued at once. 'auto' is on where the transport can take layers
        in any order (parameter server, in-process) and mxhylo's operator library is
        loaded; otherwise the layers go in the order given (a Trainer's: last first).
        False: the exchange starts once every gradient is written (no overlap), then
        goes in the order given. The results are bitwise the same either way.
      server_update: where a gluon.Trainer's optimizer runs, over the parameter server:
        'auto' (default), True or False. On the servers (kvstore.server_route), every
        layer travels dense as with MXNet's dist_sync: gradients pushed, the servers
        sum them and update once, weights pulled; on the workers, hylo's exchange.
        'auto' chooses at the Trainer's first step, from one step's exchange timed
        both ways on the Trainer's own parameters (every worker at once, rank 0's
        figures; kvstore.cost_model.RouteCosts), and keeps the choice for the run: the
        servers where hylo, as this store's options plan it, would not be at least
        10% faster (a fast network). Options that make the plan explicit (policy,
        compress_pull=False, ...) are timed as given: their route is measured too.
        Not with cost_model=False (no measurement: the workers), and only where the
        servers can do the update as the workers would: a Trainer not given
        update_on_kvstore=False, an elementwise optimizer of MXNet's
        (ELEMENTWISE_OPTIMIZERS; not LARS), float32 parameters without
        multi_precision. True: the servers always (an error where they cannot);
        False: the workers always. On the servers' route trainer.save_states cannot
        save the optimizer's state (it lives on the servers, as with dist_sync);
        stats()['route'] says which route was taken and why.
      chunk_elements, bucket_bytes, split_elements, stall_timeout: parameter-server
        transport options (largest piece of a layer in one key; size of the buckets
        small layers are fused into; elements on the wire from which a layer is cut
        over the servers, by default 262 144 or the cost model's larger figure
        (kvstore.cost_model.LinkCosts); seconds an exchange may
        take before the worker ends with an error naming the keys and servers still
        owed: None derives it from the step times, 0 turns it off; kvstore.watchdog).
    """
    kv_type = "hylo"

    def __init__(self, size_threshold=None, conv_rate=None, policy=None, max_conv_rate=0.1,
                 min_conv_rate=0.01, threshold_scale=1.0, compress_pull="auto",
                 momentum_correction="auto", momentum_masking=False, warmup_steps=None,
                 cost_model="auto", cost_recheck_steps=None, cost_drift=None,
                 overlap="auto", server_update="auto",
                 transport="auto", **transport_options):
        if cost_model not in ("auto", True, False):
            raise ValueError("cost_model must be 'auto', True or False, got %r"
                             % (cost_model,))
        if transport == "auto":
            transport = "ps" if os.environ.get("DMLC_ROLE") == "worker" else \
                "horovod" if launched_by_horovodrun() else "local"
        distributed = transport == "ps"
        explicit = plan_options_given(policy, size_threshold, conv_rate, compress_pull,
                                      distributed)
        if size_threshold is None:
            size_threshold = DEFAULT_SIZE_THRESHOLD
        self.policy = LayerPolicy(size_threshold=size_threshold, conv_rate=conv_rate,
                                  policy=policy, max_conv_rate=max_conv_rate,
                                  min_conv_rate=min_conv_rate, threshold_scale=threshold_scale)
        self.compressors = make_compressors(threshold_scale)
        self.compress_pull = compress_pull_mode(compress_pull, distributed=distributed)
        if momentum_correction not in ("auto", True, False):
            raise ValueError("momentum_correction must be 'auto', True or False, got %r"
                             % (momentum_correction,))
        self.momentum_correction = momentum_correction
        if momentum_masking not in (True, False):
            raise ValueError("momentum_masking must be True or False, got %r"
                             % (momentum_masking,))
        self.momentum_masking = bool(momentum_masking)
        if server_update not in ("auto", True, False):
            raise ValueError("server_update must be 'auto', True or False, got %r"
                             % (server_update,))
        self.server_update = server_update
        self.route = None         # RouteChoice, once a Trainer's first step chose it
        self.warmup_steps = _steps_option("warmup_steps", warmup_steps,
                                          DEFAULT_WARMUP_STEPS)
        self.cost_recheck_steps = _steps_option("cost_recheck_steps", cost_recheck_steps,
                                                DEFAULT_COST_RECHECK_STEPS)
        self._trainer_steps = 0   # exchange_step calls: when to measure the costs again
        if cost_drift is None:
            cost_drift = DEFAULT_COST_DRIFT
        if isinstance(cost_drift, bool) or not isinstance(cost_drift, (int, float)) \
                or not (cost_drift == 0 or cost_drift > 1):
            raise ValueError("cost_drift must be None, 0 (off) or a factor > 1, got %r"
                             % (cost_drift,))
        self._drift = None        # ExchangeDrift, with the cost model and cost_drift
        self._rechecks = {"periodic": 0, "drift": 0}     # measurements since start-up
        self._momentum = None     # MomentumContext during a Trainer's step, else None
        self.memory = ResidualMemory()
        self.traffic = TrafficStats()
        self._layers = {}
        self._aggregates = {}
        self._trainer = None      # weakref of the attached gluon.Trainer (trainer_hook)
        self.transport = self._make_transport(transport, transport_options)
        self._order = self._overlap_option(overlap)
        # how compressed payloads come back, in the cost model's terms (kvstore.cost_model)
        self._cost_pull = "allgather" if transport == "horovod" else self.compress_pull
        if self.transport.num_workers > 1 or transport == "ps":
            active.set_active(self)
        self._cost_option = cost_model
        use_model = cost_model is True or (cost_model == "auto" and not explicit
                                           and transport in ("ps", "horovod"))
        self.cost = None            # (the probes themselves are planned without it)
        if use_model:
            self.cost = self._measure_costs()
            if cost_drift:
                self._drift = ExchangeDrift(cost_drift, DRIFT_WINDOW)

    def _make_transport(self, transport, options):
        if transport == "local":
            if options:
                raise TypeError("unknown options for the in-process hylo store: %s"
                                % ", ".join(sorted(options)))
            return LocalTransport(self.compress_pull, self.policy.threshold_scale)
        if transport == "ps":
            from .transport_ps import PSTransport     # workers only (not servers)
            return PSTransport(compress_pull=self.compress_pull,
                               threshold_scale=self.policy.threshold_scale,
                               warmup=self.warmup_steps > 0, **options)
        if transport == "horovod":
            from .transport_horovod import HorovodTransport    # needs horovod.mxnet
            if options:
                raise TypeError("unknown options for the hylo store over Horovod: %s"
                                % ", ".join(sorted(options)))
            return HorovodTransport(compress_pull=self.compress_pull)
        raise ValueError("transport must be 'auto', 'local', 'ps' or 'horovod', got %r"
                         % (transport,))

    def _overlap_option(self, overlap):
        """The overlap option resolved for this transport: the order the exchange
        takes the layers in, 'written' (as backward writes their gradients), 'given'
        (the order of the call: a Trainer's, last layer first) or 'after' (as given,
        once every gradient is written)."""
        if overlap not in ("auto", True, False):
            raise ValueError("overlap must be 'auto', True or False, got %r" % (overlap,))
        if overlap is True and not self.transport.any_order:
            raise ValueError("overlap=True needs a transport that takes layers in any "
                             "order; %s does not" % type(self.transport).__name__)
        if overlap is True and not readiness.available():
            raise ValueError("overlap=True needs mxhylo's operator library, which is not "
                             "loaded (mxhylo.ops.backend() is 'reference')")
        if overlap is False:
            return "after"
        if overlap == "auto" and not (self.transport.any_order and readiness.available()):
            return "given"
        return "written"

    @property
    def overlap(self):
        """Whether the exchange takes the layers as backward writes their gradients."""
        return self._order == "written"

    def _encode_order(self, layers, values):
        """Item indices in the order to encode them (see _overlap_option)."""
        if self._order == "after":
            for vals in values:
                for v in vals:
                    v.wait_to_read()
        if self._order != "written" or len(layers) == 1:
            return range(len(layers))
        return readiness.ReadyOrder(values, [l.plan.name for l in layers],
                                    GRADIENT_WAIT_BOUND_S)

    # -- KVStoreBase contract ------------------------------------------------------------

    @property
    def type(self):
        return self.kv_type

    @property
    def rank(self):
        return self.transport.rank

    @property
    def num_workers(self):
        return self.transport.num_workers

    @staticmethod
    def is_capable(capability):
        """hylo updates on the workers: it has no server-side 'optimizer' capability."""
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError("Unknown capability: {}".format(capability))

    def set_optimizer(self, optimizer):
        raise NotImplementedError(
            "the hylo kvstore compresses gradients and updates on the workers; it runs no "
            "optimizer on the servers. Use gluon.Trainer (update_on_kvstore=False).")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError("hylo keeps no optimizer state; the Trainer does "
                                  "(trainer.save_states). Residuals: kv.save_residuals.")

    def load_optimizer_states(self, fname):
        raise NotImplementedError("hylo keeps no optimizer state; the Trainer does "
                                  "(trainer.load_states). Residuals: kv.load_residuals.")

    def set_gradient_compression(self, compression_params):
        raise ValueError("the hylo kvstore does its own layer-aware compression; pass its "
                         "options to mxhylo.create(...) instead of compression_params")

    def broadcast(self, key, value, out, priority=0):
        """Make every array of ``out`` equal to rank 0's ``value`` for ``key`` (or keys)."""
        keys, values, outs = self._normalize(key, value, out, "broadcast")
        for k, vals, os_ in zip(keys, values, outs):
            if len(vals) != 1:
                raise ValueError("broadcast of key %r takes one value, got %d" % (k, len(vals)))
            layer = self._layer(k, vals[0].shape)
            self.transport.init(layer, vals[0])
            self.transport.broadcast(layer, vals[0], os_)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` over devices and workers through compression; write into ``out``.

        key: int or str, or a list of them; value: NDArray or list of NDArrays (one per
        device) per key; out: the same shapes, or None to write the result into value.
        """
        keys, values, outs = self._normalize(key, value, out, "pushpull")
        layers = [self._layer(k, vals[0].shape) for k, vals in zip(keys, values)]
        aggregates = self._aggregate_into(layers, values, outs)

        warm = [self._warming_up(layer) for layer in layers]
        corrected = [self._momentum is not None and not w and self._corrects(layer)
                     for layer, w in zip(layers, warm)]

        order = []                       # item indices, in the order encoded
        encode_s = [0.0] * len(layers)   # per item: seconds of this step's encode

        def encode_each():                                  # 1. reduce, 2. encode
            # a generator: the transport pushes each layer as soon as it is encoded,
            # and the layers come as backward writes their gradients (_encode_order)
            for i in self._encode_order(layers, values):
                layer, vals, agg, mc, w = layers[i], values[i], aggregates[i], \
                    corrected[i], warm[i]
                order.append(i)
                clock = time.perf_counter()
                grad = self._reduce(vals)
                if mc:      # the codec sends velocity (kvstore.momentum)
                    grad = momentum_correction.accumulate(layer.plan.name, grad,
                                                          self.memory, self._momentum)
                compressor = self.compressors["none"] if w else layer.compressor
                send = grad
                if layer.plan.strategy == "none":
                    # a layer re-planned dense (recheck_costs) sends what its codec
                    # still owed, once: nothing waits in a residual no codec reads
                    owed = self.memory.pop_codec_state(layer.plan.name)
                    if owed is not None:
                        send = grad.astype(np.float32, copy=False) + owed
                payload = compressor.encode(layer.plan, send, self.memory)
                if mc:      # the velocity runs on (masked where sent, if asked)
                    momentum_correction.keep_velocity(
                        layer.plan.name, grad, payload, layer.compressor, self.memory,
                        masking=self.momentum_masking)
                encode_s[i] = time.perf_counter() - clock
                self.traffic.time("encode", clock)
                yield layer, payload, agg

        clock = start = time.perf_counter()
        self.transport.prepare(layers)      # keys are made before the first push
        in_order = self.transport.exchange(encode_each())                # 3. exchange
        traffic = [None] * len(layers)      # (the transport reports in encode order)
        for i, t in zip(order, in_order):
            traffic[i] = t
        clock = self.traffic.time("exchange", clock)
        for layer, agg, mc, w in zip(layers, aggregates, corrected, warm):
            if w:
                self.memory.set_scalar(layer.plan.name, "warmup_done",
                                       (self.memory.scalar(layer.plan.name, "warmup_done")
                                        or 0) + 1)
            if mc:
                momentum_correction.correct(layer.plan.name, agg, self.memory,
                                            self._momentum)
        self.transport.wait(layers, aggregates, traffic)   # bounded: kvstore.watchdog
        clock = self.traffic.time("wait", clock)
        for layer, t, enc in zip(layers, traffic, encode_s):
            self.traffic.record(layer.plan, t.pushed, t.pulled, t.messages, t.per_server,
                                seconds=enc + t.pull_s,
                                push_s=None if t.pushed_at is None else t.pushed_at - start)
        for agg, os_ in zip(aggregates, outs):                           # 4. write
            for o in os_:
                if o is agg:
                    continue
                if o.dtype == agg.dtype:
                    agg.copyto(o)
                else:
                    o[:] = agg.astype(o.dtype)
        self.traffic.time("write", clock)

    def _aggregate_into(self, layers, values, outs):
        """Where each key's float32 aggregate is assembled.

        Its first output itself when that is float32 on the first value's device and no
        output of this call is another key's input (an in-process decode of key A into
        an array that key B still has to read would change B's input); a buffer
        otherwise.
        """
        inputs = [{v.handle.value for v in vals} for vals in values]
        every_input = set().union(*inputs) if inputs else set()
        aliased = any(o.handle.value in every_input - mine
                      for os_, mine in zip(outs, inputs) for o in os_)
        aggregates = []
        for layer, vals, os_ in zip(layers, values, outs):
            ctx = vals[0].context
            first = os_[0]
            if not aliased and first.dtype == np.float32 and first.context == ctx:
                aggregates.append(first)
            else:
                aggregates.append(self._aggregate_buffer(layer, ctx))
        return aggregates

    # -- the Trainer's side (kvstore.trainer_hook) ---------------------------------------

    def attach_trainer(self, trainer):
        """Called when a gluon.Trainer takes this store: its parameter names name the
        int keys (parameter indices) from then on, for the policy's regexes, stats()
        and errors. A store serves one Trainer (keys are that Trainer's indices): a
        second one gets an error that says so, not a key clash at its first step."""
        attached = self._trainer() if self._trainer is not None else None
        if attached is not None and attached is not trainer:
            raise ValueError(
                "this hylo store already serves another gluon.Trainer; a hylo store "
                "serves one Trainer (its keys are that Trainer's parameter indices): "
                "train these parameters with the first Trainer")
        self._trainer = weakref.ref(trainer)

    def route_for(self, trainer):
        """The store ``trainer`` exchanges through instead of this one: a
        kvstore.server_route.ServerUpdateStore where its optimizer runs on the servers
        (the server_update option), else None. Called by kvstore.trainer_hook once
        Gluon has made the Trainer's store (at its first step), on every worker."""
        refused = self._route_refused(trainer)
        if self.server_update is False:
            self.route = RouteChoice("workers", "server_update=False")
        elif self.server_update is True:
            if refused:
                raise ValueError("server_update=True, but " + refused)
            self.route = RouteChoice("servers", "server_update=True")
        elif refused or self._cost_option is False:
            self.route = RouteChoice("workers", refused or "cost_model=False")
        else:
            self.route = self._choose_route(trainer)
        if self.route.route == "workers":
            return None
        return self.transport.server_route(trainer._params)

    def _route_refused(self, trainer):
        """Why ``trainer``'s optimizer cannot run on the servers, or None."""
        if self.transport.num_servers == 0:
            return "%s has no servers" % type(self.transport).__name__
        if trainer._kvstore_params.get("update_on_kvstore") is False:
            return "the Trainer was given update_on_kvstore=False"
        optimizer = trainer._optimizer
        if type(optimizer).__name__ not in ELEMENTWISE_OPTIMIZERS or \
                type(optimizer).__module__.split(".")[0] != "mxnet":
            return ("its optimizer %s is not one of MXNet's elementwise ones (%s): a "
                    "parameter cut over the servers would not be updated as a whole one"
                    % (type(optimizer).__name__, ", ".join(ELEMENTWISE_OPTIMIZERS)))
        if getattr(optimizer, "multi_precision", False):
            return "its optimizer has multi_precision (the servers update float32 only)"
        for param in trainer._params:
            if param.grad_req != "null" and np.dtype(param.dtype) != np.float32:
                return "parameter %s is %s, not float32" % (param.name,
                                                           np.dtype(param.dtype).name)
        return None

    def _choose_route(self, trainer):
        """The RouteChoice of ``trainer``'s parameters (collective; rank 0's figures):
        timed (_time_routes, reason 'measured') where the probes fit in memory, else
        predicted by the cost model (_predict_routes), and hylo's route only where its
        own state fits too (ROUTE_*_BYTES_PER_ELEMENT, ROUTE_MEMORY_SHARE): a route
        choice that runs the job out of memory would cost the user the job."""
        elements = sum(int(np.prod(p.shape)) for p in trainer._params
                       if p.grad_req != "null")
        workers, gib = self.transport.num_workers, float(1 << 30)
        update_s, available = (float(v) for v in self.transport.share_from_rank0(
            [time_update(trainer._optimizer, elements), available_memory_bytes() / gib]))
        room = ROUTE_MEMORY_SHARE * available
        probes = ROUTE_PROBE_BYTES_PER_ELEMENT * elements * workers / gib
        if probes <= room:
            costs = self._time_routes(trainer, update_s)
            return RouteChoice(costs.route(), "measured", costs)
        why = ("the route probes would need %.1f GiB of the %.1f GiB available on rank "
               "0's host" % (probes, available))
        costs = self._predict_routes(trainer, update_s)
        if costs is None:
            return RouteChoice("servers", why + "; no cost model to predict by")
        hylo_route = ROUTE_WORKERS_BYTES_PER_ELEMENT * elements * workers / gib
        if costs.route() == "workers" and hylo_route > room:
            return RouteChoice("servers", "%s; hylo's route would hold %.1f GiB more"
                               % (why, hylo_route), costs)
        return RouteChoice(costs.route(), "predicted: " + why, costs)

    def _predict_routes(self, trainer, update_s):
        """RouteCosts of ``trainer``'s parameters by the cost model alone (no probe;
        None without a cost model): the servers' route as every layer dense, hylo's as
        each layer is planned, each the sum over the layers of CostModel.predict (which
        leaves out overlap between layers, alike on both sides)."""
        if self.cost is None:
            return None
        momentum = self._momentum_context(trainer) is not None
        dense_s = hylo_s = 0.0
        for param in trainer._params:
            if param.grad_req == "null":
                continue
            shape = tuple(param.shape)
            dense = self.cost.predict(self.policy.plan_as(param.name, shape, "none"), 0)
            dense_s += dense.dense_s
            plan = self.policy.plan(param.name, shape)
            if plan.strategy in self.cost.codecs:
                nbytes = self.compressors[plan.strategy].payload_nbytes(plan)
                pred = self.cost.predict(plan, nbytes, momentum)
                hylo_s += pred.codec_s if pred.strategy != "none" else pred.dense_s
            else:
                hylo_s += dense.dense_s
        return RouteCosts(dense_s, hylo_s, update_s, self.transport.num_servers,
                          rounds=0, predicted=True)

    def _time_routes(self, trainer, update_s):
        """RouteCosts of ``trainer``'s parameters (collective; rank 0's figures), its
        optimizer's update taking ``update_s``: each route's median over rounds of one
        timed exchange each, a round more while the two are close (RouteCosts.close),
        up to ROUTE_MAX_ROUNDS. Hylo's route is timed first: where it beats even the
        floor of the dense exchange (the cost model's links, LinkCosts.dense_floor_s)
        the dense one is not timed, which at 1 Gbit/s takes seconds and a model copy on
        every worker and server. The probes' keys, residuals and traffic are their
        own."""
        params = [p for p in trainer._params if p.grad_req != "null"]
        shapes = [tuple(p.shape) for p in params]
        traffic, memory, self.traffic, self.memory = \
            self.traffic, self.memory, TrafficStats(), ResidualMemory()
        servers = self.transport.num_servers
        try:
            with self._hylo_probe([p.name for p in params], shapes, trainer) as time_hylo:
                hylo, dense = [time_hylo(warmup=True)], []
                links = self.cost.links if self.cost is not None else None
                if links is not None:      # (rank 0's: the same on every worker)
                    floor = links.dense_floor_s(4 * sum(int(np.prod(s)) for s in shapes))
                    figures = self.transport.share_from_rank0([floor, hylo[0]])
                    costs = RouteCosts(*[float(v) for v in figures], update_s=update_s,
                                       servers=servers, dense_bound=True)
                    if costs.route() == "workers":
                        return costs
                while True:
                    dense.append(self.transport.time_dense(shapes, warmup=not dense))
                    if len(hylo) < len(dense):
                        hylo.append(time_hylo(warmup=False))
                    figures = self.transport.share_from_rank0(
                        [np.median(dense), np.median(hylo)])
                    costs = RouteCosts(*[float(v) for v in figures], update_s=update_s,
                                       servers=servers, rounds=len(dense))
                    if len(dense) >= ROUTE_MAX_ROUNDS or not costs.close():
                        return costs
        finally:
            self.traffic, self.memory = traffic, memory

    @contextlib.contextmanager
    def _hylo_probe(self, names, shapes, trainer):
        """Probe layers of their own for random gradients of ``shapes``, each planned as
        layer ``names[i]`` will be (compressed past its warm-up, with momentum
        correction if the Trainer's optimizer asks for it); yields a function that
        returns the seconds of one hylo exchange of them (after one untimed with
        warmup=True)."""
        rng = np.random.default_rng(0)
        keys, values = [], []
        momentum = self._momentum_context(trainer)

        def exchange():
            self._momentum = momentum
            try:
                clock = time.perf_counter()
                self.pushpull(keys, values)     # (in place: one copy of the model)
                for v in values:
                    v.wait_to_read()
                return time.perf_counter() - clock
            finally:
                self._momentum = None

        def timed(warmup):
            if warmup:
                exchange()
            return exchange()
        try:
            self._momentum = momentum               # (_plan prices momentum)
            for name, shape in zip(names, shapes):
                plan = dataclasses.replace(self._plan(name, shape),
                                           name=ROUTE_PROBE_PREFIX + name)
                key = plan.name
                self._layers[key] = Layer(key, plan, self.compressors[plan.strategy])
                self.memory.set_scalar(plan.name, "warmup_done", self.warmup_steps)
                keys.append(key)
                values.append(_random_gradient(shape, rng))
            self._momentum = None
            for key, value in zip(keys, values):    # their keys (no broadcast)
                self.transport.init(self._layers[key], value, probe=True)
            yield timed
        finally:
            self._momentum = None
            for key in keys:
                del self._layers[key]

    def exchange_step(self, trainer):
        """Exchange every gradient of ``trainer``'s step in one call (what the Trainer's
        _allreduce_grads does one key at a time), with its optimizer's momentum.

        One call: small layers travel fused in buckets. Called while backward still
        runs (Gluon's step follows backward(), which returns at once): the layers
        travel as backward writes their gradients (the overlap option), else last
        layer first, the order in which MXNet's engine mostly writes them. The order
        changes no value (every layer's sum is its own).
        """
        self.attach_trainer(trainer)
        # (Gluon refuses sparse gradients with a KVStoreBase store: all are dense)
        keys = [i for i, p in enumerate(trainer._params) if p.grad_req != "null"]
        keys.reverse()          # in the order backward produces them
        grads = [trainer._params[i].list_grad() for i in keys]
        self._momentum = self._momentum_context(trainer)
        try:
            self._trainer_steps += 1
            reason = self._recheck_due()
            if reason:
                self.recheck_costs()     # (with this step's momentum: _plan prices it)
                self._rechecks[reason] += 1
            clock = time.perf_counter()
            self.pushpull(keys, grads)
            if self._drift is not None:
                self._drift.add(time.perf_counter() - clock)
        finally:
            self._momentum = None

    def _recheck_due(self):
        """Why this Trainer step measures the cost model again: 'periodic' (every
        cost_recheck_steps steps), 'drift' (at a drift check where rank 0's exchanges
        have drifted; collective: every worker takes rank 0's answer at the same
        step), or None."""
        if self.cost is None:
            return None
        step = self._trainer_steps
        if self.cost_recheck_steps and step % self.cost_recheck_steps == 0:
            return "periodic"
        if self._drift is None or step % DRIFT_CHECK_STEPS:
            return None
        drifted = float(self._drift.drifted()) if self.rank == 0 else 0.0
        return "drift" if self.transport.share_from_rank0([drifted])[0] > 0.5 else None

    def _corrects(self, layer):
        """Whether momentum correction applies to ``layer``: a compressed layer, or one
        re-planned dense after its velocity lived here (without masking). That layer's
        velocity runs on and goes out whole each step: the optimizer's momentum buffer
        stays the telescoped sum it was (kvstore.momentum), which is dense momentum SGD
        exactly once nothing is owed."""
        if layer.plan.strategy != "none":
            return True
        return (not self.momentum_masking
                and self.memory.scalar(layer.plan.name, "previous_rescale") is not None)

    def _warming_up(self, layer):
        """Whether this exchange of a compressed layer is one of its warm-up steps."""
        if layer.plan.strategy == "none" or not self.warmup_steps:
            return False
        return (self.memory.scalar(layer.plan.name, "warmup_done") or 0) < self.warmup_steps

    def _momentum_context(self, trainer):
        """The MomentumContext of this step, or None (see the momentum_correction option)."""
        if self.momentum_correction is False:
            return None
        ctx = momentum_correction.from_optimizer(trainer._optimizer)
        if ctx is None and self.momentum_correction is True:
            raise ValueError("momentum_correction=True needs a Trainer with MXNet's 'sgd' "
                             "optimizer and momentum > 0; this one has %s (momentum %r)"
                             % (type(trainer._optimizer).__name__,
                                getattr(trainer._optimizer, "momentum", None)))
        return ctx

    # -- hylo's own API ------------------------------------------------------------------

    def stats(self):
        """Traffic so far: steps, bytes_pushed, bytes_pulled, dense_bytes (bytes), ratio,
        messages, bytes_per_server, and per layer (by parameter name): policy, shape, k,
        rate, bytes (pushed in all), last_bytes (last step), dense_bytes, ratio, seconds
        and last_seconds (what the layer cost this worker: its encode, and its pull's
        wait and decode), last_push_s (when its push left in the last exchange, in
        seconds from the exchange's start). With the cost model, ``cost_model['layers']``: per layer its
        choice (strategy), the predicted seconds dense_s and codec_s, and measured_s
        (its last_seconds); ``cost_model['rechecks']``: measurements since start-up,
        'periodic' and 'drift'."""
        out = self.traffic.as_dict()
        out.update(type=self.type, rank=self.rank, num_workers=self.num_workers,
                   options=dict(self.policy.options(), compress_pull=self.compress_pull,
                                momentum_correction=self.momentum_correction,
                                momentum_masking=self.momentum_masking,
                                warmup_steps=self.warmup_steps, overlap=self.overlap,
                                cost_model=self.cost is not None,
                                server_update=self.server_update))
        # where a Trainer's optimizer runs (route_for); None before a Trainer's step
        out["route"] = None if self.route is None else self.route.as_dict()
        if self.cost is not None:
            out["cost_model"] = {
                "latency_s": self.cost.wire.latency_s,
                "per_byte_s": self.cost.wire.per_byte_s,
                "codecs": {s: vars(c) for s, c in self.cost.codecs.items()},
                "momentum_s": self.cost.momentum_s,
                # each aggregation link alone, and what one more message costs
                "links": None if self.cost.links is None else
                [vars(l) for l in self.cost.links.links],
                "message_s": None if self.cost.links is None else self.cost.links.message_s,
                "split_elements": self.transport.split_elements,
                # measurements since start-up, by cause (cost_recheck_steps, cost_drift)
                "rechecks": dict(self._rechecks),
                # each layer's choice, its predicted seconds (dense and with its codec)
                # and what its last exchange measured (encode + pull_s, kvstore.transport)
                "layers": {name: dict(vars(p), measured_s=out["layers"].get(name, {})
                                      .get("last_seconds"))
                           for name, p in self.cost.decisions.items()}}
        return out

    def plans(self):
        """Parameter name -> LayerPlan of every key seen so far."""
        return {layer.plan.name: layer.plan for layer in self._layers.values()}

    def save_residuals(self, fname):
        """Save this worker's residuals and codec state, and with compress_pull the
        servers' (part of a checkpoint). Distributed, every worker calls it at the same
        point of training, as it calls pushpull: the servers' state is pulled then."""
        state = self.memory.state_dict()
        for name, (residual, thresholds) in self.transport.server_state().items():
            state[_SERVER_RESIDUAL + name] = mx.nd.array(residual, dtype=np.float32)
            state[_SERVER_THRESHOLDS + name] = mx.nd.array(
                [np.nan if t is None else t for t in thresholds] or [np.nan],
                dtype=np.float64)
        mx.nd.save(fname, state)

    def load_residuals(self, fname):
        """Restore what save_residuals wrote (before the next pushpull); distributed,
        every worker loads its own file and the servers' state comes back with the next
        exchange."""
        state = mx.nd.load(fname)
        # mx.nd.save of an empty dict loads back as an empty list
        state = state if isinstance(state, dict) else {}
        server = {}
        for key in [k for k in state if k.startswith(_SERVER_RESIDUAL)]:
            name = key[len(_SERVER_RESIDUAL):]
            thresholds = state.pop(_SERVER_THRESHOLDS + name).asnumpy()
            server[name] = (state.pop(key).asnumpy(),
                            [None if np.isnan(t) else float(t) for t in thresholds])
        if server and self.compress_pull is None:
            raise ValueError("%s holds the servers' residuals of a compressed-pull run; "
                             "create the store with the same compress_pull option" % fname)
        self.memory.load_state_dict(state)
        self.transport.load_server_state(server)

    # -- internals -----------------------------------------------------------------------

    def _normalize(self, key, value, out, what):
        if isinstance(key, (list, tuple)):
            values = list(value)
            if len(values) != len(key):
                raise ValueError("%s: %d keys but %d values" % (what, len(key), len(values)))
            values = [_as_list(v) for v in values]
            if out is None:
                outs = values
            else:
                outs = [_as_list(o) for o in out]
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

    # -- the cost model (kvstore.cost_model) ---------------------------------------------

    def recheck_costs(self):
        """Measure the cost model again and re-plan every layer seen so far (collective:
        every worker calls it at the same step, between exchanges; exchange_step does
        every cost_recheck_steps steps). Each layer whose choice changes gets keys for
        its new plan. One that leaves its codec sends its residual with its next
        exchange (and with momentum correction its velocity runs on: _corrects). One
        that starts compressing starts as after its warm-up. Nothing owed is lost: a
        layer whose aggregate the servers re-compress (compress_pull 'layer' or '2bit',
        with a residual of their own) keeps its plan.
        Returns {layer name: (old strategy, new strategy)} of the layers that changed."""
        if self.cost is None:
            raise ValueError("recheck_costs needs the cost model (this store was created "
                             "with cost_model off, or with options that override it)")
        self.cost = self._measure_costs()
        if self._drift is not None:
            self._drift.reset()      # the next steps are the new baseline
        changed = {}
        for layer in list(self._layers.values()):
            plan = self._plan(layer.plan.name, layer.plan.shape)
            if plan.strategy == layer.plan.strategy:
                continue
            if pull_codec(layer.plan.strategy, self.compress_pull) in STATEFUL_PULLS:
                continue    # the servers' residual of its pull would be lost: it stays
            new = Layer(layer.key, plan, self.compressors[plan.strategy])
            self.transport.replan(layer, new)
            self._layers[layer.key] = new
            if plan.strategy != "none":        # no second warm-up mid-run
                self.memory.set_scalar(plan.name, "warmup_done", self.warmup_steps)
            changed[plan.name] = (layer.plan.strategy, plan.strategy)
        return changed

    def _measure_costs(self):
        """Time dense exchanges of the probe layers and of each link alone (every
        worker: the servers need all pushes) and, on rank 0, the codecs; the CostModel
        of rank 0's numbers, which the transport then places and cuts new keys by. The
        probes do not count in stats()."""
        traffic, self.traffic = self.traffic, TrafficStats()
        try:
            cost = self._measure_costs_now()
        finally:
            self.traffic = traffic
        self.transport.use_costs(cost)      # where the keys made from now on go
        return cost

    def _measure_costs_now(self):
        nbytes, seconds = [], []
        for n in COST_PROBE_ELEMENTS:
            key = "__hylo_cost_probe_%d__" % n
            probe = mx.nd.zeros((n,))
            self.broadcast(key, probe, probe)
            times = []
            for _ in range(COST_PROBE_REPEATS):
                clock = time.perf_counter()
                self.pushpull(key, probe)
                probe.wait_to_read()
                times.append(time.perf_counter() - clock)
            nbytes.append(4 * n)
            seconds.append(float(np.median(times[1:])))
            del self._layers[key]               # not a layer of the model: no stats
        # each link alone (collective; None without links to choose between)
        links = self.transport.time_links(LINK_PROBE_ELEMENTS, COST_PROBE_REPEATS)
        strategies = ("conv_topk", "fc_2bit")
        codecs, momentum_s = {s: CodecCost(0.0, 0.0) for s in strategies}, 0.0
        if self.rank == 0:          # (the others' figures are replaced by rank 0's)
            codecs = {s: time_codec(self.policy, self.compressors[s]) for s in strategies}
            momentum_s = time_momentum()
        values = CostModel(WireCost.fit(nbytes, seconds), codecs, self.num_workers,
                           self._cost_pull, momentum_s=momentum_s, links=links
                           ).to_array(strategies)
        shared = self.transport.share_from_rank0(values)
        return CostModel.from_array(shared, strategies, self.num_workers, self._cost_pull)

    def _plan(self, name, shape):
        """The policy's plan, made 'none' where the cost model says compression does not
        pay (and the strategy is one the model knows)."""
        plan = self.policy.plan(name, shape)
        if self.cost is None or plan.strategy not in self.cost.codecs:
            return plan
        nbytes = self.compressors[plan.strategy].payload_nbytes(plan)
        # (a layer first met in a Trainer's step knows whether its optimizer has momentum)
        momentum = self._momentum is not None and plan.strategy != "none"
        if self.cost.decide(plan, nbytes, momentum) == plan.strategy:
            return plan
        return self.policy.plan_as(name, shape, "none")

    def _layer(self, key, shape):
        layer = self._layers.get(key)
        if layer is None:
            name = self._name(key)
            plan = self._plan(name, shape)
            layer = self._layers[key] = Layer(key, plan, self.compressors[plan.strategy])
        elif layer.plan.shape != tuple(shape):
            raise ValueError("key %r (%s) was first used with shape %s, now %s"
                             % (key, layer.plan.name, layer.plan.shape, tuple(shape)))
        return layer

    def _name(self, key):
        if isinstance(key, str):
            return key
        trainer = self._trainer() if self._trainer is not None else None
        params = getattr(trainer, "_params", [])
        return params[key].name if 0 <= key < len(params) else str(key)

    @staticmethod
    def _reduce(vals):
        """Sum of the per-device arrays on the first one's device (the array itself if
        there is one: nothing writes to it before step 4, after every read)."""
        if len(vals) == 1:
            return vals[0]
        ctx = vals[0].context
        return mx.nd.add_n(*[v.as_in_context(ctx) for v in vals])

    def _aggregate_buffer(self, layer, ctx):
        agg = self._aggregates.get(layer.key)
        if agg is None or agg.context != ctx:
            agg = self._aggregates[layer.key] = mx.nd.zeros(layer.plan.shape, ctx=ctx,
                                                            dtype=np.float32)
        return agg


# checkpoint entries of the servers' state (compress_pull), beside ResidualMemory's
_SERVER_RESIDUAL = "server_residual/"
_SERVER_THRESHOLDS = "server_thresholds/"


class DistSyncHylo(Hylo):
    """The same store under a name containing 'dist', so that Gluon's Trainer keeps a
    kvstore given as the string 'dist_sync_hylo' even with a single device."""
    kv_type = "dist_sync_hylo"


def _register(name, cls):
    # MXNet's KVStoreBase.register derives the name from the class name, which cannot
    # spell 'dist_sync_hylo' in a class name worth reading; the registry is the same dict.
    KVStoreBase.kv_registry[name] = cls


_register("hylo", Hylo)
_register("dist_sync_hylo", DistSyncHylo)
trainer_hook.install(Hylo)


def create(type="hylo", **options):
    """A hylo kvstore with options (see Hylo); ``mx.kv.create(type)`` with defaults."""
    classes = {"hylo": Hylo, "dist_sync_hylo": DistSyncHylo}
    if type not in classes:
        raise ValueError("mxhylo.create: type must be 'hylo' or 'dist_sync_hylo', got %r"
                         % (type,))
    return classes[type](**options)
