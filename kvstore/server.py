"""What runs on the parameter servers: decode the workers' payloads and aggregate.

MXNet's supported hook for server-side code is the optimizer a worker sends with
kv.set_optimizer(): the servers unpickle it (importing mxhylo there) and call its
update for every key once all workers have pushed it, with the summed pushes as the
gradient and the stored array as the weight. ``ServerDecoder`` is such an optimizer:
it carries the wire layout of every key (kvstore.wire) and, instead of updating
weights, writes the dense float32 aggregate into the stored array for the workers
to pull.
"""
import logging
import os

import mxnet as mx
import numpy as np

from .. import ops
from .wire import unpack_codes

log = logging.getLogger("mxhylo.server")


class ServerDecoder(mx.optimizer.Optimizer):
    """Decodes and aggregates hylo payloads on a server (pickled to it by the workers).

    layouts: dict ps key (int) -> (layer name, ChunkLayout). Sent again, complete,
    whenever the workers define new keys; a key whose layout differs from what another
    worker sent means the workers train different models, which ends the server with
    an error saying so.
    """

    def __init__(self, layouts, **kwargs):
        super().__init__(**kwargs)
        self.layouts = dict(layouts)

    def __setstate__(self, state):
        super().__setstate__(state)
        _merge_layouts(self.layouts)

    def create_state(self, index, weight):
        return None

    def create_state_multi_precision(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        for i, w, g in zip(_as_list(index), _as_list(weight), _as_list(grad)):
            aggregate_into(i, w, g)

    update_multi_precision = update


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


# Layouts known to this server process, merged over every table received; module
# level so that a new table (new keys) does not forget the old ones.
_LAYOUTS = {}


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


def aggregate_into(key, stored, received):
    """Write the aggregate of the summed pushes ``received`` into ``stored`` for key."""
    entry = _LAYOUTS.get(key)
    if entry is None:
        _fatal("no layout for parameter-server key %d: a worker pushed before sending "
               "the hylo layout table" % key)
    name, layout = entry
    try:
        if layout.kind == "dense":
            stored[:] = received
            return
        if layout.kind == "probe":
            stored[:] = received * 2 + 1      # proves to the workers that we decode
            return
        if layout.kind == "topk":
            # The server's sum of the workers' row_sparse pushes is the scatter-add.
            dense = received.tostype("default")
        else:
            rows = received.indices.asnumpy()
            data = received.data.asnumpy()
            dense = mx.nd.zeros(layout.key_shape, dtype=np.float32)
            flat = dense.reshape((-1,))[:layout.size]
            n_words = -(-layout.size // 16)
            for w in range(_num_workers()):
                lo = w * layout.slot_rows
                mine = (rows >= lo) & (rows < lo + layout.slot_rows)
                if not mine.any():
                    _fatal("key %d (%s): worker slot %d is empty" % (key, name, w))
                slot = data[mine].reshape(-1)
                codes = unpack_codes(slot[1:], n_words)
                ops.dequantize_2bit(mx.nd.array(codes, dtype=np.int32), float(slot[0]),
                                    (layout.size,), out=flat, accumulate=True)
        # List every row, zero rows included, so that pulls find rows by position.
        stored[:] = mx.nd.sparse.row_sparse_array(
            (dense, mx.nd.arange(layout.rows, dtype=np.int64)), shape=layout.key_shape)
    except Exception as err:  # noqa: BLE001 - any failure here must end the job loudly
        _fatal("decoding key %d (%s, %s) failed: %r" % (key, name, layout.kind, err))


def _num_workers():
    return int(os.environ["DMLC_NUM_WORKER"])
