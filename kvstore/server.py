"""What runs on the parameter servers: decode the workers' payloads, aggregate, and
(with compressed pull) encode the aggregate for the way back.

MXNet's supported hook for server-side code is the optimizer a worker sends with
kv.set_optimizer(): the servers unpickle it (importing mxhylo there) and call its
update for every key once all workers have pushed it, with the summed pushes as the
gradient and the stored array as the weight. ``ServerDecoder`` is such an optimizer:
it carries the wire layout of every key (kvstore.wire) and, instead of updating
weights, writes into the stored array what the workers pull: the dense float32
aggregate, the workers' payloads gathered (pull 'gather', exact), or, for a chunk
with a re-compressed pull, the aggregate encoded by ``PullEncoder`` (server-side error feedback: what is not sent stays in the server's
residual of that key and is added to the key's next aggregate).

The same hook carries commands: a ServerDecoder with ``mode`` 'dump' makes the next
push of every compressed-pull key write the server's state (residual, codec scalars)
for the workers to pull into a checkpoint; 'load' makes it take the pushed values as
its state; 'run' goes back to aggregating. Workers switch modes between barriers.
"""
import logging
import os

import mxnet as mx
import numpy as np

from .. import ops
from .compressors import make_compressors
from .memory import ResidualMemory
from .policy import LayerPlan
from .wire import gather_values, pull_values, read_state, slot_payload, state_values

log = logging.getLogger("mxhylo.server")

MODES = ("run", "dump", "load")


