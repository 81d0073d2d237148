"""The benchmarks' one vocabulary of modes: what each mode runs, as data.

comm, train and accuracy take ``--modes`` from :data:`MODES`. A mode is a store, how
its job is started, and that store's options:

* ``store``: 'dist_sync' (MXNet's dense store), 'dist_sync_fp16' and 'mxnet_2bit'
  (adapters over one native dist_sync store, below), 'horovod' (Horovod's allreduce of
  every gradient) or 'hylo' (``mxhylo.create('dist_sync_hylo', **options)``);
* ``launch``: 'ps' (a scheduler, servers and workers) or 'horovod' (W processes with
  horovodrun's Gloo environment, no servers);
* ``options``: the store's options; ``switches``: module attributes the worker sets
  before it makes the store (what no option can say); ``batch_schedule``: a growing
  batch (train --tta only: mxhylo.schedules.StepBatch); ``sync_batchnorm``: BatchNorm over
  every worker's batch (train only: mxhylo.sync_batchnorm, as ``mxhylo.run
  --sync-batchnorm``).

``hylo`` is the store's defaults, what ``kvstore='dist_sync_hylo'`` gives a user; the
other hylo modes are named variants. The peers are the modes whose store is not
hylo: what a user would run instead of mxhylo.

Every store sums the workers' gradients: a Trainer steps with the global batch.
"""
import importlib
from typing import NamedTuple

from mxnet.kvstore import KVStoreBase


class Mode(NamedTuple):
    store: str
    launch: str = "ps"
    options: tuple = ()             # (name, value) pairs
    switches: tuple = ()            # (module, attribute, value)
    batch_schedule: bool = False
    sync_batchnorm: bool = False
    help: str = ""

    @property
    def peer(self):
        """What a user would run instead of mxhylo (a *_syncbn mode trains another
        arithmetic, so it is not a peer of the others)."""
        return self.store != "hylo" and not self.sync_batchnorm


MODES = {
    "dist_sync": Mode("dist_sync", help="MXNet's dist_sync, dense float32, gluon.Trainer's "
                      "defaults (the update on the servers)"),
    "dist_sync_fp16": Mode("dist_sync_fp16", help="dist_sync moving float16 gradients (cast "
                           "around the store's pushpull), weights and update float32 on "
                           "the workers"),
    "mxnet_2bit": Mode("mxnet_2bit", options=(("threshold", 0.5),), help="dist_sync with "
                       "MXNet's 2-bit compression (threshold 0.5): push, then pull the "
                       "dense sum; update on the workers"),
    "horovod_dense": Mode("horovod", "horovod", help="Horovod's ring allreduce of every "
                          "gradient as hvd.DistributedTrainer runs it (Gloo, tensor "
                          "fusion); update on the workers; no servers"),
    "horovod_fp16": Mode("horovod", "horovod", (("compression", "fp16"),),
                         help="horovod_dense with hvd.Compression.fp16"),
    "hylo": Mode("hylo", help="mxhylo.create('dist_sync_hylo'): the store's defaults"),
    "hylo_horovod": Mode("hylo", "horovod", (("transport", "horovod"),),
                         help="mxhylo.create('dist_sync_hylo', transport='horovod')"),
    "hylo_dense_pull": Mode("hylo", options=(("compress_pull", False),), help="Hylo as "
                            "published: compressed push, dense pull (compress_pull=False)"),
    "hylo_rule": Mode("hylo", options=(("cost_model", False),), help="every layer as the "
                      "policy's rule plans it, nothing measured (cost_model=False): the "
                      "most compression the defaults offer"),
    "hylo_workers": Mode("hylo", options=(("server_update", False),), help="the update "
                         "on the workers whatever the network (server_update=False)"),
    "hylo_shared": Mode("hylo", switches=(("mxhylo.kvstore.plan", "SHARED_SCALE_WORKERS", 1),),
                        help="the plan's shared_2bit rule at any number of workers"),
    "hylo_nooverlap": Mode("hylo", switches=(("mxhylo.kvstore.hylo", "OVERLAP", False),),
                           help="the exchange starts once backward has ended"),
    "dist_sync_dynamic": Mode("dist_sync", batch_schedule=True, help="dist_sync with a "
                              "growing batch (train --tta: --tta-batch-schedule)"),
    "hylo_dynamic": Mode("hylo", batch_schedule=True, help="hylo with a growing batch "
                         "(train --tta: --tta-batch-schedule)"),
    "dist_sync_syncbn": Mode("dist_sync", sync_batchnorm=True, help="dist_sync with "
                             "BatchNorm over every worker's batch (mxhylo.run "
                             "--sync-batchnorm; train only)"),
    "hylo_syncbn": Mode("hylo", sync_batchnorm=True, help="hylo with BatchNorm over every "
                        "worker's batch (mxhylo.run --sync-batchnorm; train only)"),
}
HEADLINE = ("dist_sync", "dist_sync_fp16", "horovod_dense", "horovod_fp16", "hylo",
            "hylo_horovod")


