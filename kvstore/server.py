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

from .compressors import PullEncoder
from .wire import (gather_values, pull_values, read_state, rows_from_zero, slot_payload,
                   state_values)

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
        _SERVER.merge_layouts(self.layouts)
        _SERVER.pull.set_threshold_scale(self.threshold_scale)
        if self.mode is not None:
            _SERVER.mode = self.mode

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


class ServerState:
    """Everything one server process keeps between ServerDecoders (a new table of
    layouts, for new keys, or a mode command replaces the decoder, not this):

    layouts: ps key -> (layer name, ChunkLayout), merged from every table received;
    mode: one of MODES; pull: the PullEncoder of re-compressed pulls (its residuals
    are the server's checkpointed state).
    """

    def __init__(self):
        self.layouts = {}
        self.mode = "run"
        self.pull = PullEncoder()

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
            if self.mode != "run" and layout.stateful_pull:
                if self.mode == "dump":
                    residual, threshold = self.pull.state("key%d" % key, pull_shape(layout))
                    stored[:] = rows_from_zero(layout, state_values(layout, residual,
                                                                    threshold))
                else:
                    residual, threshold = read_state(layout,
                                                     received.tostype("default").asnumpy())
                    self.pull.set_state("key%d" % key, residual.reshape(pull_shape(layout)),
                                        threshold)
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
            dense = _decode(key, name, layout, received)
            if layout.pull == "none":
                stored[:] = rows_from_zero(layout, dense)
                return
            aggregate = dense.reshape((-1,))[:layout.size].reshape(pull_shape(layout))
            payload = self.pull.encode("key%d" % key, layout.pull, aggregate,
                                       k=layout.pull_k)
            stored[:] = rows_from_zero(layout, pull_values(layout, payload))
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


def pull_shape(layout):
    """Shape the server encodes a chunk's aggregate in: filters x F for a top-k pull
    (a row is a filter), flat otherwise."""
    if layout.pull == "conv_topk":
        return (layout.rows_filters, layout.cols)
    return (layout.size,)


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
        _SERVER.pull.compressors[payload.strategy].decode(payload, flat, accumulate=True)
    return dense


def _num_workers():
    return int(os.environ["DMLC_NUM_WORKER"])
