"""Keys and placement over MXNet's parameter server: which keys each hylo layer travels
in, on which server, and the table of layouts the servers decode with.

Each layer becomes one or more parameter-server keys ("chunks", kvstore.wire): large
layers are cut into chunks of at most ``chunk_elements`` and every chunk is placed on
the server that carries the least so far, so every server gets a fair share. Small
uncompressed layers exchanged together travel fused in buckets, one key each.
Parameters are broadcast from rank 0 through a dense key of their own. Every key is
made between exchanges (kv.init is collective), and the servers get the new layouts
(a pickled ServerDecoder, kvstore.server) before any push of the new keys.
"""
import dataclasses
import os
import zlib
from dataclasses import dataclass
from typing import Tuple

import mxnet as mx
import numpy as np

from .policy import pull_codec
from .server import ServerDecoder
from .wire import ChunkLayout, plan_chunks, rows_from_zero

# MXNet's default MXNET_KVSTORE_BIGARRAY_BOUND: dist_sync cuts keys from this many elements
MXNET_BIGARRAY_BOUND = 1000 * 1000
# elements of a window of the servers' optimizer state (StateKeys): a save of resnet50's
# SGD momentum (100 MB) takes ~100 windows per server; every worker registers all its
# mailboxes with one push of this size each
STATE_WINDOW = 1 << 17
# a bucket gathers small layers written within this fraction of backward (in gradient
# elements): KeyTable.bucket_groups
BUCKET_SPANS = 8


@dataclass(frozen=True)
class Chunk:
    """One parameter-server key of a layer: its id and its layout (kvstore.wire)."""
    pskey: int
    layout: ChunkLayout


@dataclass(frozen=True)
class BucketKey:
    """The key a sequence of small uncompressed layers travels fused in.

    recv: float32 NDArray (elements,) the fused aggregate is pulled into.
    """
    pskey: int
    layout: ChunkLayout
    recv: mx.nd.NDArray


@dataclass
class StateKeys:
    """The keys the servers' optimizer state travels in (kvstore.server, module
    docstring): per server, one 'mailbox' key per worker (mailboxes[server][rank]),
    read through, and one 'load' key (loads[server]), of STATE_WINDOW elements and
    1 + STATE_WINDOW; not part of the load. ``registered``: whether every worker has
    pushed into every mailbox (kvstore.server_route.ServerRoute.sync_optimizer)."""
    mailboxes: dict
    loads: dict
    registered: bool = False

    @classmethod
    def place(cls, table, keys, values):
        """Place them in ``table`` (a KeyTable), appending each key and its initial
        value (zeros) to ``keys`` and ``values`` for the caller's kv.init."""
        mailboxes, loads = {}, {}
        for server in range(table.num_servers):
            made = []
            for worker in range(table.num_workers + 1):
                kind, size = ("mailbox", STATE_WINDOW) if worker < table.num_workers \
                    else ("load", 1 + STATE_WINDOW)
                pskey = table._key_on(server)
                table.layouts[pskey] = ("optimizer state (%s)" % kind,
                                        ChunkLayout(kind, 0, size, size, server=server))
                keys.append(pskey)
                values.append(mx.nd.zeros((size,)))
                made.append(pskey)
            mailboxes[server], loads[server] = made[:-1], made[-1]
        return cls(mailboxes, loads)