def exchange_modes():
    """The modes whose job is the exchange alone (comm): not the training-only ones."""
    return [m for m in MODES if not (MODES[m].batch_schedule or MODES[m].sync_batchnorm)]


def mode(name):
    return MODES[name]


def parse_modes(text, allowed=None):
    """--modes: a comma-separated list of known, distinct modes; ValueError otherwise."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    allowed = set(MODES) if allowed is None else set(allowed)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError("unknown mode %s (choose from %s)"
                         % (", ".join(bad) or "''", ", ".join(sorted(allowed))))
    if len(set(names)) != len(names):
        raise ValueError("--modes lists a mode twice: %s" % text)
    return names


def hylo_options(text):
    """--hylo-options: a JSON object of mxhylo.create options; ValueError otherwise."""
    import json
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ValueError("--hylo-options is not JSON: %s" % err)
    if not isinstance(options, dict):
        raise ValueError("--hylo-options must be a JSON object, e.g. '{\"warmup_steps\": "
                         "0}', got %r" % (text,))
    return options


def describe(names):
    return {n: mode(n).help for n in names}


def table():
    """The modes for --help: name, store and launch, what it runs."""
    import textwrap
    lines = ["modes (mxhylo.bench.modes):"]
    for name, m in MODES.items():
        lines += textwrap.wrap(m.help, 88, initial_indent="  %-18s" % name,
                               subsequent_indent=" " * 20)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- in a worker

def make_store(name, hylo_options=None, one_process=False):
    """(store, update_on_kvstore for gluon.Trainer: None = Gluon's default) of mode
    ``name``, made in a worker of its job (``one_process``: one process, no job)."""
    m = mode(name)
    for module, attr, value in m.switches:
        setattr(importlib.import_module(module), attr, value)
    options = dict(m.options)
    if m.store == "hylo":
        import mxhylo
        options = dict(hylo_options or {}, **options)
        return mxhylo.create("hylo" if one_process else "dist_sync_hylo", **options), None
    if m.store == "horovod":
        return HorovodStore(**options), False
    if m.store == "dist_sync_fp16":
        return DistSyncFP16Store("device" if one_process else "dist_sync"), False
    if m.store == "mxnet_2bit":
        return PushThenPull(options["threshold"]), False
    import mxnet as mx
    return mx.kv.create("device" if one_process else "dist_sync"), None


def _lists(key, value, out):
    if isinstance(key, (list, tuple)):
        return list(key), list(value), list(out) if out is not None else [None] * len(key)
    return [key], [value], [out]


def _arrays(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _total(values):
    import mxnet as mx
    return values[0] if len(values) == 1 else mx.nd.add_n(*values)


class WorkerUpdateStore(KVStoreBase):
    """A store gluon.Trainer can take whose update runs on the workers."""

    @staticmethod
    def is_capable(capability):
        return False

    def set_optimizer(self, optimizer):
        raise NotImplementedError("%s updates on the workers" % type(self).__name__)

    @property
    def type(self):
        return self._kv.type

    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers


class DistSyncFP16Store(WorkerUpdateStore):
    """One native dist_sync store moving float16 gradients.

    Key k (a Trainer's parameter index, < HALF_KEY_OFFSET) has two native keys: k in
    float32 for ``broadcast`` (rank 0's weights, exactly), HALF_KEY_OFFSET + k in
    float16 for every exchange: the gradient (summed over devices) is cast into the
    key's float16 buffer, pushpulled in place, and the float16 sum cast back into the
    float32 outputs (the gradients when ``out`` is None). Values under float16's
    smallest subnormal become 0, as with hvd.Compression.fp16."""
    HALF_KEY_OFFSET = 1 << 16

    def __init__(self, kvstore_type="dist_sync"):
        import mxnet as mx
        self._kv, self._half = mx.kv.create(kvstore_type), {}

    @classmethod
    def half_key(cls, key):
        if not 0 <= int(key) < cls.HALF_KEY_OFFSET:
            raise ValueError("keys must be in [0, %d), got %s" % (cls.HALF_KEY_OFFSET, key))
        return cls.HALF_KEY_OFFSET + int(key)

    def broadcast(self, key, value, out, priority=0):
        import mxnet as mx
        keys, values, outs = _lists(key, value, out)
        firsts = [_arrays(v)[0] for v in values]
        halves = [mx.nd.zeros(v.shape, ctx=v.context, dtype="float16") for v in firsts]
        # copies: a weight left in oneDNN's layout by a forward cannot be sent as it is
        self._kv.init(keys + [self.half_key(k) for k in keys],
                      [v.copy() for v in firsts] + halves)
        self._half.update(zip([int(k) for k in keys], halves))
        self._kv.pull(key, out=out, priority=priority)

    def pushpull(self, key, value, out=None, priority=0):
        import mxnet as mx
        import numpy as np
        for k, v, o in zip(*_lists(key, value, out)):
            if int(k) not in self._half:
                raise KeyError("key %s was never initialised (broadcast it first)" % k)
            half, values = self._half[int(k)], _arrays(v)
            mx.nd.Cast(_total(values), dtype="float16", out=half)
            self._kv.pushpull(self.half_key(k), half, out=half, priority=priority)
            for o_ in (values if o is None else _arrays(o)):
                mx.nd.Cast(half, dtype=np.dtype(o_.dtype).name, out=o_)


class PushThenPull(WorkerUpdateStore):
    """A native dist store with MXNet's 2-bit compression that gluon.Trainer can use:
    MXNet 1.9.1 aborts ``pushpull`` once compression is on, so each key is pushed
    (compressed, with MXNet's residual) then the servers' sum pulled into the outputs.
    A dist_sync server answers a pull only once every worker's push is merged."""

    def __init__(self, threshold, kvstore_type="dist_sync"):
        import mxnet as mx
        self._kv = mx.kv.create(kvstore_type)
        self._kv.set_gradient_compression({"type": "2bit", "threshold": float(threshold)})

    def broadcast(self, key, value, out, priority=0):
        self._kv.broadcast(key, value, out, priority=priority)

    def pushpull(self, key, value, out=None, priority=0):
        self._kv.push(key, value, priority=priority)
        self._kv.pull(key, out=value if out is None else out, priority=priority)


class HorovodStore(WorkerUpdateStore):
    """Horovod's allreduce of every gradient, as hvd.DistributedTrainer makes it: per key,
    ``allreduce_`` (name str(key), the Trainer's priority) fused by Horovod's
    background thread; with ``compression`` (an hvd.Compression member's name) the
    tensor is compressed before and decompressed after. It sums (average=False)."""

    def __init__(self, compression=None):
        from mxhylo.kvstore.transport_horovod import import_horovod
        self.hvd = import_horovod()
        self.compression = getattr(self.hvd.Compression, compression or "none")

    type = "horovod"

    @property
    def rank(self):
        return self.hvd.rank()

    @property
    def num_workers(self):
        return self.hvd.size()

    def broadcast(self, key, value, out, priority=0):
        import mxnet as mx
        for k, v, o in zip(*_lists(key, value, out)):
            first = _arrays(v)[0]
            tensor = mx.nd.array(first.asnumpy(), ctx=first.context)  # default layout
            self.hvd.broadcast_(tensor, root_rank=0, name="broadcast.%s" % k)
            for o_ in _arrays(o):
                o_[:] = tensor

    def pushpull(self, key, value, out=None, priority=0):
        none = self.hvd.Compression.none
        for k, v, o in zip(*_lists(key, value, out)):
            values = _arrays(v)
            outs = values if o is None else _arrays(o)
            if self.compression is none:
                tensor, ctx = outs[0], None
                if o is not None or len(values) > 1:
                    tensor[:] = _total(values)
            else:
                tensor, ctx = self.compression.compress(_total(values))
            self.hvd.allreduce_(tensor, average=False, name=str(k), priority=priority)
            for o_ in outs:
                if o_ is not tensor:
                    o_[:] = self.compression.decompress(tensor, ctx)