class ServerDecoder(mx.optimizer.Optimizer):
    """Decodes and aggregates hylo payloads on a server (pickled to it by the workers).

    layouts: dict ps key (int) -> (layer name, ChunkLayout). Sent again, complete,
    whenever the workers define new keys; a key whose layout differs from what another
    worker sent means the workers train different models, which ends the server with
    an error saying so. threshold_scale: of the 2-bit codec that encodes pulls.
    mode: None (unchanged) or one of MODES (see the module docstring).
    """

    def __init__(self, layouts, threshold_scale=1.0, mode=None, **kwargs):
        super().__init__(**kwargs)
        if mode is not None and mode not in MODES:
            raise ValueError("server mode must be one of %s, got %r" % (MODES, mode))
        self.layouts = dict(layouts)
        self.threshold_scale = float(threshold_scale)
        self.mode = mode

    def __setstate__(self, state):
        super().__setstate__(state)
        _merge_layouts(self.layouts)
        _PULL.set_threshold_scale(self.threshold_scale)
        if self.mode is not None:
            global _MODE
            _MODE = self.mode

    def create_state(self, index, weight):
        return None

    def create_state_multi_precision(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        for i, w, g in zip(_as_list(index), _as_list(weight), _as_list(grad)):
            aggregate_into(i, w, g)

    update_multi_precision = update


class PullEncoder:
    """Server-side error feedback: encodes aggregates for the pull with a residual each.

    The codecs are the workers' own (kvstore.compressors) and so is the residual store
    (kvstore.memory), keyed by the name the caller gives a chunk or layer: the server
    keeps residual <- aggregate + residual - sent, exactly as a worker does.
    """

    def __init__(self, threshold_scale=1.0):
        self.memory = ResidualMemory()
        self.set_threshold_scale(threshold_scale)

    def set_threshold_scale(self, threshold_scale):
        self.compressors = make_compressors(threshold_scale)

    def encode(self, name, codec, aggregate, k=None):
        """Payload of float32 NDArray ``aggregate`` (plus ``name``'s residual) with
        ``codec`` ('fc_2bit', or 'conv_topk' sending k rows of its first axis)."""
        plan = LayerPlan(name, tuple(aggregate.shape), codec, k=k)
        return self.compressors[codec].encode(plan, aggregate, self.memory)

    def state(self, name, shape):
        """(residual as float32 numpy of ``shape``, 2-bit threshold or None) of ``name``."""
        residual = self.memory.residual(name, mx.nd.zeros(shape, dtype=np.float32))
        return residual.asnumpy(), self.memory.scalar(name, "threshold")

    def set_state(self, name, residual, threshold):
        """Replace ``name``'s residual (numpy) and threshold (None: measure anew)."""
        res = self.memory.residual(name, mx.nd.zeros(residual.shape, dtype=np.float32))
        res[:] = residual
        self.memory.set_scalar(name, "threshold", threshold)


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


# This server process's state, module level: it outlives every ServerDecoder that a
# new table of layouts (new keys) or a mode command replaces.
_LAYOUTS = {}
_MODE = "run"
_PULL = PullEncoder()


def _merge_layouts(layouts):
    for key, (name, layout) in layouts.items():
        known = _LAYOUTS.get(key)
        if known is not None and known != (name, layout):
            _fatal("workers train different models: parameter-server key %d is %s %s on "
                   "one worker and %s %s on another" % (key, known[0], known[1], name, layout))
        _LAYOUTS[key] = (name, layout)


def _fatal(message):
    # An exception here would be swallowed by the C callback and the job would hang;
    # end this server so the launcher tears the job down and reports it.
    log.error("mxhylo server: %s", message)
    print("mxhylo server error: " + message, flush=True)
    os._exit(3)


def pull_shape(layout):
    """Shape the server encodes a chunk's aggregate in: filters x F for a top-k pull
    (a row is a filter), flat otherwise."""
    if layout.pull == "conv_topk":
        return (layout.rows_filters, layout.cols)
    return (layout.size,)


def aggregate_into(key, stored, received):
    """Write what the workers pull for ``key`` into ``stored``, from the summed pushes."""
    entry = _LAYOUTS.get(key)
    if entry is None:
        _fatal("no layout for parameter-server key %d: a worker pushed before sending "
               "the hylo layout table" % key)
    name, layout = entry
    try:
        if _MODE != "run" and layout.stateful_pull:
            _dump_state(key, layout, stored) if _MODE == "dump" else \
                _load_state(key, layout, received)
            return
        if layout.kind == "dense":
            stored[:] = received
            return
        if layout.kind == "probe":
            stored[:] = received * 2 + 1      # proves to the workers that we decode
            return
        if layout.pull == "gather":     # the payloads as they came, for every worker
            _store_rows(stored, layout, gather_values(layout, received))
            return
        dense = _decode(key, name, layout, received)
        if layout.pull == "dense":
            _store_rows(stored, layout, dense)
            return
        aggregate = dense.reshape((-1,))[:layout.size].reshape(pull_shape(layout))
        payload = _PULL.encode("key%d" % key, layout.pull, aggregate, k=layout.pull_k)
        _store_rows(stored, layout, pull_values(layout, payload))
    except Exception as err:  # noqa: BLE001 - any failure here must end the job loudly
        _fatal("decoding key %d (%s, %s) failed: %r" % (key, name, layout.kind, err))


def _decode(key, name, layout, received):
    """The dense float32 aggregate of a compressed chunk, of the key's shape."""
    if layout.kind == "topk":
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
        ops.dequantize_2bit(payload.arrays[0], payload.scalars[0], (layout.size,),
                            out=flat, accumulate=True)
    return dense


def _store_rows(stored, layout, values):
    """stored[:] = ``values`` (NDArray or numpy, row-major) as rows 0, 1, ... listed
    explicitly (zero rows included), so that pulls find rows by position."""
    cols = layout.cols
    n_rows = -(-int(np.prod(values.shape)) // cols)
    if isinstance(values, np.ndarray):
        padded = np.zeros(n_rows * cols, np.float32)
        padded[:values.size] = values.reshape(-1)
        values = mx.nd.array(padded)
    stored[:] = mx.nd.sparse.row_sparse_array(
        (values.reshape((n_rows, cols)), mx.nd.arange(n_rows, dtype=np.int64)),
        shape=layout.key_shape)


def _dump_state(key, layout, stored):
    residual, threshold = _PULL.state("key%d" % key, pull_shape(layout))
    _store_rows(stored, layout, state_values(layout, residual, threshold))


def _load_state(key, layout, received):
    residual, threshold = read_state(layout, received.tostype("default").asnumpy())
    _PULL.set_state("key%d" % key, residual.reshape(pull_shape(layout)), threshold)


def _num_workers():
    return int(os.environ["DMLC_NUM_WORKER"])
