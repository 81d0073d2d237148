"""Transport over MXNet's own parameter server (ps-lite, kvstore dist_sync): the exchange.

A worker pushes only its compressed payload into the layer's keys (kvstore.ps_keys
says which keys, on which server; kvstore.wire how the payload sits in them), the
servers decode and aggregate (kvstore.server, sent to them as a pickled optimizer,
MXNet's hook for server-side code), and the worker pulls the aggregate as the pull
codec returns it (dense float32, the workers' payloads gathered, or re-compressed by
the server) and decodes it. Every worker pulls the same bytes, so every worker writes
the same aggregate. The servers' checkpoint state: kvstore.ps_checkpoint. A bound on
every exchange: kvstore.watchdog.
"""
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Tuple

import mxnet as mx
import numpy as np

from .compressors import Payload, make_compressors
from .ps_checkpoint import ServerCheckpoint
from .ps_keys import Chunk, KeyTable, bucket_signature
from .transport import Traffic, Transport, wait_timed
from .watchdog import StallWatchdog
from .wire import (BIGARRAY_BOUND, DEFAULT_CHUNK_ELEMENTS, DEFAULT_SPLIT_MIN, ROW_ID_BYTES,
                   ChunkLayout, empty_push, gather_payloads, pull_payload, push_slot, push_rows)

