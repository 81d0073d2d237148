"""What runs on the parameter servers: decode the workers' payloads and aggregate them.

MXNet's supported hook for server-side code is the optimizer a worker sends with
kv.set_optimizer(): the servers unpickle it (importing mxhylo there) and call its
update for every key once all workers have pushed it, with the summed pushes as the
gradient and the stored array as the weight. ``ServerDecoder`` is such an optimizer:
it carries the wire layout of every key (kvstore.wire) and, instead of updating
weights, writes into the stored array what the workers pull: the dense float32
aggregate, or the workers' payloads gathered (pull 'gather', exact). A server keeps
no state of its own between steps but the route's optimizer state below.

Keys of kind 'update' (kvstore.server_route: the dense route, where compression would
not pay) are what MXNet's dist_sync keys are: the stored array is the weight, and the
server runs the Trainer's optimizer on it with the summed gradient. The optimizer comes
in a ServerDecoder too (``route``, a RouteOptimizer); its state lives in this server
process, so a new learning rate sent mid-run keeps the momentum and the update counts.

That state is also kept where the workers can read it, for trainer.save_states: every
'update' key P has a key S of kind 'state' on the same server (``layout.ref`` = P) of
1 + m * n float32 values for a piece of n elements: [P's update count, the optimizer's
m state arrays of the piece, each n values, in the order ``state_arrays`` lists them].
Every worker pushes zeros into S once (registering it): the server then keeps S's stored
array and makes P's optimizer state views of it, so every update writes the state
straight into what a worker pulls (a pull needs no other worker: rank 0 saves alone),
and P's count follows each update. A push whose first value is not zero loads S
(trainer.load_states: rank 0 pushes the values, the other workers zeros): first value
c + 1 sets P's count to c (-1 keeps the count), the rest become P's state.
"""
import logging
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import mxnet as mx
import numpy as np

from .compressors import make_compressors
from .wire import gather_values, rows_from_zero, slot_payload

log = logging.getLogger("mxhylo.server")


@dataclass
class RouteOptimizer:
    """The Trainer's optimizer for the keys of kind 'update' (kvstore.server_route).

    optimizer: the Trainer's mx.optimizer.Optimizer, pickled (MXNet drops its
    param_dict, where Gluon keeps each parameter's multipliers, so they travel here);
    mults: ps key -> (lr_mult, wd_mult) of the parameter the key is a piece of. The
    server passes the ps key as the optimizer's index: a piece is updated once a step.
    """
    optimizer: object
    mults: Dict[int, Tuple[float, float]]


