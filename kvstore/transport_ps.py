"""Transport over MXNet's own parameter server (ps-lite, kvstore dist_sync): the exchange.

A worker pushes only its compressed payload into the layer's keys (kvstore.ps_keys
says which keys, on which server; kvstore.wire how the payload sits in them), the
servers decode and aggregate (kvstore.server, sent to them as a pickled optimizer,
MXNet's hook for server-side code), and the worker pulls the aggregate (dense
float32, or the workers' payloads gathered) and decodes it. Every worker pulls the
same bytes, so every worker writes the same aggregate. A bound on every exchange:
kvstore.watchdog.
"""
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mxnet as mx
import numpy as np

from .. import ops
from .compressors import Payload, make_compressors
from .cost_model import LinkCosts
from .ps_keys import Chunk, KeyTable, bucket_signature
from .transport import Traffic, Transport, wait_timed
from .watchdog import StallWatchdog
from .wire import (BIGARRAY_BOUND, DEFAULT_CHUNK_ELEMENTS, DEFAULT_SPLIT_MIN, ROW_ID_BYTES,
                   ChunkLayout, empty_push, gather_payloads, gathered_slots, push_slot, push_rows,
                   summed_aggregate, agreed_header, flat as wire_flat)

# The keys' sizes (tuning constants, not options: tests of the cutting set them lower).
# The largest piece of a layer in one parameter-server key, in float32 elements.
CHUNK_ELEMENTS = DEFAULT_CHUNK_ELEMENTS
# Uncompressed layers exchanged together travel fused into buckets of up to this many
# bytes (float32).
BUCKET_BYTES = 2 << 20     # = DEFAULT_CHUNK_ELEMENTS float32 values
# Layers that put at least this many elements on the wire are cut into a multiple of
# the number of servers (None: wire.DEFAULT_SPLIT_MIN, or the cost model's larger
# figure once the links are measured, time_links).
SPLIT_ELEMENTS = None
MESSAGE_PROBE_KEYS = 8             # keys of the exchange that times one more message
# Keys whose pushed array is the store's own (fused buckets, the probes of the links and
# of the servers' route) travel as one MXNet pushpull, as Gluon drives dist_sync and the
# servers' route: timed as pushes followed by pulls, resnet50's dense pieces took
# 2.8-3.3 s at 1 Gbit/s (4 workers, 2 servers) against 2.0-2.4 s as pushpulls and
# dist_sync's own 2.0-2.2 s. A layer's own dense keys travel as pushpulls too where
# the array pushed is the one the aggregate goes to (a gradient sent dense: warm-up
# steps, a layer planned uncompressed), as Gluon's dist_sync pushpulls each gradient
# into itself; else they are pushed and pulled apart: on the CPU MXNet's pushpull
# leaves the pulled value in the array it pushed, and a pushed array can be state (a
# momentum-corrected velocity) or the caller's input.
#
# PULL_READERS_LAST: MXNet gives every operator of an extension library (mxhylo.ops)
# the CPU's temporary-space resource, one engine variable, so these operators run in
# the order they are queued, whatever arrays they touch. One that reads a pull waits
# for the other workers' pushes of that key, and every operator queued after it waits
# too: a layer's encode, whose statistics this thread reads before pushing. Had a
# worker queued a pull's reader before its last push, two workers could each wait in
# an encode for a key only the other would push next (a deadlock, ended by the
# watchdog). So an exchange queues its pulls' readers after its last push.


@dataclass
class Routed:
    """One item of an exchange with the keys it travels in."""
    layer: object
    payload: Payload
    out: mx.nd.NDArray
    chunks: List[Chunk]


@dataclass(frozen=True)
class BucketMember:
    """A layer's place in a bucket: its item index, offset and size in elements."""
    item: int
    offset: int
    size: int


@dataclass
class Bucket:
    """Small uncompressed layers fused into one key for this exchange.

    recv: the fused aggregate's buffer; None for a group of one, which is pulled
    straight into its layer's output.
    """
    pskey: int
    layout: ChunkLayout
    members: Tuple[BucketMember, ...]
    send: mx.nd.NDArray
    recv: Optional[mx.nd.NDArray]


@dataclass
class PendingPull:
    """A row_sparse pull on its way, decoded once every pull has been issued."""
    flat: mx.nd.NDArray       # the layer's aggregate, flat
    chunk: Chunk
    buf: mx.nd.NDArray        # the pull's row_sparse buffer
    name: str                 # the layer's name, for the watchdog
    traffic: Traffic          # the layer's, whose pull_s the wait and decode add to


