"""The hylo KVStore: MXNet's KVStoreBase contract over a plan and a step pipeline.

One gradient's way, from ``trainer.step()`` to the servers and back:

1. kvstore.trainer_hook: a gluon.Trainer whose kvstore is a hylo store hands it its
   whole step (``Hylo.exchange_step``) instead of Gluon's one pushpull per key;
2. this store: the route of the plan (kvstore.plan) says where the optimizer runs. On
   the workers' route, the step goes through the StepPipeline (kvstore.pipeline):
   reduce, the layer's stages and codec (kvstore.stages, kvstore.compressors), the
   transport (kvstore.transport_ps, _horovod, _local), the stages' finish, write; on
   the servers' route, through kvstore.server_route (dense, the optimizer on the
   servers, as dist_sync);
3. kvstore.server decodes and aggregates on the parameter servers.

The plan is data (``kv.plan()``): made by kvstore.plan.make_plan, a pure function,
from the model's layers, the options (kvstore.options) and what one measurement at
start-up found (kvstore.measure). Where the route is on trial, the job's own steps
decide it (kvstore.route: the warm-up on the servers' route, compressed steps on the
workers', the faster kept). Re-planning computes a new plan from a new measurement
and switches to it between steps; the store object never changes.
"""
import os
import time
import weakref

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from . import active, readiness, trainer_hook
from . import momentum as momentum_correction
from .compressors import make_compressors
from .options import make_options
from .pipeline import StepPipeline, normalize_call
from .planner import Planner
from .policy import LayerPolicy
from .route import RouteTrial
from .stats import cost_model_stats
from .transport_horovod import launched_by_horovodrun    # (imports no horovod)
from .transport_local import LocalTransport

# whether the exchange may start before backward ends (tests turn it off to compare)
OVERLAP = True
# Every this many steps on the workers' route, the workers compare the rescale_grad
# their optimizers applied (collective, one value): each worker scales the summed
# gradient by its own trainer.step(batch_size), so workers whose batch sizes differ
# end with different weights, which must not go unsaid.
SCALE_CHECK_STEPS = 20


