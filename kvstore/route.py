"""The route of a Trainer's optimizer, tried on the job's own steps.

Which route is faster, the workers' (compressed gradients exchanged, the optimizer run
on every worker) or the servers' (dense gradients, the optimizer run once on the
servers, as dist_sync), depends on the CPU as much as on the network: a model of the
wire does not see the encoding, decoding and Python of a step on loaded cores. So
where kvstore.plan leaves the route on trial, the job times both on real steps:

1. the warm-up (the store's warmup_steps steps, every gradient dense in any case) runs
   on the servers' route;
2. then the optimizer moves to the workers: each worker pulls its state from the
   servers into its Trainer's updaters (update counts included), the layers get their
   keys and compress from their first exchange (their warm-up is done):
   TRIAL_STEPS steps on the workers' route;
3. the route whose steps were faster is kept: the median of the seconds between one
   step's start and the next one's, the first SKIPPED_STEPS of each route not counted
   (they make keys). A step's start is taken once MXNet's engine has finished the work
   queued before it (mx.nd.waitall): a training loop that never waits (no asnumpy()
   in the step) lets Python run ahead of the engine, and the servers' route, whose
   exchange does not block Python, would otherwise be timed at Python's speed (a
   tenth of its real step) and always win. Going back to the servers takes FLUSH_STEPS more steps on the
   workers' route with every layer dense: the first sends what the codecs held back
   (nothing is lost), after the second the optimizer's momentum is dense momentum's
   (kvstore.momentum); then a fresh set of keys on the servers takes the weights and
   the optimizer's state.

Every worker acts on rank 0's figures, at the same step (each decision is collective).
What it costs: at most TRIAL_STEPS + FLUSH_STEPS steps on the slower route, and one or
two moves of the weights and the optimizer's state.
"""
import pickle
import time

import mxnet as mx
import numpy as np

TRIAL_STEPS = 10     # compressed steps timed on the workers' route
SKIPPED_STEPS = 2    # first steps of a route not timed (at most all but one)
FLUSH_STEPS = 2      # dense steps on the workers' route before going back


class RouteTrial:
    """The trial of one store and its Trainer (see the module docstring).

    ``at_step(store, trainer)`` is called at the start of every exchange of the
    Trainer's step and moves the optimizer when due; ``moves``: (step, route) of each
    move, steps counted from 1.
    """

    def __init__(self, warmup_steps):
        self.warmup_steps = int(warmup_steps)
        self.starts = []          # perf_counter() at the start of each step
        self.phase = "servers"    # 'servers', 'workers', 'flush', then 'done'
        self.phase_start = 0      # index of the phase's first step
        self.moves = []

    @property
    def done(self):
        return self.phase == "done"

    def at_step(self, store, trainer):
        if self.done:
            return
        mx.nd.waitall()         # the real step, not Python's run-ahead (module docstring)
        self.starts.append(time.perf_counter())
        step = len(self.starts) - 1         # this step's index
        if self.phase == "servers" and step == self.warmup_steps:
            servers_s = self._median(store, 0, step)
            store.planner.retime({"servers": servers_s})
            to_workers(store, trainer)
            self.moves.append((step + 1, "workers"))
            self.phase, self.phase_start = "workers", step
        elif self.phase == "workers" and step == self.phase_start + TRIAL_STEPS:
            timed = dict(store.planner.step_s,
                         workers=self._median(store, self.phase_start, step))
            if store.planner.retime(timed).route == "servers":
                make_dense(store)
                self.phase, self.phase_start = "flush", step
            else:
                self.phase = "done"
        elif self.phase == "flush" and step == self.phase_start + FLUSH_STEPS:
            to_servers(store, trainer)
            self.moves.append((step + 1, "servers"))
            self.phase = "done"

    def _median(self, store, first, end):
        """Rank 0's median seconds of steps first..end-1 (collective)."""
        seconds = np.diff(self.starts[first:end + 1])
        seconds = seconds[min(SKIPPED_STEPS, len(seconds) - 1):]
        return float(store.transport.share_from_rank0([float(np.median(seconds))])[0])


def to_workers(store, trainer):
    """Move ``trainer``'s optimizer from the servers to the workers (collective): its
    state pulled into the Trainer's updaters; every parameter's layer made, with its
    keys, compressing from its first exchange."""
    load_into_updaters(trainer, store._servers.states_data(dump_optimizer=True))
    store._servers = None
    trainer._update_on_kvstore = False
    store.pipeline.warmup_steps = 0      # (it ran on the servers)
    params = [p for p in trainer._params if p.grad_req != "null"]
    layers = [store._layer(trainer._param2idx[p.name], p.shape) for p in params]
    # (every worker holds the same weights: the broadcast makes the keys)
    store.pipeline.broadcast(layers, [p.list_data()[0] for p in params],
                             [p.list_data() for p in params])


def make_dense(store):
    """Re-plan every compressed layer dense (collective): its next exchange sends what
    its codec held back."""
    for layer in list(store.pipeline.layers.values()):
        if layer.plan.strategy != "none":
            store.pipeline.replan(layer, store.policy.plan_as(layer.plan.name,
                                                              layer.plan.shape, "none"))


def to_servers(store, trainer):
    """Move ``trainer``'s optimizer from the workers to the servers (collective): fresh
    keys on the servers take rank 0's weights and optimizer state."""
    state = trainer._updaters[0].get_states(dump_optimizer=True)
    servers = store.transport.server_route(trainer._params)
    servers.set_optimizer(trainer._optimizer)
    params = trainer._params     # (every one, as Gluon broadcasts them: the first keys')
    servers.broadcast([trainer._param2idx[p.name] for p in params],
                      [[p.list_data()[0]] for p in params], [p.list_data() for p in params])
    servers.load_states_data(state, "the workers' optimizer state")
    store._servers = servers
    trainer._update_on_kvstore = True


def load_into_updaters(trainer, data):
    """Put the optimizer state ``data`` (a pickle of ({parameter index: state},
    optimizer), as trainer.save_states writes it) into ``trainer``'s updaters, and its
    update counts into the Trainer's own optimizer (which stays the same object)."""
    states, saved = pickle.loads(data)
    blob = pickle.dumps(states)
    for updater in trainer._updaters:
        updater.set_states(blob)
    optimizer = trainer._optimizer
    for ctx in trainer._contexts:
        optimizer._all_index_update_counts.setdefault(ctx.device_id, {}).update(
            saved._index_update_count)
    optimizer.num_update = max(optimizer.num_update, saved.num_update)
