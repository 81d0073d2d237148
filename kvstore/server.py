"""What runs on the parameter servers: decode the workers' payloads and aggregate them.

MXNet's supported hook for server-side code is the optimizer a worker sends with
kv.set_optimizer(): the servers unpickle it (importing mxhylo there) and call its
update for every key once all workers have pushed it, with the summed pushes as the
gradient and the stored array as the weight. ``ServerDecoder`` is such an optimizer:
it carries the wire layout of every key (kvstore.wire) and, instead of updating
weights, writes into the stored array what the workers pull: the dense float32
aggregate, the workers' payloads gathered (pull 'gather', exact), or a shared-scale
codec's integer sums (pull 'sum', exact). A server keeps
no state of its own between steps but the route's optimizer state below.

Keys of kind 'update' (kvstore.server_route: the dense route, where compression would
not pay) are what MXNet's dist_sync keys are: the stored array is the weight, and the
server runs the Trainer's optimizer on it with the summed gradient. The optimizer comes
in a ServerDecoder too (``route``, a RouteOptimizer); its state lives in this server
process, so a new learning rate sent mid-run keeps the momentum and the update counts.

That state stays in this process, as on MXNet's own servers (no parameter-server key
holds it, so the first step makes and sends nothing for it). The workers reach it, for
trainer.save_states, load_states and the route's moves, as one stream per server: for
each 'update' key of the route in force on that server, in key order, [its update
count, the optimizer's m state arrays of the piece, each n values, in the order
``state_arrays`` lists them] (``state_stream``). Two kinds of small key carry windows
of it:

* 'mailbox': one per worker and server, registered once by every worker's push (the
  server keeps its stored array). A worker sends ``fills`` (mailbox key -> offset in
  the stream, in a ServerDecoder) and the server writes that window of the stream into
  the mailbox, which the worker then pulls: no other worker takes part, so rank 0 can
  save alone, and each worker reads through its own mailbox at any time.
* 'load': one per server; every worker pushes windows of the stream in rounds (rank 0
  its file's values, the others zeros), the first value of each push the round + 1.
  A count value c + 1 sets the key's count to c (-1 keeps it); the rest becomes the
  key's state.
"""
import logging
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import mxnet as mx
import numpy as np