class Hylo(KVStoreBase):
    """Hylo layer-aware gradient compression as an MXNet kvstore.

    Options: see kvstore.options.TABLE (rendered as the README's options table). The plan:
    ``plan()``; what happened: ``stats()``.
    """
    kv_type = "hylo"

    def __init__(self, transport="auto", **options):
        if transport == "auto":
            transport = "ps" if os.environ.get("DMLC_ROLE") == "worker" else \
                "horovod" if launched_by_horovodrun() else "local"
        if transport not in ("local", "ps", "horovod"):
            raise ValueError("transport must be 'auto', 'local', 'ps' or 'horovod', got %r"
                             % (transport,))
        self.options = make_options(transport, **options)
        o = self.options
        self.policy = LayerPolicy(o.size_threshold, o.conv_rate, o.policy)
        self.compressors = make_compressors()
        self.transport = self._make_transport()
        self.pipeline = StepPipeline(self.transport, self.compressors, o.warmup_steps,
                                     self._encode_order())
        if self.transport.num_workers > 1 or transport == "ps":
            active.set_active(self)
        self._trainer = None      # weakref of the attached gluon.Trainer
        self._servers = None      # kvstore.server_route.ServerRoute on the servers' route
        self._trial = None        # kvstore.route.RouteTrial while the route is on trial
        self._steps = 0           # exchange_step calls
        self._scales = 0.0        # rescale_grad summed over those steps
        self.planner = Planner(o, self.policy, self.compressors, self.transport)

    @property
    def cost(self):
        """The CostModel of the last measurement (None: not measured)."""
        return self.planner.cost

    def _make_transport(self):
        o = self.options
        if o.transport == "local":
            return LocalTransport(o.compress_pull)
        if o.transport == "ps":
            from .transport_ps import PSTransport     # workers only (not servers)
            return PSTransport(compress_pull=o.compress_pull, stall_timeout=o.stall_timeout)
        from .transport_horovod import HorovodTransport    # needs horovod.mxnet
        return HorovodTransport(compress_pull=o.compress_pull)

    def _encode_order(self):
        """'written' (as backward writes the gradients) where the transport takes
        layers in any order and mxhylo's operator library is loaded, else 'given' (a
        Trainer's order, last layer first); 'after' (as given, once every gradient is
        written) where OVERLAP is off. The results are bitwise the same in every order."""
        if not OVERLAP:
            return "after"
        if not (self.transport.any_order and readiness.available()):
            return "given"
        return "written"

    @property
    def overlap(self):
        """Whether the exchange takes the layers as backward writes their gradients."""
        return self.pipeline.order == "written"

    @property
    def memory(self):
        return self.pipeline.memory

    @property
    def traffic(self):
        return self.pipeline.traffic

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
        """Gluon asks before its first step; the store tells a Trainer on the servers'
        route itself (kvstore.trainer_hook), so a user's update_on_kvstore=True is
        refused as with any store that updates on the workers."""
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError("Unknown capability: {}".format(capability))

    def set_optimizer(self, optimizer):
        if self._servers is None:
            raise NotImplementedError(
                "the hylo kvstore runs the optimizer on the workers on this route (the "
                "plan's route is %s); use gluon.Trainer" % self._route())
        self._servers.set_optimizer(optimizer)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Gluon's trainer.save_states where the optimizer runs on the servers: their
        optimizer state, written as Gluon writes a Trainer's (any one worker may save;
        kvstore.server_route.ServerRoute.save_states)."""
        if self._servers is None:
            raise NotImplementedError(
                "the hylo store keeps no optimizer state on this route (%s): the "
                "Trainer's optimizer runs on the workers, and trainer.save_states saves "
                "it" % self._route())
        self._servers.save_states(fname, dump_optimizer)

    def load_optimizer_states(self, fname):
        """Gluon's trainer.load_states where the optimizer runs on the servers (every
        worker calls it; kvstore.server_route.ServerRoute.load_states)."""
        if self._servers is None:
            raise NotImplementedError(
                "the hylo store keeps no optimizer state on this route (%s): the "
                "Trainer's optimizer runs on the workers, and trainer.load_states loads "
                "it" % self._route())
        self._servers.load_states(fname)

    @property
    def _updater(self):
        """Where Gluon's trainer.load_states finds the optimizer to go on with
        (``.optimizer``) when the Trainer updates on the kvstore: the servers' route's;
        None on the workers' route (Gluon keeps its own updaters)."""
        return None if self._servers is None else self._servers.updater

    def set_gradient_compression(self, compression_params):
        raise ValueError("the hylo kvstore does its own layer-aware compression; pass its "
                         "options to mxhylo.create(...) instead of compression_params")

    def broadcast(self, key, value, out, priority=0):
        """Make every array of ``out`` equal to rank 0's ``value`` for ``key`` (or keys)."""
        keys, values, outs = normalize_call(key, value, out, "broadcast")
        layers, firsts, layer_outs, routed = [], [], [], ([], [], [])
        for k, vals, os_ in zip(keys, values, outs):
            if len(vals) != 1:
                raise ValueError("broadcast of key %r takes one value, got %d" % (k, len(vals)))
            if self._servers is not None and isinstance(k, (int, np.integer)):
                for part, x in zip(routed, (k, vals, os_)):
                    part.append(x)
                continue
            layers.append(self._layer(k, vals[0].shape))
            firsts.append(vals[0])
            layer_outs.append(os_)
        # (each route's keys made at once: one barrier of the job each)
        if routed[0]:
            self._servers.broadcast(*routed, priority=priority)
        if layers:
            self.pipeline.broadcast(layers, firsts, layer_outs)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` over devices and workers through compression; write into ``out``.

        key: int or str, or a list of them; value: NDArray or list of NDArrays (one per
        device) per key; out: the same shapes, or None to write the result into value.
        """
        keys, values, outs = normalize_call(key, value, out, "pushpull")
        layers = [self._layer(k, vals[0].shape) for k, vals in zip(keys, values)]
        self.pipeline.pushpull(layers, values, outs)

    # -- the Trainer's side (kvstore.trainer_hook) ---------------------------------------

    def attach_trainer(self, trainer):
        """Called when a gluon.Trainer takes this store: its parameter names name the
        int keys (parameter indices). A store serves one Trainer: a second one gets an
        error that says so, not a key clash at its first step."""
        attached = self._trainer() if self._trainer is not None else None
        if attached is not None and attached is not trainer:
            raise ValueError(
                "this hylo store already serves another gluon.Trainer; a hylo store "
                "serves one Trainer (its keys are that Trainer's parameter indices): "
                "train these parameters with the first Trainer")
        self._trainer = weakref.ref(trainer)

    def choose_route(self, trainer):
        """Plan ``trainer``'s parameters and take the plan's route (every worker at the
        Trainer's first step, before its parameters are broadcast). On the servers'
        route the Trainer updates on the kvstore: Gluon skips its own update, and this
        store's step pulls the servers' weights. A route on trial (kvstore.route)
        starts there and is decided by the job's steps."""
        plan = self.planner.plan_trainer(trainer)
        if not plan.settled:
            self._trial = RouteTrial(self.options.warmup_steps)
        if plan.route == "servers":
            self._servers = self.transport.server_route(trainer._params)
            trainer._update_on_kvstore = True
            self._servers.set_optimizer(trainer._optimizer)

    def exchange_step(self, trainer):
        """Exchange every gradient of ``trainer``'s step in one call (what the Trainer's
        _allreduce_grads does one key at a time), with its optimizer's momentum.

        On the workers' route one call: small layers travel fused in buckets, as
        backward writes their gradients (else last layer first). On the servers'
        route, one pushpull per parameter (gradients in, weights out), after the
        optimizer's settings (its learning rate) reach the servers."""
        self.attach_trainer(trainer)
        if self._trial is not None:
            self._trial.at_step(self, trainer)      # (may move the optimizer: collective)
        # (Gluon refuses sparse gradients with a KVStoreBase store: all are dense)
        keys = [i for i, p in enumerate(trainer._params) if p.grad_req != "null"]
        keys.reverse()          # in the order backward produces them
        if self._servers is not None:
            self._servers.sync_optimizer(trainer._optimizer)
            for i in keys:
                param = trainer._params[i]
                self._servers.pushpull(i, param.list_grad(), out=param.list_data(),
                                       priority=-i)
                self.traffic.record_dense(param.name, param.shape,
                                          len(self._servers.pieces(i)))
            return
        grads = [trainer._params[i].list_grad() for i in keys]
        layers = [self._layer(k, g[0].shape) for k, g in zip(keys, grads)]
        momentum = None
        if self.options.momentum_correction is not False:
            momentum = momentum_correction.from_optimizer(trainer._optimizer)
        clock = time.perf_counter()
        self.pipeline.pushpull(layers, grads, grads, momentum)
        exchange_s = time.perf_counter() - clock
        self._steps += 1
        self._scales += float(trainer._optimizer.rescale_grad)
        if self.transport.num_workers > 1 and self._steps % SCALE_CHECK_STEPS == 0:
            self._check_same_scales()       # (not timed: it waits for the slowest worker)
        if self.planner.drifted(self._steps, exchange_s):
            self.recheck_costs()
            self.planner.rechecks["drift"] += 1

    def _check_same_scales(self):
        """Raise on every worker unless all workers' optimizers applied the same
        rescale_grad at every step so far (their sums, in float32, compared;
        collective)."""
        sums = self.transport.every_workers_value(np.float32(self._scales))
        if np.any(sums != sums[0]):
            raise ValueError(
                "the workers stepped with different batch sizes: over the %d steps so far "
                "their optimizers' rescale_grad sums to %s (by rank). Where the optimizer "
                "runs on the workers, each scales the summed gradient by its own "
                "trainer.step(batch_size), so the workers' weights now differ. Give every "
                "worker the same batch sizes (equal shards, last_batch='discard', "
                "ImageRecordIter's round_batch), or server_update=True"
                % (self._steps, ", ".join("%.6g" % s for s in sums)))

    # -- the plan ------------------------------------------------------------------------

    def plan(self):
        """The kvstore.plan.Plan in force: of the Trainer's parameters once its route
        is chosen; before that, of the keys seen so far (route 'workers')."""
        return self.planner.current(self._seen())

    def plans(self):
        """Parameter name -> LayerPlan of every key seen so far."""
        return {layer.plan.name: layer.plan for layer in self.pipeline.layers.values()}

    def recheck_costs(self):
        """Measure again and re-plan every layer seen so far (collective: every worker
        at the same step, between exchanges). A layer whose codec changes gets keys for
        its new plan; one that leaves its codec sends its residual with its next
        exchange; one that starts compressing starts as after its warm-up.
        Returns {layer name: (old strategy, new strategy)} of the layers that changed."""
        new = self.planner.replan(self._seen())
        changed = {}
        for layer in list(self.pipeline.layers.values()):
            plan = new[layer.plan.name]
            if plan.strategy != layer.plan.strategy:
                self.pipeline.replan(layer, plan)
                changed[plan.name] = (layer.plan.strategy, plan.strategy)
        return changed

    def _seen(self):
        return [(l.plan.name, l.plan.shape) for l in self.pipeline.layers.values()]

    def _layer(self, key, shape):
        layer = self.pipeline.layers.get(key)
        if layer is None:
            return self.pipeline.layer(key, self.planner.layer_plan(self._name(key), shape))
        if layer.plan.shape != tuple(shape):
            raise ValueError("key %r (%s) was first used with shape %s, now %s"
                             % (key, layer.plan.name, layer.plan.shape, tuple(shape)))
        return layer

    def _name(self, key):
        if isinstance(key, str):
            return key
        trainer = self._trainer() if self._trainer is not None else None
        params = getattr(trainer, "_params", [])
        return params[key].name if 0 <= key < len(params) else str(key)

    def _route(self):
        plan = self.planner.plan
        return "not chosen yet" if plan is None else "%s (%s)" % (plan.route,
                                                                   plan.route_reason)

    # -- what happened -------------------------------------------------------------------

    def stats(self):
        """Traffic so far: steps, bytes_pushed, bytes_pulled, dense_bytes (bytes), ratio,
        messages, bytes_per_server, and per layer (by parameter name): policy, shape, k,
        rate, bytes (pushed in all), last_bytes (last step), dense_bytes, ratio, seconds
        and last_seconds (what the layer cost this worker: its encode, and its pull's
        wait and decode), last_push_s (when its push left in the last exchange, in
        seconds from the exchange's start). ``route``: where the Trainer's optimizer
        runs and why (None before a Trainer's first step), whether that is settled
        (False while on trial: kvstore.route), the measured seconds of a step on each
        route, and the moves of the trial ((step, route), steps from 1).
        ``warming_up``: whether a layer still travels dense for its warm-up.
        ``measurement``: seconds
        spent measuring in all, and re-measurements since start-up by cause. With the
        cost model, ``cost_model``: the fitted wire, codecs, links, and per layer its
        choice (strategy), the predicted seconds dense_s and codec_s, and measured_s
        (its last_seconds)."""
        out = self.traffic.as_dict()
        out.update(type=self.type, rank=self.rank, num_workers=self.num_workers,
                   options=dict(self.options.as_dict(), overlap=self.overlap,
                                cost_model=self.cost is not None))
        plan, planner = self.planner.plan, self.planner
        out["route"] = None if plan is None else {
            "route": plan.route, "reason": plan.route_reason,
            "settled": self._trial is None or self._trial.done,
            "workers_s": plan.workers_s, "servers_s": plan.servers_s,
            "moves": [] if self._trial is None else list(self._trial.moves)}
        out["warming_up"] = any(l.warms_up and l.stages.warming(l, self.memory)
                                for l in self.pipeline.layers.values())
        out["measurement"] = {"seconds": planner.measured_s,
                              "rechecks": dict(planner.rechecks)}
        if self.cost is not None:
            out["cost_model"] = cost_model_stats(
                self.cost, planner.decisions.values(), out["layers"], planner.rechecks,
                getattr(self.transport, "split_elements", None))
        return out

    def save_residuals(self, fname):
        """Save this worker's residuals and codec state (part of a checkpoint: every
        worker saves its own; the servers keep no state of their own)."""
        mx.nd.save(fname, self.memory.state_dict())

    def load_residuals(self, fname):
        """Restore what save_residuals wrote (before the next pushpull)."""
        state = mx.nd.load(fname)
        # mx.nd.save of an empty dict loads back as an empty list
        state = state if isinstance(state, dict) else {}
        if any(k.startswith(("server_residual/", "server_thresholds/")) for k in state):
            raise ValueError("%s holds the servers' residuals of a re-compressed pull "
                             "(compress_pull 'layer' or '2bit'), which is no longer "
                             "offered: it cannot be resumed by this version" % fname)
        self.memory.load_state_dict(state)


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
    """A hylo kvstore with options (kvstore.options.TABLE); ``mx.kv.create(type)``
    gives one with defaults."""
    classes = {"hylo": Hylo, "dist_sync_hylo": DistSyncHylo}
    if type not in classes:
        raise ValueError("mxhylo.create: type must be 'hylo' or 'dist_sync_hylo', got %r"
                         % (type,))
    return classes[type](**options)