def _leave_at_once_on_uncaught_exception():
    """An uncaught exception in a worker must end the process.

    Otherwise the interpreter's teardown destroys the dist kvstore, whose destructor
    waits at a barrier for the other workers, which wait for this one's pushes: the
    job hangs instead of failing. Print the traceback as usual, then leave.
    """
    previous = sys.excepthook
    if getattr(previous, "mxhylo_fail_fast", False):
        return

    def fail_fast(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        sys.stderr.write("mxhylo: this worker failed; it exits now rather than wait for "
                         "the other workers at ps-lite's shutdown barrier\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    fail_fast.mxhylo_fail_fast = True
    sys.excepthook = fail_fast



def _native_store_unsplit():
    """This worker's native 'dist_sync' store, which never splits a key over servers.

    MXNet cuts a key of MXNET_KVSTORE_BIGARRAY_BOUND elements or more into row ranges
    over all servers; hylo places its keys itself (kvstore.ps_keys) and a 'gather' rows
    key must stay whole (kvstore.wire). The bound is read once, when the store is made,
    so it is lifted for that moment only: a store the user makes stays as configured.
    """
    name = "MXNET_KVSTORE_BIGARRAY_BOUND"
    before = os.environ.get(name)
    os.environ[name] = str(BIGARRAY_BOUND)
    try:
        return mx.kv.create("dist_sync")
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


class PSTransport(Transport):
    """Moves hylo payloads through a native 'dist_sync' KVStore of this worker.

    Takes a call's layers in any order (any_order): each travels in keys of its own
    or in a bucket fixed by prepare().

    Keys are cut and fused by CHUNK_ELEMENTS, BUCKET_BYTES and SPLIT_ELEMENTS (above).
    compress_pull: None or 'gather' (kvstore.policy.compress_pull_mode).
    stall_timeout: the bound of one exchange (kvstore.watchdog): None derives it from
      the step times, 0 turns the watchdog off.
    """
    any_order = True

    def __init__(self, compress_pull=None, stall_timeout=None):
        if os.environ.get("DMLC_ROLE") != "worker":
            raise RuntimeError("the hylo parameter-server transport runs in MXNet worker "
                               "processes (DMLC_ROLE=worker), started by python -m "
                               "mxhylo.launch or MXNet's tools/launch.py")
        self.kv = _native_store_unsplit()
        _leave_at_once_on_uncaught_exception()
        self.rank = self.kv.rank
        self.num_workers = self.kv.num_workers
        chunk_elements = int(CHUNK_ELEMENTS)
        self._split_given = SPLIT_ELEMENTS is not None
        split_elements = DEFAULT_SPLIT_MIN if SPLIT_ELEMENTS is None else SPLIT_ELEMENTS
        # a bucket stays one key on one server, like a chunk
        self._groups, self._group_of = [], {}     # this exchange's buckets (prepare)
        self.num_servers = int(os.environ["DMLC_NUM_SERVER"])
        self.keys = KeyTable(self.kv, self.num_servers, chunk_elements,
                             int(split_elements), min(int(BUCKET_BYTES) // 4, chunk_elements),
                             compress_pull)
        self.watchdog = StallWatchdog(stall_timeout, rank=self.rank)
        self._exchanges = 0
        self._codecs = make_compressors()      # wire forms of pushes, decoders of pulls
        # id(Traffic) -> (Traffic, layer name, [(header, count) of each chunk]): a 'sum'
        # pull's header NDArrays, read once wait() has seen the pull land
        self._headers = {}
        # pskey -> (ChunkLayout, row_sparse NDArray): each 'slots' key's push array,
        # written in place at every step (wire.push_slot's into)
        self._slot_pushes = {}
        self.keys.check_servers_decode()

    # -- keys (kvstore.ps_keys) ----------------------------------------------------------

    def broadcast(self, layers, values, outs):
        self.keys.init(layers, values)
        self.kv.pull([self.keys.broadcast_key(l) for l in layers], out=list(outs))

    def replan(self, old, new):
        self.keys.replan(old, new)

    def share_from_rank0(self, values):
        return self.keys.share_from_rank0(values)

    def every_workers_value(self, value):
        return self.keys.every_workers_value(value)

    # -- the cost model's links (kvstore.cost_model.LinkCosts) ---------------------------

    def time_links(self, probe_elements, repeats):
        """Each server's link alone: dense probes of every size in ``probe_elements``
        on a key of that server, every worker at once; then MESSAGE_PROBE_KEYS keys
        against one key of the same total (the smallest probe), on server 0. Rank 0's
        figures, shared, place and cut the keys made from now on."""
        sizes = [int(n) for n in probe_elements]
        seconds = [[self._time_keys(self.keys.link_probe_keys(s, [n]), [n], repeats)
                    for n in sizes] for s in range(self.keys.num_servers)]
        parts = [sizes[0] // MESSAGE_PROBE_KEYS] * MESSAGE_PROBE_KEYS
        many = self._time_keys(self.keys.link_probe_keys(0, parts), parts, repeats)
        mine = LinkCosts.fit([4 * n for n in sizes], seconds, seconds[0][0], many,
                             MESSAGE_PROBE_KEYS)
        links, _ = LinkCosts.from_list(self.share_from_rank0(mine.to_list()))
        self._use_links(links)
        return links

    # -- the servers' route (kvstore.server_route) --------------------------------------

    def server_route(self, params):
        from .server_route import ServerRoute
        return ServerRoute(self.keys, params)

    def _time_keys(self, keys, sizes, repeats, what=None, warmup=True):
        """Median seconds of one exchange (a pushpull of every key) over
        ``repeats``, after an untimed one if ``warmup``; ``what``: the probe, for the
        watchdog's message (default: the link probe of the first key's server)."""
        values = [mx.nd.zeros((n,)) for n in sizes]
        outs = [mx.nd.zeros((n,)) for n in sizes]
        if what is None:
            what = ("the cost model's probe of server %d's link"
                    % self.keys.layouts[keys[0]][1].server)
        times = []
        for _ in range(repeats + bool(warmup)):
            # bounded like an exchange: a server that never answers ends the worker
            self.watchdog.begin(self._exchanges)
            self.watchdog.waiting(what)
            for key in keys:
                self.watchdog.owe(key, "probe", self.keys.layouts[key][1].server)
            clock = time.perf_counter()
            for key, value, out in zip(keys, values, outs):
                self.kv.pushpull(key, value, out=out)      # (one pushpull: see the top)
            for out in outs:
                out.wait_to_read()
            times.append(time.perf_counter() - clock)
            self.watchdog.end()
        return float(np.median(times[-repeats:]))

    @property
    def split_elements(self):
        return self.keys.split_elements

    def _use_links(self, links):
        # The model may only cut later than the wire's rule: the rule's size is the
        # floor. Its figure assumes a layer alone on the links; in a whole exchange the
        # placement already balances the servers with whole layers, and cutting at the
        # model's ~10 000 elements at 1 Gbit/s (13 more keys per step on resnet50) made
        # the exchange no faster here (docs/DESIGN.md, the cost model).
        split = self.keys.split_elements if self._split_given \
            else max(DEFAULT_SPLIT_MIN, links.split_min_elements())
        self.keys.use_links(links, split)

    # -- one exchange --------------------------------------------------------------------

    def exchange(self, layers, items):
        """One exchange of several layers: each layer's pushes, then at once its pulls.

        layers: the call's layers in the order given, which fixes its buckets (the
        same on every worker); items: (layer, payload, out), out a float32 NDArray of
        the layer's shape; those layers, in any order (as backward writes their gradients: the
        store's overlap). A layer is pushed as soon as it comes, and its pull is issued
        right behind: MXNet's store holds the pull until the key's push has completed
        on the servers (every worker's share is in), so the aggregates of the layers
        that came first come back first, while later layers still travel. Uncompressed
        layers of at most the bucket size travel fused into buckets (one message each
        way per bucket, not one per tensor), each pushed when its last member comes.
        Nothing that reads a pull is queued before the last push (PULL_READERS_LAST,
        above): the compressed pulls are decoded, and the buckets' aggregates split
        into their members, once every layer is pushed. Returns one Traffic per item.
        """
        # keys made, layouts sent, buckets fixed: before the first push
        self._groups = self.keys.prepare(layers)
        self._group_of = {layer.key: g for g, group in enumerate(self._groups)
                          for layer in group}
        self._exchanges += 1
        self.watchdog.begin(self._exchanges)
        routed, traffic, pending, splits = [], [], [], []
        arrived = {}         # bucket group index -> {layer key: item index} come so far
        for i, (layer, payload, out) in enumerate(self._own_payloads(items)):
            chunks = self.keys.route(layer, payload)
            routed.append(Routed(layer, payload, out, chunks))
            traffic.append(Traffic())
            if not self.keys.fusable(layer):
                self._push_and_pull(routed[i], traffic[i], pending)
                continue
            group = self._group_of.get(layer.key)
            if group is None:
                raise RuntimeError("layer %s has no bucket: it is not one of the "
                                   "exchange's layers" % layer.plan.name)
            members = arrived.setdefault(group, {})
            members[layer.key] = i
            if len(members) == len(self._groups[group]):
                self._push_and_pull_bucket(self._bucket(self._groups[group], members,
                                                        routed), routed, traffic, splits)
        if sum(len(m) for m in arrived.values()) != sum(len(g) for g in self._groups):
            raise RuntimeError("an exchange left buckets unsent: its items differ from "
                               "its layers")
        for recv, offsets, outs in splits:
            # one engine operation writes every member's aggregate (a Python slice
            # assignment per member cost more CPU than the bucket saves on the wire)
            ops.split_sections(recv, offsets, outs)
        for p in pending:
            self._decode_pull(p)
        return traffic

    def _own_payloads(self, items):
        """``items``, the watchdog told that while the next one is made the exchange
        waits for this worker's own backward and encode, not for a server."""
        items = iter(items)
        while True:
            self.watchdog.waiting_on_self()
            item = next(items, None)
            if item is None:
                self.watchdog.waiting("the aggregates of every layer pushed")
                return
            yield item

    def _push_and_pull(self, r, traffic, pending):
        """Push a layer that travels in keys of its own, and issue its pulls (a
        compressed chunk's pull is added to ``pending``, decoded later)."""
        for c in r.chunks:
            self.watchdog.owe(c.pskey, r.layer.plan.name, c.layout.server)
        traffic.pushed_at = time.perf_counter()
        pushes = self._encode_pushes(r.chunks, r.payload)
        if r.payload.arrays[0] is r.out and self._codecs[r.payload.strategy].wire == "dense":
            for c, (value, nbytes) in zip(r.chunks, pushes):     # the sum lands in place
                self.kv.pushpull(c.pskey, value, out=value)
                traffic.count(c.layout.server, pushed=nbytes, pulled=nbytes, messages=1)
            return
        for c, (value, nbytes) in zip(r.chunks, pushes):
            self.kv.push(c.pskey, value)
            traffic.count(c.layout.server, pushed=nbytes, messages=1)
        flat = wire_flat(r.out)
        for c in r.chunks:
            chunk = c.layout
            if chunk.kind == "dense":
                self.kv.pull(c.pskey, out=flat[chunk.lo:chunk.hi])
                nbytes = 4 * chunk.size
            else:
                buf, row_ids = self.keys.pull_buffers[c.pskey]
                self.kv.row_sparse_pull(c.pskey, out=buf, row_ids=row_ids)
                pending.append(PendingPull(flat, c, buf, r.layer.plan.name, traffic))
                nbytes = chunk.pull_rows * (4 * chunk.cols + ROW_ID_BYTES)
            traffic.count(chunk.server, pulled=nbytes)

    def _push_and_pull_bucket(self, b, routed, traffic, splits):
        """Push a full bucket and issue its pull; the split of its aggregate into its
        members' outputs is added to ``splits`` (queued after the last push)."""
        now = time.perf_counter()
        for m in b.members:
            self.watchdog.owe(b.pskey, routed[m.item].layer.plan.name, b.layout.server)
            traffic[m.item].pushed_at = now
        outs = [wire_flat(routed[m.item].out) for m in b.members]
        if b.recv is None:      # a group of one: it pushes the layer's own array
            self.kv.push(b.pskey, b.send)
            self.kv.pull(b.pskey, out=outs[0])
        else:
            self.kv.pushpull(b.pskey, b.send, out=b.recv)    # (a fresh concat: see the top)
            splits.append((b.recv, [m.offset for m in b.members], outs))
        for n, m in enumerate(b.members):
            traffic[m.item].count(b.layout.server, pushed=4 * m.size, pulled=4 * m.size,
                                  messages=int(n == 0))

    def _decode_pull(self, p):
        """Write a pulled chunk's aggregate into its piece of the layer's output."""
        chunk, pskey = p.chunk.layout, p.chunk.pskey
        self.watchdog.waiting("layer %r (key %d, server %d)" % (p.name, pskey, chunk.server))
        clock = time.perf_counter()
        piece = p.flat[chunk.offset:chunk.offset + chunk.size]
        if chunk.kind == "slots" and chunk.pull != "none":
            # read where the pull wrote them (a row_sparse array's .data is a copy)
            values = ops.host_view(p.buf, shape=(chunk.pull_rows * chunk.cols,))
            if values is None:
                values = wire_flat(p.buf.data)
            if chunk.pull == "gather":
                # decoded in rank order, as the server decodes a dense pull: bitwise equal
                self._codecs[chunk.codec].decode_slots(gathered_slots(chunk, values),
                                                       chunk.size, piece)
            else:
                # 'sum': the header is read once every pull has landed (wait)
                _, header, bad = summed_aggregate(chunk, values, out=piece)
                self._headers.setdefault(id(p.traffic), (p.traffic, p.name, []))[2].append(
                    (header, bad))
        else:
            rows = wire_flat(p.buf.data)                   # (pull_rows * cols,) row-major
            if chunk.pull == "none":
                piece[:] = rows[:chunk.size]
            else:
                target = piece.reshape((chunk.rows_filters, chunk.cols))
                mx.nd.zeros_like(target, out=target)
                for payload in gather_payloads(chunk, rows):
                    self._codecs[payload.strategy].decode(payload, target, accumulate=True)
        # the decode runs on in MXNet's engine: wait() adds it to the same layer's pull_s
        p.traffic.pull_s += time.perf_counter() - clock
        self.watchdog.settled(pskey)

    def wait(self, layers, aggregates, traffic):
        """Block until every aggregate of the exchange is written, each wait bounded by
        the stall watchdog (which names what is still owed if the bound passes); pull_s:
        the wait (compressed chunks add their decode in exchange)."""
        for layer, agg, t in zip(layers, aggregates, traffic):
            self.watchdog.waiting_on_layer(layer.plan.name)
            wait_timed(agg, t)
            self.watchdog.settled_layer(layer.plan.name)
        self.watchdog.end()
        headers, self._headers = self._headers, {}
        for t, name, chunks in headers.values():
            # every chunk of a layer carries the layer's whole summed header
            for header, bad in chunks:
                t.agreed = agreed_header(name, header, bad)

    def _bucket(self, group, members, routed):
        """The Bucket of prepare()'s ``group`` (layers, in its order), filled from the
        ``routed`` items ``members`` (layer key -> item index). A group of one travels
        in the layer's own key."""
        items = [members[layer.key] for layer in group]
        if len(items) == 1:
            r = routed[items[0]]
            c = self.keys.chunks[r.layer.key][0]
            return Bucket(c.pskey, c.layout, (BucketMember(items[0], 0, r.layer.plan.size),),
                          wire_flat(r.payload.arrays[0]), None)
        key = self.keys.bucket_keys[bucket_signature(group)]
        placed, offset = [], 0
        for i, layer in zip(items, group):
            placed.append(BucketMember(i, offset, layer.plan.size))
            offset += layer.plan.size
        send = mx.nd.concat(*[wire_flat(routed[i].payload.arrays[0]) for i in items],
                            dim=0)
        return Bucket(key.pskey, key.layout, tuple(placed), send, key.recv)

    def _encode_pushes(self, chunks, payload):
        """Per Chunk: (value to push, bytes on the wire), in kvstore.wire's layouts."""
        codec = self._codecs[payload.strategy]
        if codec.wire == "dense":
            flat = wire_flat(payload.arrays[0])
            return [(flat[c.layout.lo:c.layout.hi], 4 * c.layout.size) for c in chunks]
        if codec.wire == "rows":
            indices, values = payload.arrays
            pushes = []
            for c, (a, b) in zip(chunks, self._row_spans(chunks, indices)):
                # no numpy round trip: rows taken from the payload's NDArrays
                pushes.append(empty_push(c.layout) if a == b else
                              push_rows(c.layout, indices[a:b], values[a:b]))
            return pushes
        data = codec.to_bytes(payload)
        pushes = []
        for c in chunks:
            a, b = codec.byte_span(c.layout.lo, c.layout.hi)
            layout, into = self._slot_pushes.get(c.pskey, (None, None))
            push = push_slot(c.layout, self.rank, data[a:b], payload.scalars,
                             into=into if layout == c.layout else None)
            self._slot_pushes[c.pskey] = (c.layout, push[0])
            pushes.append(push)
        return pushes

    @staticmethod
    def _row_spans(chunks, indices):
        """Per Chunk, the span [a, b) of the payload's (ascending) filter indices that
        fall in it. A layer in one chunk needs no look at the indices; a split layer
        reads only the k indices (not the values) to the host."""
        if len(chunks) == 1:
            return [(0, indices.shape[0])]
        idx = indices.asnumpy()
        return [tuple(int(x) for x in np.searchsorted(idx, [c.layout.lo, c.layout.hi]))
                for c in chunks]