DEFAULT_BUCKET_BYTES = 2 << 20     # = DEFAULT_CHUNK_ELEMENTS float32 values


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
    """Small uncompressed layers fused into one key for this exchange."""
    pskey: int
    layout: ChunkLayout
    members: Tuple[BucketMember, ...]
    send: mx.nd.NDArray
    recv: mx.nd.NDArray


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

    chunk_elements: the largest piece of a layer in one parameter-server key.
    bucket_bytes: uncompressed layers pushed in one pushpull call travel fused into
      buckets of up to this many bytes (float32).
    split_elements: layers of at least this many elements are cut into a multiple of
      the number of servers, so every server carries the same share of them.
    compress_pull: None, 'gather', 'layer' or '2bit' (kvstore.policy.compress_pull_mode);
    threshold_scale: of the 2-bit codec the servers encode pulls with.
    collective_timeout: seconds a worker waits for the others in save_residuals /
      load_residuals with compress_pull (collective calls) before it fails.
    warmup: whether compressed layers also get dense keys, for the steps they travel
      uncompressed (the store's warmup_steps).
    stall_timeout: the bound of one exchange (kvstore.watchdog): None derives it from
      the step times, 0 turns the watchdog off.
    """

    def __init__(self, chunk_elements=DEFAULT_CHUNK_ELEMENTS,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, split_elements=DEFAULT_SPLIT_MIN,
                 compress_pull=None, threshold_scale=1.0, collective_timeout=300.0,
                 warmup=False, stall_timeout=None):
        if os.environ.get("DMLC_ROLE") != "worker":
            raise RuntimeError("the hylo parameter-server transport runs in MXNet worker "
                               "processes (DMLC_ROLE=worker), started by python -m "
                               "mxhylo.launch or MXNet's tools/launch.py")
        self.kv = _native_store_unsplit()
        _leave_at_once_on_uncaught_exception()
        self.rank = self.kv.rank
        self.num_workers = self.kv.num_workers
        chunk_elements = int(chunk_elements)
        # a bucket stays one key on one server, like a chunk
        self.keys = KeyTable(self.kv, int(os.environ["DMLC_NUM_SERVER"]), chunk_elements,
                             int(split_elements), min(int(bucket_bytes) // 4, chunk_elements),
                             compress_pull, float(threshold_scale), bool(warmup))
        self.checkpoint = ServerCheckpoint(self.keys, collective_timeout)
        self.watchdog = StallWatchdog(stall_timeout, rank=self.rank)
        self._exchanges = 0
        self._codecs = make_compressors()      # wire forms of pushes, decoders of pulls
        self.keys.check_servers_decode()

    # -- keys (kvstore.ps_keys) ----------------------------------------------------------

    def init(self, layer, value):
        self.keys.init(layer, value)

    def broadcast(self, layer, value, outs):
        self.kv.pull(self.keys.broadcast_key(layer), out=outs)

    def prepare(self, layers):
        self.keys.prepare(layers)

    def replan(self, old, new):
        self.keys.replan(old, new)

    def share_from_rank0(self, values):
        return self.keys.share_from_rank0(values)

    # -- one exchange --------------------------------------------------------------------

    def exchange(self, items):
        """One exchange of several layers: push every payload, then pull every aggregate.

        items: (layer, payload, out), out a float32 NDArray of the layer's shape;
        prepare() has seen their layers. Uncompressed layers of at most the bucket size
        travel fused into buckets (one message each way per bucket, not one per
        tensor). Returns one Traffic per item.
        """
        if self.checkpoint.pending:
            self.checkpoint.restore_pending()
        self._exchanges += 1
        self.watchdog.begin(self._exchanges)
        traffic = []
        # Push each layer as it comes (items may be a generator that encodes on demand,
        # so the servers start decoding while later layers are still being encoded);
        # small uncompressed layers wait for their bucket. Pulls follow every push: a
        # pull queued behind this worker's pushes on the same connection would wait.
        routed, fused, alone, pending = [], [], [], []
        for i, (layer, payload, out) in enumerate(items):
            chunks = self.keys.route(layer, payload)
            routed.append(Routed(layer, payload, out, chunks))
            traffic.append(Traffic())
            if self.keys.fusable(layer):
                fused.append(i)
                continue
            for c in chunks:
                self.watchdog.owe(c.pskey, layer.plan.name, c.layout.server)
            alone.append(i)
            for c, (value, nbytes) in zip(chunks, self._encode_pushes(chunks, payload)):
                self.kv.push(c.pskey, value)
                traffic[i].count(c.layout.server, pushed=nbytes, messages=1)
        buckets = self._buckets(routed, fused)
        for b in buckets:
            self.kv.push(b.pskey, b.send)
            for m in b.members:
                self.watchdog.owe(b.pskey, routed[m.item].layer.plan.name, b.layout.server)
        for i in alone:
            r = routed[i]
            flat = r.out.reshape((-1,))
            for c in r.chunks:
                chunk = c.layout
                if chunk.kind == "dense":
                    self.kv.pull(c.pskey, out=flat[chunk.lo:chunk.hi])
                    nbytes = 4 * chunk.size
                else:
                    buf, row_ids = self.keys.pull_buffers[c.pskey]
                    self.kv.row_sparse_pull(c.pskey, out=buf, row_ids=row_ids)
                    pending.append(PendingPull(flat, c, buf, r.layer.plan.name,
                                               traffic[i]))
                    nbytes = chunk.pull_rows * (4 * chunk.cols + ROW_ID_BYTES)
                traffic[i].count(chunk.server, pulled=nbytes)
        for b in buckets:
            self.kv.pull(b.pskey, out=b.recv)
            for n, m in enumerate(b.members):
                routed[m.item].out.reshape((-1,))[:] = b.recv[m.offset:m.offset + m.size]
                traffic[m.item].count(b.layout.server, pushed=4 * m.size, pulled=4 * m.size,
                                      messages=int(n == 0))
        # Only now touch the pulled rows: reading a row_sparse array's data waits for
        # its pull, and every pull should be on its way before the first wait.
        for p in pending:
            self._decode_pull(p)
        return traffic

    def _decode_pull(self, p):
        """Write a pulled chunk's aggregate into its piece of the layer's output."""
        chunk, pskey = p.chunk.layout, p.chunk.pskey
        self.watchdog.waiting("layer %r (key %d, server %d)" % (p.name, pskey, chunk.server))
        clock = time.perf_counter()
        rows = p.buf.data.reshape((-1,))                  # (pull_rows * cols,) row-major
        piece = p.flat[chunk.offset:chunk.offset + chunk.size]
        if chunk.pull == "none":
            piece[:] = rows[:chunk.size]
        elif chunk.pull == "gather":
            # decoded in rank order, as the server decodes a dense pull: bitwise equal
            target = piece.reshape((chunk.rows_filters, chunk.cols)) \
                if chunk.kind == "rows" else piece
            target[:] = 0
            for payload in gather_payloads(chunk, rows.asnumpy()):
                self._codecs[payload.strategy].decode(payload, target, accumulate=True)
        else:
            payload = pull_payload(chunk, rows.asnumpy())
            self._codecs[payload.strategy].decode(payload, piece.reshape(payload.shape))
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

    def _buckets(self, routed, indices):
        """The Buckets prepare() made for the small uncompressed items ``indices`` of
        ``routed``, filled. A group of one travels in the layer's own key."""
        buckets = []
        groups = self.keys.bucket_groups(indices, layer_of=lambda i: routed[i].layer)
        for group in groups:
            if len(group) == 1:
                r = routed[group[0]]
                c = self.keys.chunks[r.layer.key][0]
                buckets.append(Bucket(c.pskey, c.layout,
                                      (BucketMember(group[0], 0, r.layer.plan.size),),
                                      r.payload.arrays[0].reshape((-1,)),
                                      mx.nd.empty((r.layer.plan.size,))))
                continue
            layers = [routed[i].layer for i in group]
            key = self.keys.bucket_keys.get(bucket_signature(layers))
            if key is None:
                raise RuntimeError("no bucket for layers %s: call prepare(layers) before "
                                   "exchange" % ", ".join(l.plan.name for l in layers))
            members, offset = [], 0
            for i, layer in zip(group, layers):
                members.append(BucketMember(i, offset, layer.plan.size))
                offset += layer.plan.size
            send = mx.nd.concat(*[routed[i].payload.arrays[0].reshape((-1,)) for i in group],
                                dim=0)
            buckets.append(Bucket(key.pskey, key.layout, tuple(members), send, key.recv))
        return buckets

    def _encode_pushes(self, chunks, payload):
        """Per Chunk: (value to push, bytes on the wire), in kvstore.wire's layouts."""
        codec = self._codecs[payload.strategy]
        if codec.wire == "dense":
            flat = payload.arrays[0].reshape((-1,))
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
            pushes.append(push_slot(c.layout, self.rank, data[a:b], payload.scalars))
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

    # -- the servers' state (kvstore.ps_checkpoint) --------------------------------------

    def server_state(self):
        return self.checkpoint.server_state()

    def load_server_state(self, state):
        self.checkpoint.load_server_state(state)