from .compressors import make_compressors
from .wire import gather_values, rows_from_zero, slot_payload, sum_values

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
    keys. fills: 'mailbox' ps key -> offset in its server's state stream, windows to
    write into the mailboxes this server has (see the module docstring).
    """

    def __init__(self, layouts, route=None, fills=None, **kwargs):
        super().__init__(**kwargs)
        self.layouts = dict(layouts)
        self.route = route
        self.fills = dict(fills or {})

    def __setstate__(self, state):
        super().__setstate__(state)
        _SERVER.merge_layouts(self.layouts)
        if self.route is not None:
            _SERVER.set_route(self.route)
        for key, offset in getattr(self, "fills", {}).items():
            if key in _SERVER.mailboxes:        # (another server's mailbox: not here)
                _SERVER.fill_mailbox(key, offset)

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


@dataclass(frozen=True)
class StatePart:
    """One part of a server's state stream (see the module docstring): of 'update' ps
    key ``key``, its update count (index 0) or the optimizer's state array ``index``
    (from 1); ``start``: its first element in the stream; ``size``: its elements."""
    key: int
    index: int
    start: int
    size: int


def state_stream(entries):
    """[StatePart] of a stream of ``entries``: (update ps key, n elements of the piece,
    m state arrays), in order."""
    parts, start = [], 0
    for key, n, m in entries:
        for index, size in [(0, 1)] + [(j + 1, n) for j in range(m)]:
            parts.append(StatePart(key, index, start, size))
            start += size
    return parts


def stream_window(parts, lo, hi):
    """(part, first element in the part, first element in the window, elements) of every
    part of ``parts`` overlapping the window [lo, hi) of the stream."""
    for part in parts:
        a, b = max(lo, part.start), min(hi, part.start + part.size)
        if a < b:
            yield part, a - part.start, a - lo, b - a


class ServerState:
    """Everything one server process keeps between ServerDecoders (a new table of
    layouts, for new keys, or a new optimizer replaces the decoder, not this):

    layouts: ps key -> (layer name, ChunkLayout), merged from every table received;
    codecs: the decoders of compressed pushes; optimizer: the Trainer's, for the
    'update' keys (None until a RouteOptimizer comes); route_keys: the 'update' keys of
    the route in force (its RouteOptimizer's), sorted; optimizer_states: ps key -> its
    optimizer state; mailboxes: 'mailbox' ps key -> MXNet's stored array of it, once
    registered (see the module docstring).
    """

    def __init__(self):
        self.layouts = {}
        self.codecs = make_compressors()
        self.optimizer = None
        self.route_keys = []
        self.optimizer_states = {}
        self.mailboxes = {}

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
        self.route_keys = sorted(route.mults)

    def update_weight(self, key, stored, received):
        """The Trainer's optimizer on an 'update' key: ``stored`` is the weight piece,
        ``received`` the workers' summed gradient of it."""
        self.optimizer.update_multi_precision(key, stored, received, self._state(key))

    def _state(self, key):
        """The optimizer state of 'update' key ``key``, made (as the optimizer makes it
        for a weight of the piece's size) if it has none yet."""
        if self.optimizer is None:
            _fatal("parameter-server key %d updates its weight on the servers, but no "
                   "optimizer was sent" % key)
        if key not in self.optimizer_states:
            self.optimizer_states[key] = self.optimizer.create_state_multi_precision(
                key, mx.nd.zeros((self.layouts[key][1].size,)))
        return self.optimizer_states[key]

    def _stream(self, server):
        """The state stream (StatePart list) of ``server``'s keys of the route."""
        keys = [k for k in self.route_keys if self.layouts[k][1].server == server]
        return state_stream([(k, self.layouts[k][1].size, len(state_arrays(self._state(k))))
                             for k in keys])

    def fill_mailbox(self, key, offset):
        """Write the window of the stream from element ``offset`` into registered
        'mailbox' key ``key``'s stored array (zeros past the stream's end)."""
        stored = self.mailboxes[key]
        stored[:] = 0.0
        counts = self.optimizer._index_update_count
        parts = self._stream(self.layouts[key][1].server)
        for part, src, dst, n in stream_window(parts, offset, offset + stored.size):
            if part.index == 0:
                stored[dst:dst + 1] = float(counts.get(part.key, 0))
            else:
                array = state_arrays(self._state(part.key))[part.index - 1]
                stored[dst:dst + n] = array.reshape((-1,))[src:src + n]
        # MXNet answers a pull from the stored array without waiting for the engine
        stored.wait_to_read()

    def load_window(self, key, received):
        """Take one round of a load pushed into 'load' key ``key``: ``received``, the
        workers' sum, is [W * (round + 1), the window of the stream from round * its
        size]."""
        values = received.asnumpy()
        size = values.size - 1
        offset = (int(round(values[0] / _num_workers())) - 1) * size
        counts = self.optimizer._index_update_count
        parts = self._stream(self.layouts[key][1].server)
        for part, src, dst, n in stream_window(parts, offset, offset + size):
            if part.index == 0:
                count = int(values[1 + dst]) - 1
                if count > 0:
                    counts[part.key] = count
                elif count == 0:
                    counts.pop(part.key, None)    # a fresh key: begin_num_update
            else:
                array = state_arrays(self._state(part.key))[part.index - 1]
                array.reshape((-1,))[src:src + n] = received[1 + dst:1 + dst + n]
        self.optimizer.num_update = max([self.optimizer.begin_num_update]
                                        + list(counts.values()))
        mx.nd.waitall()

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
            if layout.kind == "mailbox":
                self.mailboxes[key] = stored        # (a register: what came is zeros)
                return
            if layout.kind == "load":
                self.load_window(key, received)
                return
            if layout.kind == "dense":
                stored[:] = received
                return
            if layout.kind == "probe":
                stored[:] = received * 2 + 1      # proves to the workers that we decode
                return
            if layout.pull == "sum":        # a shared-scale codec: the codes' integer sums
                stored[:] = rows_from_zero(layout, sum_values(layout, received))
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