class KeyTable:
    """The parameter-server keys of one worker's hylo layers (see the module docstring).

    kv: the worker's native 'dist_sync' store; chunk_elements, split_elements,
    bucket_elements, compress_pull: see PSTransport. A layer whose stages warm up
    (``layer.warms_up``) gets dense keys for its warm-up too.
    """

    def __init__(self, kv, num_servers, chunk_elements, split_elements, bucket_elements,
                 compress_pull):
        self.kv = kv
        self.rank, self.num_workers = kv.rank, kv.num_workers
        self.num_servers = num_servers
        self.chunk_elements = chunk_elements
        self.split_elements = split_elements
        self.bucket_elements = bucket_elements
        self.compress_pull = compress_pull
        self.layouts = {}         # ps key -> (layer name, ChunkLayout), for the servers
        self.layouts_sent = False
        self.chunks = {}          # hylo key -> [Chunk]
        self.warm_chunks = {}     # hylo key of a compressed layer -> its dense [Chunk]
        self.bucket_keys = {}     # sequence of hylo keys -> BucketKey
        self.pull_buffers = {}    # ps key -> (row_sparse pull buffer, row ids)
        self.layer_shapes = {}    # layer name -> shape
        self._bcast = {}          # hylo key -> ps key of the parameter
        self._next_key = 0
        self._load = [0] * num_servers
        self._weights = None      # seconds per byte per server (use_links), None: equal
        self._link_probes = {}    # (server, sizes) -> the link probe's ps keys
        self.state_keys = None    # StateKeys, with the first 'update' keys
        # workers' model check: each worker writes a fingerprint of every new layer into
        # its own slot of this key; the server's sum gathers them (see check_same_model)
        self._check_key = self._key_on(0)
        self.layouts[self._check_key] = (
            "model check", ChunkLayout("dense", 0, self.num_workers, self.num_workers))
        self.kv.init(self._check_key, mx.nd.zeros((self.num_workers,)))

    # -- ids and placement ---------------------------------------------------------------

    def _key_on(self, server):
        """A fresh key id that MXNet routes to ``server``.

        MXNet sends a key below its big-array bound to server (key * 9973) % S.
        """
        key = self._next_key
        while (key * 9973) % self.num_servers != server:
            key += 1
        self._next_key = key + 1
        return key

    def _place(self, nbytes):
        """A fresh key on the server where it is predicted to finish first (its bytes
        added to the server's load, times the link's seconds per byte: use_links; the
        least-loaded server while no link was measured, or every link is as fast);
        (key, server)."""
        if self._weights is None:
            server = int(np.argmin(self._load))
        else:
            server = int(np.argmin((np.asarray(self._load, np.float64) + nbytes)
                                   * self._weights))
        self._load[server] += nbytes
        return self._key_on(server), server

    def use_links(self, links, split_elements):
        """Place keys made from now on by kvstore.cost_model.LinkCosts ``links`` (None:
        by load alone) and cut layers that put ``split_elements`` or more elements on
        the wire over the servers. Keys already made stay where they are."""
        self._weights = None if links is None else \
            np.asarray(links.placement_weights(), np.float64)
        self.split_elements = int(split_elements)

    def link_probe_keys(self, server, sizes):
        """Dense keys on ``server`` of ``sizes`` float32 elements, for timing that link
        (kvstore.cost_model.LinkCosts): made once (collective), never part of the load."""
        sizes = tuple(int(n) for n in sizes)
        keys = self._link_probes.get((server, sizes))
        if keys is None:
            keys = [self._key_on(server) for _ in sizes]
            for key, n in zip(keys, sizes):
                self.layouts[key] = ("link probe", ChunkLayout("dense", 0, n, n,
                                                               server=server))
            self.kv.init(keys, [mx.nd.zeros((n,)) for n in sizes])
            self.send_layouts()
            self._link_probes[(server, sizes)] = keys
        return keys

    def _route_chunks(self, shape):
        """Dense pieces of a parameter on the servers' route, cut as MXNet cuts a
        dist_sync key: whole below its big-array bound (MXNET_KVSTORE_BIGARRAY_BOUND,
        1e6 elements by default), else into a multiple of the number of servers (and
        pieces of at most chunk_elements)."""
        bound = int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", MXNET_BIGARRAY_BOUND))
        return plan_chunks("none", shape, self.num_workers, self.num_servers,
                           self.chunk_elements, bound)

    # -- the servers' layout table -------------------------------------------------------

    def send_layouts(self, route=None):
        """Send the servers every key's layout (and a kvstore.server.RouteOptimizer for
        the 'update' keys)."""
        self.kv.set_optimizer(ServerDecoder(self.layouts, route))
        self.layouts_sent = True

    def send_route(self, route):
        """Send the servers a kvstore.server.RouteOptimizer, with every layout if a key
        was made since the last send, else alone (a learning rate that changes every
        step sends a few hundred bytes, not the table)."""
        if not self.layouts_sent:
            self.send_layouts(route=route)
            return
        self.kv.set_optimizer(ServerDecoder({}, route))

    def send_fills(self, fills):
        """Have the servers write windows of their optimizer state into mailboxes
        (``fills``: 'mailbox' ps key -> offset in its server's stream; kvstore.server);
        returns once every server has."""
        self.kv.set_optimizer(ServerDecoder({}, fills=fills))

    def check_servers_decode(self):
        """Fail fast unless every server runs hylo's decoder.

        A server that cannot import mxhylo only logs the failed unpickling and goes on
        summing, which would hand the workers raw payloads as gradients. Each server
        gets a probe key whose pull proves the decoder ran.
        """
        probes = []
        for server in range(self.num_servers):
            key = self._key_on(server)
            self.layouts[key] = ("probe", ChunkLayout("probe", 0, 1, 1, server=server))
            probes.append(key)
        self.kv.init(probes, [mx.nd.zeros((1,)) for _ in probes])
        self.send_layouts()
        outs = [mx.nd.zeros((1,)) for _ in probes]
        for key in probes:
            self.kv.push(key, mx.nd.ones((1,)))
        self.kv.pull(probes, out=outs)
        got = [float(o.asscalar()) for o in outs]
        bad = [s for s, v in enumerate(got) if v != 2 * self.num_workers + 1]
        if bad:
            raise RuntimeError(
                "parameter server(s) %s do not run hylo's decoder (probe returned %s, "
                "expected %d): a server process must be able to import mxhylo; see that "
                "server's output for the import error" % (
                    bad, [got[s] for s in bad], 2 * self.num_workers + 1))

    def share_from_rank0(self, values):
        """Rank 0's float32 ``values`` (1-D numpy) on every worker (a collective: each
        worker calls it at the same point). MXNet's init stores rank 0's value only."""
        key = self._key_on(0)
        mine = mx.nd.array(np.asarray(values, np.float32).ravel())
        self.kv.init(key, mine)
        got = mx.nd.zeros(mine.shape)
        self.kv.pull(key, out=got)
        return got.asnumpy()

    def check_same_model(self, layer):
        """Raise unless every worker has the same layer (shape, strategy) at this point.

        Without this check a worker whose model differs dies in ps-lite with a size
        check that does not say why.
        """
        self._check_same(repr((layer.plan.shape, layer.plan.strategy)),
                         "layer %r (key %r) is %s with policy %s" % (
                             layer.plan.name, layer.key, layer.plan.shape,
                             layer.plan.strategy))

    def every_workers_value(self, value):
        """Every worker's float32 ``value``, by rank: float32 numpy (num_workers,) (a
        collective: each worker writes its slot of one key, the servers' sum gathers
        them; the same key every time)."""
        slots = np.zeros(self.num_workers, np.float32)
        slots[self.rank] = value
        got = mx.nd.zeros((self.num_workers,))
        self.kv.push(self._check_key, mx.nd.array(slots))
        self.kv.pull(self._check_key, out=got)
        return got.asnumpy()

    def _check_same(self, text, described):
        """Raise, saying ``described`` (this worker's), unless every worker passes the
        same ``text`` at this point (a collective)."""
        mine = float(zlib.crc32(text.encode()) % (1 << 23) + 1)      # exact in float32
        if not np.all(self.every_workers_value(mine) == mine):
            raise RuntimeError("workers train different models: %s on worker %d, and "
                               "differs on another worker" % (described, self.rank))

    # -- a layer's keys ------------------------------------------------------------------

    def init(self, layers, values):
        """Create the keys of those of ``layers`` that have none yet (every worker calls
        this with the same layers, in the same order): each layer's broadcast key,
        initialised with rank 0's value (``values``, one per layer), and the keys of
        its exchanges. One model check and one kv.init (one barrier) for them all: a
        model of 161 layers made key by key took 161 barriers at its first step."""
        new = [(l, v) for l, v in zip(layers, values) if l.key not in self.chunks]
        if not new:
            return
        self._check_same(repr([(l.plan.shape, l.plan.strategy) for l, _ in new]),
                         "the layers %s are %s" % (
                             [l.plan.name for l, _ in new][:5],
                             [(l.plan.shape, l.plan.strategy) for l, _ in new][:5]))
        keys, inits = [], []
        for layer, value in new:
            self._add_layer(layer, value, keys, inits)
        self.kv.init(keys, inits)       # one barrier for every new layer
        self.layouts_sent = False

    def _add_layer(self, layer, value, keys, values):
        """Place ``layer``'s keys (its broadcast key holding a copy of ``value``, its
        warm-up keys, its exchange keys), appending each key and initial value."""
        bkey, _ = self._place(0)  # used once, at init: not part of the steady load
        # a copy: MXNet sends nothing from an array in oneDNN's own layout (a weight
        # after an inference forward), kvstore.trainer_hook says why
        keys.append(bkey)
        values.append(value.copy())
        warm = []
        if layer.warms_up and layer.plan.strategy != "none":
            # dense keys for the warm-up steps (not counted in the steady load)
            for chunk in plan_chunks("none", layer.plan.shape, self.num_workers,
                                     self.num_servers, self.chunk_elements,
                                     self.split_elements):
                server = len(warm) % self.num_servers
                pskey = self._key_on(server)
                chunk = dataclasses.replace(chunk, server=server)
                warm.append(Chunk(pskey, chunk))
                self.layouts[pskey] = (layer.plan.name + " (warm-up)", chunk)
                keys.append(pskey)
                values.append(mx.nd.zeros(chunk.key_shape, ctx=mx.cpu()))
        self.chunks[layer.key] = self._new_chunks(layer, keys, values)
        self._bcast[layer.key] = bkey
        if warm:
            self.warm_chunks[layer.key] = warm
        self.layer_shapes[layer.plan.name] = tuple(layer.plan.shape)

    def _new_chunks(self, layer, keys, values):
        """[Chunk] of ``layer``'s plan, each placed on the least-loaded server, its
        layout recorded for the servers; appends each key and its initial value to
        ``keys`` and ``values`` (for the caller's kv.init)."""
        chunks = []
        for chunk in plan_chunks(layer.plan.strategy, layer.plan.shape, self.num_workers,
                                 self.num_servers, self.chunk_elements, self.split_elements,
                                 pull=pull_codec(layer.plan.strategy, self.compress_pull),
                                 pull_rate=layer.plan.rate, push_k=layer.plan.k):
            pskey, server = self._place(chunk.wire_nbytes)
            chunk = dataclasses.replace(chunk, server=server)
            chunks.append(Chunk(pskey, chunk))
            self.layouts[pskey] = (layer.plan.name, chunk)
            keys.append(pskey)
            if chunk.kind == "dense":
                values.append(mx.nd.zeros(chunk.key_shape, ctx=mx.cpu()))
            else:
                values.append(rows_from_zero(chunk, mx.nd.zeros(chunk.key_shape)))
                self.pull_buffers[pskey] = (
                    mx.nd.sparse.zeros("row_sparse", chunk.key_shape),
                    mx.nd.arange(chunk.pull_rows, dtype=np.int64))
        return chunks

    def update_keys(self, params):
        """Keys for parameters whose optimizer runs on the servers
        (kvstore.server_route). ``params``: (name, value) per parameter; returns per
        parameter its [Chunk] of kind 'update': dense pieces cut as dist_sync cuts its
        keys (_route_chunks), each placed on the least-loaded server, initialized with
        rank 0's ``value``. The first call also makes the keys the servers' optimizer
        state travels in (``state_keys``). Collective: every worker calls this, in the
        same order (one barrier for all the keys). Their layouts reach the servers with
        the next send_layouts."""
        self._check_same(repr([("update", v.shape) for _, v in params]),
                         "the parameters %s are %s" % ([n for n, _ in params][:5],
                                                       [v.shape for _, v in params][:5]))
        keys, values, made = [], [], []
        for name, value in params:
            chunks = []
            for layout in self._route_chunks(value.shape):
                pskey, server = self._place(layout.wire_nbytes)
                layout = dataclasses.replace(layout, kind="update", server=server)
                self.layouts[pskey] = (name, layout)
                chunks.append(Chunk(pskey, layout))
            flat = value.reshape((-1,))
            keys += [c.pskey for c in chunks]
            values += [flat[c.layout.lo:c.layout.hi] for c in chunks]
            made.append(chunks)
        if self.state_keys is None:
            self.state_keys = StateKeys.place(self, keys, values)
        self.kv.init(keys, values)      # one barrier for every parameter
        self.layouts_sent = False
        return made

    def replan(self, old, new):
        """Keys for ``new``: layer ``old`` (the same key and shape) under another plan
        (kvstore.hylo.recheck_costs). Collective, as init is: every worker calls it at
        the same point, between exchanges. A compressed layer going dense takes its
        warm-up keys (dense keys of its shape) if it has them; a dense layer going
        compressed keeps its dense keys as warm-up keys, for a later way back. Keys
        left unused stay on the servers (a few per re-plan)."""
        self.check_same_model(new)
        for c in self.chunks[old.key]:
            self._load[c.layout.server] -= c.layout.wire_nbytes
        spare = self.warm_chunks.pop(old.key, None)
        keys, values = [], []
        if new.plan.strategy == "none" and spare is not None:
            chunks = spare      # (their layouts, "(warm-up)" in name, stay as the servers
            for c in chunks:    # have them: a key's layout never changes)
                self._load[c.layout.server] += c.layout.wire_nbytes
        else:
            chunks = self._new_chunks(new, keys, values)
        if old.plan.strategy == "none" and new.plan.strategy != "none":
            self.warm_chunks[old.key] = self.chunks[old.key]
        if keys:
            self.kv.init(keys, values)
        self.chunks[old.key] = chunks
        self.layouts_sent = False

    def broadcast_key(self, layer):
        """The dense key rank 0's value of ``layer`` was initialised in."""
        return self._bcast[layer.key]

    def route(self, layer, payload):
        """The [Chunk] a payload travels in: the layer's own keys, or for a compressed
        layer's warm-up (dense) payload its dense keys."""
        if payload.strategy == "none" and layer.plan.strategy != "none":
            warm = self.warm_chunks.get(layer.key)
            if warm is None:
                raise RuntimeError("layer %r sent uncompressed without warm-up keys: create "
                                   "the store with warmup_steps > 0" % (layer.plan.name,))
            return warm
        return self.chunks[layer.key]

    # -- buckets -------------------------------------------------------------------------

    def fusable(self, layer):
        """Whether the layer travels fused into a bucket: uncompressed, one key, small."""
        return (layer.plan.strategy == "none" and len(self.chunks[layer.key]) == 1
                and layer.plan.size <= self.bucket_elements)

    def bucket_groups(self, layers):
        """The fusable layers of ``layers`` (a call's, in its order: backward's), cut
        into groups of at most bucket_elements (summed over each group's layers). A
        group also ends where the layers from its first member on (every layer, fused
        or not) exceed 1/BUCKET_SPANS of the call's elements (or bucket_elements, if
        more): a bucket leaves when its last member's gradient is written, so it
        gathers small layers written close together, not the first and the last."""
        span_limit = max(self.bucket_elements,
                         sum(layer.plan.size for layer in layers) // BUCKET_SPANS)
        groups, group, total, span = [], [], 0, 0
        for layer in layers:
            size = layer.plan.size
            span += size
            if not self.fusable(layer):
                continue
            if group and (total + size > self.bucket_elements or span > span_limit):
                groups.append(group)
                group, total, span = [], 0, size
            group.append(layer)
            total += size
        if group:
            groups.append(group)
        return groups

    def prepare(self, layers):
        """Create the keys an exchange of ``layers`` (in the order given) needs and does
        not have yet: the bucket of a new sequence of small layers; then send the
        servers any layout they do not have. Called before the exchange's first push.
        Returns the exchange's bucket groups (lists of fusable layers, in that order:
        the same on every worker, whatever order the layers are then pushed in).

        kv.init is collective (rank 0 pushes the value, then every worker meets at a
        barrier), so every key is made here, between exchanges, with no push of this
        worker in flight, and the servers get the new layouts before any push of that
        key: key creation is ordered with respect to the traffic on every worker.
        """
        for layer in layers:
            if layer.key not in self.chunks:
                raise KeyError("key %r (%s) was pushed before being initialised: call "
                               "broadcast first" % (layer.key, layer.plan.name))
        groups = self.bucket_groups(layers)
        keys, values = [], []
        for group in groups:
            signature = bucket_signature(group)
            if len(group) == 1 or signature in self.bucket_keys:
                continue
            size = sum(layer.plan.size for layer in group)
            chunk = ChunkLayout("dense", 0, size, size)
            pskey, server = self._place(chunk.wire_nbytes)
            chunk = dataclasses.replace(chunk, server=server)
            self.layouts[pskey] = ("bucket:" + ",".join(l.plan.name for l in group), chunk)
            self.layouts_sent = False
            keys.append(pskey)
            values.append(mx.nd.zeros((size,)))
            self.bucket_keys[signature] = BucketKey(pskey, chunk, mx.nd.empty((size,)))
        if keys:
            self.kv.init(keys, values)      # one barrier for every new bucket
        if not self.layouts_sent:
            self.send_layouts()
        return groups


def bucket_signature(layers) -> Tuple:
    """The bucket a group of layers travels in is named by their keys, in order."""
    return tuple(layer.key for layer in layers)
