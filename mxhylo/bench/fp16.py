"""MXNet's dist_sync moving float16 gradients: the ``dist_sync_fp16`` peer of bench train
and bench comm (:class:`DistSyncFP16Store`).

MXNet 1.9.1 offers no float16 transport of float32 gradients (its only gradient
compression is 2-bit), and training the model in float16 (``multi_precision``) would
change the computation, not only what travels. What a user does to halve dist_sync's
bytes while forward, backward, weights and the optimizer stay float32 is cast each
gradient to float16 around the store's pushpull: this adapter does that over one native
``mx.kv.create('dist_sync')`` store, called by gluon.Trainer's own per-key loop.
"""
import mxnet as mx
import numpy as np

from .native_store import WorkerUpdateStore

# native key of key k's float16 gradients: HALF_KEY_OFFSET + k. Small enough that
# MXNet's KVStoreDist picks a small key's server as (key * 9973) % servers in int32.
HALF_KEY_OFFSET = 1 << 16


def _as_lists(key, value):
    if isinstance(key, (list, tuple)):
        return list(key), list(value)
    return [key], [value]


def _arrays(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


class DistSyncFP16Store(WorkerUpdateStore):
    """One native dist_sync store whose gradient exchange moves float16, for
    ``gluon.Trainer(params, 'sgd', ..., kvstore=DistSyncFP16Store())``.

    Keys are Gluon's (a parameter's index, 0 <= key < HALF_KEY_OFFSET). Each key k
    has two native keys, because a native dist key must always travel with one size
    and one dtype:

    * k, float32: the parameter itself, used once, by ``broadcast`` (``init`` from
      rank 0 then ``pull``): every worker starts from rank 0's float32 weights exactly;
    * HALF_KEY_OFFSET + k, float16, the parameter's shape (initialised with zeros by
      the same ``init``): every gradient exchange.

    ``pushpull(k, grads)``: this worker's float32 gradient (the sum over its devices
    if several) is cast to float16 into the key's own buffer, the buffer is
    pushpulled in place (2 bytes an element each way instead of 4; the servers add the
    workers' float16 values in float16 and return the sum), and the float16 sum is cast
    back into the float32 outputs (the gradients themselves when ``out`` is None, as
    Gluon calls it). Rounding: each element once to float16 (relative 2**-11) plus the
    servers' float16 additions; magnitudes under float16's smallest subnormal (6e-8)
    become 0, as with Horovod's hvd.Compression.fp16 (neither scales the loss). Every
    worker receives the same bytes, so workers stay bitwise identical.

    The optimizer runs on the workers, in float32: ``is_capable('optimizer')`` is
    False, so gluon.Trainer takes update_on_kvstore=False (with the update on the
    servers they would hold the weights in float16).

    Rank 0's initial values are sent from copies: a weight left in oneDNN's own layout
    by a forward cannot be sent by MXNet's KVStoreDist (see mxhylo's
    kvstore.trainer_hook); the float32 and float16 keys being distinct, the first
    gradient exchange cannot overtake a worker's pull of the initial value either.
    """

    def __init__(self, kvstore_type="dist_sync"):
        self._kv = mx.kv.create(kvstore_type)
        self._half = {}             # key -> its float16 buffer (sent and received)

    @staticmethod
    def half_key(key):
        """The native key carrying ``key``'s float16 gradients."""
        key = int(key)
        if not 0 <= key < HALF_KEY_OFFSET:
            raise ValueError("DistSyncFP16Store takes keys 0 <= key < %d, got %d"
                             % (HALF_KEY_OFFSET, key))
        return HALF_KEY_OFFSET + key

    def init(self, key, value):
        """Native ``init`` of the keys with (copies of) ``value`` and of their float16
        twins with zeros, in one call (one barrier of the job)."""
        keys, values = _as_lists(key, value)
        firsts = [_arrays(v)[0] for v in values]
        halves = [mx.nd.zeros(v.shape, ctx=v.context, dtype="float16") for v in firsts]
        self._kv.init(keys + [self.half_key(k) for k in keys],
                      [v.copy() for v in firsts] + halves)
        self._half.update(zip([int(k) for k in keys], halves))

    def broadcast(self, key, value, out, priority=0):
        """Rank 0's ``value`` into every worker's ``out``, in float32."""
        self.init(key, value)
        self._kv.pull(key, out=out, priority=priority)

    def pushpull(self, key, value, out=None, priority=0):
        """The workers' sum of ``value`` into ``out`` (None: into ``value``), moved as
        float16 (see the class)."""
        if isinstance(key, (list, tuple)):
            outs = out if out is not None else [None] * len(key)
            for k, v, o in zip(key, value, outs):
                self.pushpull(k, v, o, priority)
            return
        try:
            half = self._half[int(key)]
        except KeyError:
            raise KeyError("DistSyncFP16Store: key %s was never initialised (broadcast "
                           "or init it first)" % key) from None
        values = _arrays(value)
        outs = values if out is None else _arrays(out)
        grad = values[0] if len(values) == 1 else mx.nd.add_n(*values)
        mx.nd.Cast(grad, dtype="float16", out=half)
        self._kv.pushpull(self.half_key(key), half, out=half, priority=priority)
        for o in outs:
            mx.nd.Cast(half, dtype=np.dtype(o.dtype).name, out=o)

