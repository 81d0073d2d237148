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

Trust: like MXNet's own servers (which unpickle whatever optimizer a worker sends),
this decoder trusts every peer of the job; ps-lite authenticates no one. What it checks
is that a push fits its key's layout, so that a worker of another job or model, or a
corrupted payload, ends the server with a message naming the key and, where the layout
tells it (a worker's slot), the worker, instead of being summed into a wrong
aggregate: a known kind, codec and pull; a key the server has a layout for, of its
shape; every worker's slot whole, in place, its header finite and its padding zero;
rows inside the key; no NaN or Inf in what a codec never sends them in (codecs refuse
to encode a non-finite gradient); a load's round a whole number. Uncompressed keys
('dense', 'update') pass NaN and Inf on, as MXNet's dist_sync does.
"""
import logging
import numbers
import os
import socket
from dataclasses import dataclass
from typing import Dict, Tuple

import mxnet as mx
import numpy as np

from .compressors import make_compressors
from .wire import (FLAT_KINDS, PULL_CODECS, ChunkLayout, gather_values, rows_from_zero,
                   slot_payload, carrier_values, sum_values)

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
    write into the mailboxes this server has (see the module docstring). sender: the
    worker process that made it ('worker process PID on host NAME'), which a server
    names when the table is wrong.
    """

    def __init__(self, layouts, route=None, fills=None, **kwargs):
        super().__init__(**kwargs)
        self.layouts = dict(layouts)
        self.route = route
        self.fills = dict(fills or {})
        self.sender = "worker process %d on host %s" % (os.getpid(), socket.gethostname())

    def __setstate__(self, state):
        super().__setstate__(state)
        _SERVER.merge_layouts(self.layouts, getattr(self, "sender", None))
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
        rounds = values[0] / _num_workers()
        if not (np.isfinite(rounds) and rounds >= 1 and rounds == round(rounds)):
            raise Malformed("its first value, every worker's round + 1 summed, is %r: not "
                            "%d times a whole number from 1; %s"
                            % (float(values[0]), _num_workers(), _from_sum()))
        offset = (int(rounds) - 1) * size
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

    def merge_layouts(self, layouts, sender=None):
        """Take a table of layouts (ps key -> (layer name, ChunkLayout)) sent by
        ``sender`` (ServerDecoder.sender); a table this server cannot decode with, or
        a key another worker laid out otherwise, ends the server naming both."""
        sender = sender or "a worker"
        if not isinstance(layouts, dict):
            _fatal("the layout table sent by the %s is a %s, not a dict of parameter-server "
                   "keys" % (sender, type(layouts).__name__))
        for key, entry in layouts.items():
            problem = layout_problem(key, entry, _env_int("DMLC_NUM_WORKER"),
                                     _env_int("DMLC_NUM_SERVER"))
            if problem is not None:
                _fatal("the layout table sent by the %s is malformed: %s" % (sender, problem))
            name, layout = entry
            known = self.layouts.get(key)
            if known is not None and known != (name, layout):
                _fatal("workers train different models: parameter-server key %d is %s %s "
                       "on one worker and %s %s on the %s"
                       % (key, known[0], known[1], name, layout, sender))
            self.layouts[key] = (name, layout)

    def aggregate_into(self, key, stored, received):
        """Write what the workers pull for ``key`` into ``stored``, from the summed
        pushes ``received``; a push that does not fit the key's layout ends the
        server (Malformed: the message names the key and, where it can, the worker)."""
        entry = self.layouts.get(key)
        if entry is None:
            _fatal("a push to parameter-server key %d, for which this server has no layout: "
                   "no worker sent one (a key of another job or model, or a push before "
                   "the hylo layout table); %s" % (key, _from_sum()))
        name, layout = entry
        try:
            check_shape(layout, stored, received)
            self._aggregate(key, name, layout, stored, received)
        except Malformed as err:
            _fatal("malformed push to parameter-server key %d (%s: %s): %s"
                   % (key, name, describe_layout(layout), err))
        except Exception as err:  # noqa: BLE001 - any failure here must end the job loudly
            _fatal("decoding key %d (%s: %s) failed: %r; %s"
                   % (key, name, describe_layout(layout), err, _from_sum()))

    def _aggregate(self, key, name, layout, stored, received):
        """aggregate_into's work, once the key's shape is known good."""
        if layout.kind == "update":
            self.update_weight(key, stored, received)
        elif layout.kind == "mailbox":
            self.mailboxes[key] = stored        # (a register: what came is zeros)
        elif layout.kind == "load":
            self.load_window(key, received)
        elif layout.kind == "dense":
            stored[:] = received
        elif layout.kind == "probe":
            stored[:] = received * 2 + 1      # proves to the workers that we decode
        elif layout.kind == "rows":
            check_rows(layout, received)
            if layout.pull == "gather":     # the filters as they came, with their indices
                stored[:] = rows_from_zero(layout, gather_values(layout, received))
            else:                           # the sum of row_sparse pushes: the scatter-add
                stored[:] = rows_from_zero(layout, received.tostype("default"))
        elif layout.kind == "slots":
            headers = check_slots(layout, received)
            if layout.pull == "sum":        # a shared-scale codec: the codes' integer sums
                check_shared_value(headers)
                stored[:] = rows_from_zero(layout, _sum_values(layout, received))
            elif layout.pull == "gather":   # the payloads as they came, for every worker
                stored[:] = rows_from_zero(layout, gather_values(layout, received))
            else:
                stored[:] = rows_from_zero(layout, _decode(layout, received))
        else:       # (merge_layouts lets no other kind in)
            raise Malformed("unknown layout kind %r" % layout.kind)


# This server process's state: one object, outliving every ServerDecoder.
_SERVER = ServerState()


def _fatal(message):
    # An exception here would be swallowed by the C callback and the job would hang;
    # end this server so the launcher tears the job down and reports it.
    log.error("mxhylo server: %s", message)
    print("mxhylo server error: " + message, flush=True)
    os._exit(3)


def _decode(layout, received):
    """The dense float32 aggregate of a 'slots' chunk (pull 'none'; check_slots passed),
    of the key's shape: every worker's slot decoded with the chunk's codec, in rank
    order, as the workers' gather does."""
    data = received.data.asnumpy().reshape(layout.slots, -1)
    dense = mx.nd.zeros(layout.key_shape, dtype=np.float32)
    flat = dense.reshape((-1,))[:layout.size]
    codec = _SERVER.codecs[layout.codec]
    for w in range(layout.slots):
        try:
            codec.decode(slot_payload(layout, data[w]), flat, accumulate=True)
        except Exception as err:  # noqa: BLE001 - named with its sender
            raise Malformed("worker rank %d's payload does not decode: %s" % (w, err))
    if not _all_finite(flat):
        # the codecs never send NaN or Inf: find whose payload decodes to one
        bad = [w for w in range(layout.slots) if not _all_finite(_decoded(layout, data[w]))]
        raise Malformed("the payload of worker rank(s) %s decodes to NaN or Inf, which %s "
                        "never sends" % (", ".join(map(str, bad)) or "?", layout.codec))
    return dense


def _decoded(layout, slot):
    """One worker's slot (float32 numpy) decoded alone: float32 NDArray (size,)."""
    out = mx.nd.zeros((layout.size,), dtype=np.float32)
    _SERVER.codecs[layout.codec].decode(slot_payload(layout, slot), out)
    return out


def _sum_values(layout, received):
    """wire.sum_values; what it refuses (a worker's altered bytes) ends the server."""
    try:
        return sum_values(layout, received)
    except ValueError as err:
        raise Malformed(str(err))


# -- what a server checks before it takes a layout table or a push ------------------------

KINDS = FLAT_KINDS + ("rows", "slots")


class Malformed(ValueError):
    """A push that does not fit its key's layout. The message says what is wrong and
    who sent it, where the layout tells: aggregate_into adds the key."""


def _from_sum():
    """Who sent a push, when the server sees only the workers' sum of it."""
    workers = _env_int("DMLC_NUM_WORKER")
    return ("the server sees only the sum of the workers' pushes of the key (%sone a "
            "worker), so it cannot tell which worker sent it"
            % ("it waits for %d, " % workers if workers else ""))


def describe_layout(layout):
    """Text such as "a 'slots' key of fp16, pull 'gather'", for messages."""
    what = "a %r key" % layout.kind
    if layout.kind == "slots":
        what += " of %s" % layout.codec
    if layout.kind in ("rows", "slots"):
        what += ", pull %r" % layout.pull
    return what


def layout_problem(key, entry, num_workers=None, num_servers=None):
    """What makes ``entry`` (layer name, ChunkLayout) of a layout table unusable for
    ps key ``key`` on a job of ``num_workers`` workers and ``num_servers`` servers
    (None: not checked), as text naming the key; None when it is usable."""
    if not isinstance(key, numbers.Integral) or isinstance(key, bool):
        return "key %r is not a parameter-server key (an int)" % (key,)
    if not (isinstance(entry, tuple) and len(entry) == 2
            and isinstance(entry[1], ChunkLayout)):
        return "key %d: %r is not (layer name, ChunkLayout)" % (key, entry)
    name, layout = entry
    where = "key %d (%s)" % (key, name)
    if layout.kind not in KINDS:
        return "%s: unknown layout kind %r (known: %s)" % (where, layout.kind, ", ".join(KINDS))
    if layout.pull not in PULL_CODECS:
        return "%s: unknown pull %r (known: %s)" % (where, layout.pull, ", ".join(PULL_CODECS))
    counts = ("lo", "hi", "size", "cols", "rows", "slot_rows", "dense_rows", "server",
                "pull_k", "slots", "push_rows")
    for field in counts:
        value = getattr(layout, field)
        if not isinstance(value, numbers.Integral) or value < 0:
            return "%s: %s = %r, not a count" % (where, field, value)
    if num_servers and layout.server >= num_servers:
        return "%s: placed on server %d of a job of %d servers (a layout of another job)" \
            % (where, layout.server, num_servers)
    if layout.kind == "rows":
        return _rows_layout_problem(where, layout)
    if layout.kind == "slots":
        return _slots_layout_problem(where, layout, num_workers)
    return None


def _rows_layout_problem(where, layout):
    """layout_problem of a 'rows' layout (kind and counts already checked)."""
    if layout.cols < 1 or layout.rows != layout.hi - layout.lo or layout.rows < 1 \
            or layout.size != layout.rows * layout.cols:
        return "%s: a 'rows' key of %d rows of %d for filters [%d, %d) and %d elements" \
            % (where, layout.rows, layout.cols, layout.lo, layout.hi, layout.size)
    if layout.pull == "gather" and layout.pull_k < 1:
        return "%s: a 'gather' pull of %d filters" % (where, layout.pull_k)
    return None


def _slots_layout_problem(where, layout, num_workers):
    """layout_problem of a 'slots' layout (kind and counts already checked)."""
    codec = _SERVER.codecs.get(layout.codec)
    if codec is None or codec.wire != "slots":
        return "%s: unknown codec %r for a 'slots' key (known: %s)" % (
            where, layout.codec,
            ", ".join(n for n, c in _SERVER.codecs.items() if c.wire == "slots"))
    if num_workers and layout.slots != num_workers:
        return "%s: laid out for %d workers' slots in a job of %d workers (a layout of " \
            "another job)" % (where, layout.slots, num_workers)
    if layout.pull == "sum" and not getattr(codec, "summable", False):
        return "%s: a 'sum' pull of %s, whose codes the servers cannot add" % (
            where, layout.codec)
    need = codec.scalars + carrier_values(codec.byte_span(0, layout.size)[1])
    if layout.cols < 1 or layout.slot_rows * layout.cols < need \
            or layout.slots * layout.slot_rows > layout.rows:
        return "%s: slots of %d rows of %d values in a key of %d rows, for a payload of " \
            "%d values and %d workers" % (where, layout.slot_rows, layout.cols,
                                          layout.rows, need, layout.slots)
    return None


def check_shape(layout, stored, received):
    """Malformed unless the key's stored array and the workers' summed push have the
    layout's shape (a key initialised or pushed by another job or model)."""
    want = tuple(layout.key_shape)
    for what, array in (("the key's stored value", stored), ("the push", received)):
        if tuple(array.shape) != want:
            raise Malformed("%s has shape %s, the layout's is %s: a key of another job or "
                            "model; %s" % (what, tuple(array.shape), want, _from_sum()))
    sparse = layout.kind in ("rows", "slots")
    if sparse != (received.stype == "row_sparse"):
        raise Malformed("a %s push to a %s key; %s" % (
            received.stype, "row_sparse" if sparse else "dense", _from_sum()))


def check_rows(layout, received):
    """Malformed unless the summed row_sparse push of a 'rows' key lists rows inside
    the key and carries no NaN or Inf (conv_topk never sends one)."""
    rows = received.indices.asnumpy()
    outside = rows[(rows < 0) | (rows >= layout.rows)]
    if outside.size:
        raise Malformed("rows %s pushed, outside the key's %d; %s"
                        % (_few(outside), layout.rows, _from_sum()))
    if rows.size and not _all_finite(received.data):
        raise Malformed("NaN or Inf values pushed, which conv_topk never sends; %s"
                        % _from_sum())


def check_slots(layout, received):
    """Malformed unless every worker's slot of a 'slots' key came whole, in its rows
    and nowhere else, its header scalars finite and its padding zero; returns the
    headers, float32 numpy (slots, scalars), by rank."""
    rows = received.indices.asnumpy()
    per, n = layout.slot_rows, layout.slots
    if not np.array_equal(rows, np.arange(n * per)):
        for w in range(n):
            mine = np.count_nonzero((rows >= w * per) & (rows < (w + 1) * per))
            if mine < per:
                raise Malformed("worker rank %d's slot (rows %d-%d of the key) came with %d "
                                "of its %d rows" % (w, w * per, (w + 1) * per - 1, mine, per))
        outside = rows[(rows < 0) | (rows >= n * per)]
        if outside.size:
            raise Malformed("rows %s pushed, outside the %d workers' slots (rows 0-%d); %s"
                            % (_few(outside), n, n * per - 1, _from_sum()))
        raise Malformed("the workers' slots came out of order (rows %s)" % _few(rows))
    codec = _SERVER.codecs[layout.codec]
    used = codec.scalars + carrier_values(codec.byte_span(0, layout.size)[1])
    slots = received.data.reshape((n, per * layout.cols))
    headers = slots[:, :codec.scalars].asnumpy() if codec.scalars else np.zeros((n, 0))
    for w in range(n):
        if not np.isfinite(headers[w]).all():
            raise Malformed("worker rank %d's payload header %s is not finite, which %s "
                            "never sends" % (w, headers[w].tolist(), layout.codec))
    if used < per * layout.cols:
        padding = slots[:, used:].asnumpy()
        for w in range(n):
            if np.any(padding[w] != 0):
                raise Malformed("worker rank %d's slot holds more than a payload of %d "
                                "elements of %s (values past its first %d are not zero)"
                                % (w, layout.size, layout.codec, used))
    return headers


def check_shared_value(headers):
    """Malformed unless every worker's header (by rank) carries the same shared value
    (a 'sum' pull's codes of different scales cannot be added)."""
    values = headers[:, 0]
    if np.any(values != values[0]):
        raise Malformed("the workers' shared values differ (%s): their codes cannot be "
                        "summed" % ", ".join("rank %d: %r" % (w, float(v))
                                             for w, v in enumerate(values)))


def _all_finite(array):
    """True when NDArray ``array`` holds no NaN or Inf (one pass, no copy to numpy)."""
    return array.size == 0 or bool(mx.nd.contrib.isfinite(array).min().asscalar())


def _few(values, limit=8):
    """The first few of a numpy array's values, as text."""
    values = np.asarray(values).reshape(-1)
    text = ", ".join(str(int(v)) for v in values[:limit])
    return text + (", ... (%d in all)" % values.size if values.size > limit else "")


def _env_int(name):
    """An integer environment variable, or None when unset."""
    value = os.environ.get(name)
    return int(value) if value else None


def _num_workers():
    return int(os.environ["DMLC_NUM_WORKER"])