class ServerDecoder(mx.optimizer.Optimizer):
    """Decodes and aggregates hylo payloads on a server (pickled to it by the workers).

    layouts: dict ps key (int) -> (layer name, ChunkLayout). Sent again, complete,
    whenever the workers define new keys; a key whose layout differs from what another
    worker sent means the workers train different models, which ends the server with
    an error saying so. route: None (unchanged) or a RouteOptimizer for the 'update'
    keys.
    """

    def __init__(self, layouts, route=None, **kwargs):
        super().__init__(**kwargs)
        self.layouts = dict(layouts)
        self.route = route

    def __setstate__(self, state):
        super().__setstate__(state)
        _SERVER.merge_layouts(self.layouts)
        if self.route is not None:
            _SERVER.set_route(self.route)

    def create_state(self, index, weight):
        return None

    def create_state_multi_precision(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        for i, w, g in zip(_as_list(index), _as_list(weight), _as_list(grad)):
            _SERVER.aggregate_into(i, w, g)

    update_multi_precision = update


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


def state_arrays(state):
    """The NDArrays of an optimizer's state (None, an NDArray, or tuples and lists of
    them, nested), depth first: their order in a 'state' key."""
    if state is None:
        return []
    if isinstance(state, (list, tuple)):
        return [a for part in state for a in state_arrays(part)]
    return [state]


def rebuild_state(state, arrays):
    """``state``'s structure with its NDArrays replaced, in state_arrays' order, by the
    next ones of the iterator ``arrays``."""
    if state is None:
        return None
    if isinstance(state, (list, tuple)):
        return type(state)(rebuild_state(part, arrays) for part in state)
    return next(arrays)


class ServerState:
    """Everything one server process keeps between ServerDecoders (a new table of
    layouts, for new keys, or a new optimizer replaces the decoder, not this):

    layouts: ps key -> (layer name, ChunkLayout), merged from every table received;
    codecs: the decoders of compressed pushes; optimizer: the Trainer's, for the
    'update' keys (None until a RouteOptimizer comes); optimizer_states: ps key -> its
    state; state_stores: 'update' ps key -> MXNet's stored array of its 'state' key,
    float32 (1 + m * n,) (see the module docstring); state_views: the 'update' keys
    whose optimizer_states are views of their state_stores; state_loaded: those whose
    state_stores hold loaded values their state, not made yet, is to start from.
    """

    def __init__(self):
        self.layouts = {}
        self.codecs = make_compressors()
        self.optimizer = None
        self.optimizer_states = {}
        self.state_stores = {}
        self.state_views = set()
        self.state_loaded = set()

    def set_route(self, route):
        """Take ``route``'s optimizer for the 'update' keys. A replacement (the Trainer's
        learning rate or another setting changed) takes over the update counts (its
        schedule and Adam's bias correction go on); the states stay."""
        optimizer = route.optimizer
        optimizer.param_dict = {}
        optimizer.lr_mult = {k: float(m[0]) for k, m in route.mults.items()}
        optimizer.wd_mult = {k: float(m[1]) for k, m in route.mults.items()}
        if self.optimizer is not None:
            optimizer._all_index_update_counts = self.optimizer._all_index_update_counts
            optimizer._index_update_count = self.optimizer._index_update_count
            optimizer.num_update = self.optimizer.num_update
        self.optimizer = optimizer

    def update_weight(self, key, stored, received):
        """The Trainer's optimizer on an 'update' key: ``stored`` is the weight piece,
        ``received`` the workers' summed gradient of it."""
        if self.optimizer is None:
            _fatal("parameter-server key %d updates its weight on the servers, but no "
                   "optimizer was sent" % key)
        if key not in self.optimizer_states:
            self.optimizer_states[key] = \
                self.optimizer.create_state_multi_precision(key, stored)
        if key in self.state_stores and key not in self.state_views:
            self._state_into_views(key)
        self.optimizer.update_multi_precision(key, stored, received,
                                              self.optimizer_states[key])
        if key in self.state_views:
            store = self.state_stores[key]
            store[0:1] = float(self.optimizer._index_update_count.get(key, 0))
            # MXNet answers a pull from the stored array without waiting for the
            # engine, and waits here only for the weight's writers
            store.wait_to_read()

    def _state_into_views(self, key):
        """Make 'update' key ``key``'s optimizer state views of its 'state' key's stored
        array: with the values it holds if a load came before the state was made, else
        with the state's own values (copied in, with the key's update count)."""
        store, state = self.state_stores[key], self.optimizer_states[key]
        arrays = state_arrays(state)
        if store.size != 1 + sum(a.size for a in arrays):
            # (the optimizer sent at the first step keeps other arrays than the one the
            # keys were made for): the state stays apart, and a save says so
            log.warning("key %d: optimizer state of %d arrays does not fit its state key "
                        "of %d values", key, len(arrays), store.size)
            del self.state_stores[key]
            store[0:1] = -1.0
            store.wait_to_read()
            return
        loaded = key in self.state_loaded
        views, offset = [], 1
        for a in arrays:
            view = store[offset:offset + a.size].reshape(a.shape)
            if not loaded:
                view[:] = a
            views.append(view)
            offset += a.size
        if not loaded:
            store[0:1] = float(self.optimizer._index_update_count.get(key, 0))
        self.optimizer_states[key] = rebuild_state(state, iter(views))
        self.state_views.add(key)
        self.state_loaded.discard(key)
        store.wait_to_read()

    def take_state(self, key, stored, received):
        """A push into 'state' key ``key``: ``stored`` is its stored array (MXNet's, kept
        here), ``received`` the workers' summed push; registers it (all zeros) or loads
        it (see the module docstring)."""
        ref = self.layouts[key][1].ref
        self.state_stores[ref] = stored
        flag = float(received[0:1].asscalar())
        if flag == 0.0:             # a register: the state goes on (or starts) as it is
            if ref in self.optimizer_states and ref not in self.state_views:
                self._state_into_views(ref)
            return
        if self.optimizer is None:
            _fatal("parameter-server key %d: optimizer state loaded before an optimizer "
                   "was sent" % key)
        counts = self.optimizer._index_update_count
        if flag > 0.0:
            count = int(flag) - 1
            if count > 0:
                counts[ref] = count
            else:
                counts.pop(ref, None)      # a fresh key: the optimizer's begin_num_update
            self.optimizer.num_update = max([self.optimizer.begin_num_update]
                                            + list(counts.values()))
        stored[:] = received        # (through the state's views, if it has them)
        stored[0:1] = float(counts.get(ref, 0))
        if ref not in self.state_views:
            self.state_loaded.add(ref)
            if ref in self.optimizer_states:
                self._state_into_views(ref)

    def merge_layouts(self, layouts):
        for key, (name, layout) in layouts.items():
            known = self.layouts.get(key)
            if known is not None and known != (name, layout):
                _fatal("workers train different models: parameter-server key %d is %s %s "
                       "on one worker and %s %s on another"
                       % (key, known[0], known[1], name, layout))
            self.layouts[key] = (name, layout)

    def aggregate_into(self, key, stored, received):
        """Write what the workers pull for ``key`` into ``stored``, from the summed
        pushes ``received``."""
        entry = self.layouts.get(key)
        if entry is None:
            _fatal("no layout for parameter-server key %d: a worker pushed before sending "
                   "the hylo layout table" % key)
        name, layout = entry
        try:
            if layout.kind == "update":
                self.update_weight(key, stored, received)
                return
            if layout.kind == "state":
                self.take_state(key, stored, received)
                return
            if layout.kind == "dense":
                stored[:] = received
                return
            if layout.kind == "probe":
                stored[:] = received * 2 + 1      # proves to the workers that we decode
                return
            if layout.pull == "gather":     # the payloads as they came, for every worker
                stored[:] = rows_from_zero(layout, gather_values(layout, received))
                return
            stored[:] = rows_from_zero(layout, _decode(key, name, layout, received))
        except Exception as err:  # noqa: BLE001 - any failure here must end the job loudly
            _fatal("decoding key %d (%s, %s) failed: %r" % (key, name, layout.kind, err))


# This server process's state: one object, outliving every ServerDecoder.
_SERVER = ServerState()


def _fatal(message):
    # An exception here would be swallowed by the C callback and the job would hang;
    # end this server so the launcher tears the job down and reports it.
    log.error("mxhylo server: %s", message)
    print("mxhylo server error: " + message, flush=True)
    os._exit(3)


def _decode(key, name, layout, received):
    """The dense float32 aggregate of a compressed chunk, of the key's shape."""
    if layout.kind == "rows":
        # The server's sum of the workers' row_sparse pushes is the scatter-add.
        return received.tostype("default")
    rows = received.indices.asnumpy()
    data = received.data.asnumpy()
    dense = mx.nd.zeros(layout.key_shape, dtype=np.float32)
    flat = dense.reshape((-1,))[:layout.size]
    for w in range(_num_workers()):         # in rank order, as the workers' gather does
        lo = w * layout.slot_rows
        mine = (rows >= lo) & (rows < lo + layout.slot_rows)
        if not mine.any():
            _fatal("key %d (%s): worker slot %d is empty" % (key, name, w))
        payload = slot_payload(layout, data[mine].reshape(-1))
        _SERVER.codecs[payload.strategy].decode(payload, flat, accumulate=True)
    return dense


def _num_workers():
    return int(os.environ["DMLC_NUM_WORKER"])
