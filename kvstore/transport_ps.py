"""Transport over MXNet's own parameter server (ps-lite, kvstore dist_sync).

Each hylo layer becomes one or more parameter-server keys ("chunks", see
kvstore.wire for their layout): large layers are cut into chunks of at most
``chunk_elements`` and every chunk is placed on the server that carries the least
so far, so every server gets a fair share. A worker pushes only its compressed
payload (row_sparse rows), the servers decode and aggregate (kvstore.server, sent to
them as a pickled optimizer, MXNet's hook for server-side code), and the worker pulls
the dense float32 aggregate, or with compress_pull the aggregate as the server encoded
it (it keeps the rest in its own residual), and decodes it. Every worker pulls the
same bytes, so every worker writes the same aggregate. Parameters are broadcast from
rank 0 through a dense key of their own.
"""
import dataclasses
import os
import sys
import threading
import zlib

import mxnet as mx
import numpy as np

from .compressors import make_compressors
from .policy import pull_codec
from .server import ServerDecoder
from .watchdog import StallWatchdog
from .wire import (DEFAULT_CHUNK_ELEMENTS, DEFAULT_SPLIT_MIN, ROW_ID_BYTES, ChunkLayout,
                   empty_push, gather_payloads, plan_chunks, pull_payload,
                   push_2bit, push_topk, read_state, row_sparse_push, rows_from_zero,
                   state_values)

DEFAULT_BUCKET_BYTES = 2 << 20     # = DEFAULT_CHUNK_ELEMENTS float32 values


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


class PSTransport:
    """Moves hylo payloads through a native 'dist_sync' KVStore of this worker.

    chunk_elements: the largest piece of a layer in one parameter-server key.
    bucket_bytes: uncompressed layers pushed in one pushpull call travel fused into
      buckets of up to this many bytes (float32).
    split_elements: layers of at least this many elements are cut into a multiple of
      the number of servers, so every server carries the same share of them.
    compress_pull: None, 'layer' or '2bit' (kvstore.policy.compress_pull_mode);
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
        self.kv = mx.kv.create("dist_sync")
        _leave_at_once_on_uncaught_exception()
        self.rank = self.kv.rank
        self.num_workers = self.kv.num_workers
        self.num_servers = int(os.environ["DMLC_NUM_SERVER"])
        self.chunk_elements = int(chunk_elements)
        self.split_elements = int(split_elements)
        self.compress_pull = compress_pull
        self.threshold_scale = float(threshold_scale)
        self.collective_timeout = float(collective_timeout)
        self.watchdog = StallWatchdog(stall_timeout, rank=self.rank)
        self._exchanges = 0
        self._codecs = make_compressors()      # decoders of compressed pulls
        self._pending_state = {}  # server state from a checkpoint, restored at exchange
        self._pending_replace = False
        # a bucket stays one key on one server, like a chunk
        self.bucket_elements = min(int(bucket_bytes) // 4, self.chunk_elements)
        self._bucket_keys = {}    # sequence of hylo keys -> (ps key, ChunkLayout, recv)
        self._next_key = 0
        self._load = [0] * self.num_servers
        self._bcast = {}          # hylo key -> parameter-server key of the parameter
        self._chunks = {}         # hylo key -> [(ps key, ChunkLayout)]
        self.warmup = bool(warmup)
        self._warm_chunks = {}    # hylo key of a compressed layer -> its dense keys
        self._layouts = {}        # ps key -> (layer name, ChunkLayout), for the servers
        self._layouts_sent = False
        self._pull = {}           # ps key -> (row_sparse pull buffer, row ids)
        self._layer_shapes = {}   # layer name -> shape
        # workers' model check: each worker writes a fingerprint of every new layer into
        # its own slot of this key; the server's sum gathers them (see init)
        self._check_key = self._key_on(0)
        self._layouts[self._check_key] = (
            "model check", ChunkLayout("dense", 0, self.num_workers, self.num_workers))
        self.kv.init(self._check_key, mx.nd.zeros((self.num_workers,)))
        self._check_servers_decode()

    def _check_servers_decode(self):
        """Fail fast unless every server runs hylo's decoder.

        A server that cannot import mxhylo only logs the failed unpickling and goes on
        summing, which would hand the workers raw payloads as gradients. Each server
        gets a probe key whose pull proves the decoder ran.
        """
        probes = []
        for server in range(self.num_servers):
            key = self._key_on(server)
            self._layouts[key] = ("probe", ChunkLayout("probe", 0, 1, 1, server=server))
            probes.append(key)
        self.kv.init(probes, [mx.nd.zeros((1,)) for _ in probes])
        self._send_layouts()
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

    # -- keys ----------------------------------------------------------------------------

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
        """A fresh key on the least-loaded server; (key, server)."""
        server = int(np.argmin(self._load))
        self._load[server] += nbytes
        return self._key_on(server), server

    def _check_same_model(self, layer):
        """Raise unless every worker has the same layer (shape, strategy) at this point.

        Without this check a worker whose model differs dies in ps-lite with a size
        check that does not say why.
        """
        text = repr((layer.plan.shape, layer.plan.strategy)).encode()
        mine = float(zlib.crc32(text) % (1 << 23) + 1)      # exact in float32
        slots = np.zeros(self.num_workers, np.float32)
        slots[self.rank] = mine
        got = mx.nd.zeros((self.num_workers,))
        self.kv.push(self._check_key, mx.nd.array(slots))
        self.kv.pull(self._check_key, out=got)
        if not np.all(got.asnumpy() == mine):
            raise RuntimeError(
                "workers train different models: layer %r (key %r) is %s with policy %s "
                "on worker %d, and differs on another worker" % (
                    layer.plan.name, layer.key, layer.plan.shape, layer.plan.strategy,
                    self.rank))

    def init(self, layer, value):
        """Create the layer's keys on the servers (every worker calls this, in order)."""
        if layer.key in self._bcast:
            return
        self._check_same_model(layer)
        bkey, _ = self._place(0)      # used once, at init: not part of the steady load
        keys, values = [bkey], [value]
        chunks, warm = [], []
        layouts = plan_chunks(layer.plan.strategy, layer.plan.shape, self.num_workers,
                              self.num_servers, self.chunk_elements, self.split_elements,
                              pull=pull_codec(layer.plan.strategy, self.compress_pull),
                              pull_rate=layer.plan.rate, push_k=layer.plan.k)
        if self.warmup and layer.plan.strategy != "none":
            # dense keys for the warm-up steps (not counted in the steady load)
            for chunk in plan_chunks("none", layer.plan.shape, self.num_workers,
                                     self.num_servers, self.chunk_elements,
                                     self.split_elements):
                pskey, server = self._key_on(len(warm) % self.num_servers), \
                    len(warm) % self.num_servers
                chunk = dataclasses.replace(chunk, server=server)
                warm.append((pskey, chunk))
                self._layouts[pskey] = (layer.plan.name + " (warm-up)", chunk)
                keys.append(pskey)
                values.append(mx.nd.zeros(chunk.key_shape, ctx=mx.cpu()))
        for chunk in layouts:
            pskey, server = self._place(4 * chunk.size)
            chunk = dataclasses.replace(chunk, server=server)
            chunks.append((pskey, chunk))
            self._layouts[pskey] = (layer.plan.name, chunk)
            keys.append(pskey)
            if chunk.kind == "dense":
                values.append(mx.nd.zeros(chunk.key_shape, ctx=mx.cpu()))
            else:
                values.append(rows_from_zero(chunk, mx.nd.zeros(chunk.key_shape)))
                self._pull[pskey] = (
                    mx.nd.sparse.zeros("row_sparse", chunk.key_shape),
                    mx.nd.arange(chunk.pull_rows, dtype=np.int64))
        self.kv.init(keys, values)      # one barrier for the layer
        self._bcast[layer.key] = bkey
        self._chunks[layer.key] = chunks
        if warm:
            self._warm_chunks[layer.key] = warm
        self._layer_shapes[layer.plan.name] = tuple(layer.plan.shape)
        self._layouts_sent = False

    def broadcast(self, layer, value, outs):
        self.kv.pull(self._bcast[layer.key], out=outs)

    # -- one exchange --------------------------------------------------------------------

    def prepare(self, layers):
        """Create the keys an exchange of ``layers`` (in item order) needs and does not
        have yet: the bucket of a new sequence of small layers. Called before the
        exchange's first push.

        kv.init is collective (rank 0 pushes the value, then every worker meets at a
        barrier), so every key is made here, between exchanges, with no push of this
        worker in flight, and the servers get the new layouts before any push of that
        key: key creation is ordered with respect to the traffic on every worker.
        """
        for layer in layers:
            if layer.key not in self._chunks:
                raise KeyError("key %r (%s) was pushed before being initialised: call "
                               "broadcast first" % (layer.key, layer.plan.name))
        for group in self._bucket_groups([l for l in layers if self._fusable(l)]):
            signature = tuple(layer.key for layer in group)
            if len(group) == 1 or signature in self._bucket_keys:
                continue
            size = sum(layer.plan.size for layer in group)
            pskey, server = self._place(4 * size)
            chunk = ChunkLayout("dense", 0, size, size, server=server)
            self._layouts[pskey] = ("bucket:" + ",".join(l.plan.name for l in group), chunk)
            self._layouts_sent = False
            self.kv.init(pskey, mx.nd.zeros((size,)))
            self._bucket_keys[signature] = (pskey, chunk, mx.nd.empty((size,)))
        if not self._layouts_sent:
            self._send_layouts()

    def _fusable(self, layer):
        """Whether the layer travels fused into a bucket: uncompressed, one key, small."""
        return (layer.plan.strategy == "none" and len(self._chunks[layer.key]) == 1
                and layer.plan.size <= self.bucket_elements)

    def _bucket_groups(self, entries, layer_of=lambda entry: entry):
        """Entries of fusable layers, in order, cut into groups of at most
        bucket_elements (summed over each group's layers)."""
        groups, group, total = [], [], 0
        for entry in entries:
            size = layer_of(entry).plan.size
            if group and total + size > self.bucket_elements:
                groups.append(group)
                group, total = [], 0
            group.append(entry)
            total += size
        if group:
            groups.append(group)
        return groups

    def exchange(self, items):
        """One exchange of several layers: push every payload, then pull every aggregate.

        items: list of (layer, payload, out), out a float32 NDArray of the layer's shape;
        prepare() has seen their layers. Uncompressed layers of at most
        ``bucket_elements`` travel fused into buckets of
        that size (one message each way per bucket, not one per tensor). Returns, per
        item, (bytes pushed, bytes pulled, {server: bytes}, messages) as they go on the
        wire (payload values and row ids; not ps-lite's own message headers); messages
        counts pushes, each of which has one pull.
        """
        if self._pending_state or self._pending_replace:
            self._restore_server_state()
        self._exchanges += 1
        self.watchdog.begin(self._exchanges)
        traffic = []

        def count(i, server, pushed=0, pulled=0, messages=0):
            t = traffic[i]
            t[0] += pushed
            t[1] += pulled
            t[2][server] = t[2].get(server, 0) + pushed + pulled
            t[3] += messages

        # Push each layer as it comes (items may be a generator that encodes on demand,
        # so the servers start decoding while later layers are still being encoded);
        # small uncompressed layers wait for their bucket. Pulls follow every push: a
        # pull queued behind this worker's pushes on the same connection would wait.
        materialized, fused, alone, pulled_rows = [], [], [], []
        for i, (layer, payload, out) in enumerate(items):
            chunks = self._route(layer, payload)
            materialized.append((layer, payload, out, chunks))
            traffic.append([0, 0, {}, 0])
            if self._fusable(layer):
                fused.append(i)
                continue
            for pskey, chunk in chunks:
                self.watchdog.owe(pskey, layer.plan.name, chunk.server)
            alone.append(i)
            for (pskey, chunk), (value, nbytes) in zip(chunks,
                                                       self._encode_pushes(chunks, payload)):
                self.kv.push(pskey, value)
                count(i, chunk.server, pushed=nbytes, messages=1)
        items = materialized
        buckets = self._buckets([items[i][:3] for i in fused], fused)
        for pskey, chunk, members, send, _ in buckets:
            self.kv.push(pskey, send)
            for i, _, _ in members:
                self.watchdog.owe(pskey, items[i][0].plan.name, chunk.server)
        for i in alone:
            layer, _, out, chunks = items[i]
            flat = out.reshape((-1,))
            for pskey, chunk in chunks:
                if chunk.kind == "dense":
                    self.kv.pull(pskey, out=flat[chunk.lo:chunk.hi])
                    nbytes = 4 * chunk.size
                else:
                    buf, row_ids = self._pull[pskey]
                    self.kv.row_sparse_pull(pskey, out=buf, row_ids=row_ids)
                    pulled_rows.append((flat, chunk, buf, layer.plan.name, pskey))
                    nbytes = chunk.pull_rows * (4 * chunk.cols + ROW_ID_BYTES)
                count(i, chunk.server, pulled=nbytes)
        for pskey, chunk, members, send, recv in buckets:
            self.kv.pull(pskey, out=recv)
            for n, (i, offset, size) in enumerate(members):
                items[i][2].reshape((-1,))[:] = recv[offset:offset + size]
                count(i, chunk.server, pushed=4 * size, pulled=4 * size,
                      messages=int(n == 0))
        # Only now touch the pulled rows: reading a row_sparse array's data waits for
        # its pull, and every pull should be on its way before the first wait.
        for flat, chunk, buf, name, pskey in pulled_rows:
            self.watchdog.waiting("layer %r (key %d, server %d)" % (name, pskey, chunk.server))
            rows = buf.data.reshape((-1,))                  # (pull_rows * cols,) row-major
            piece = flat[chunk.offset:chunk.offset + chunk.size]
            if chunk.pull == "dense":
                piece[:] = rows[:chunk.size]
            elif chunk.pull == "gather":
                # decoded in rank order, as the server decodes a dense pull: bitwise equal
                target = piece.reshape((chunk.rows_filters, chunk.cols)) \
                    if chunk.kind == "topk" else piece
                target[:] = 0
                for payload in gather_payloads(chunk, rows.asnumpy()):
                    self._codecs[payload.strategy].decode(payload, target, accumulate=True)
            else:
                payload = pull_payload(chunk, rows.asnumpy())
                self._codecs[payload.strategy].decode(payload, piece.reshape(payload.shape))
            self.watchdog.settled(pskey)
        return [tuple(t) for t in traffic]

    def wait(self, layers, aggregates):
        """Block until every aggregate of the exchange is written, each wait bounded by
        the stall watchdog (which names what is still owed if the bound passes)."""
        for layer, agg in zip(layers, aggregates):
            self.watchdog.waiting_on_layer(layer.plan.name)
            agg.wait_to_read()
            self.watchdog.settled_layer(layer.plan.name)
        self.watchdog.end()

    def _buckets(self, items, indices):
        """The buckets prepare() made for these small uncompressed payloads, filled.

        Returns [(ps key, ChunkLayout, [(item index, offset, size)], send, recv)]. A
        group of one travels in the layer's own key.
        """
        entries = [(i, layer, payload) for (layer, payload, _), i in zip(items, indices)]
        buckets = []
        for group in self._bucket_groups(entries, layer_of=lambda entry: entry[1]):
            if len(group) == 1:
                i, layer, payload = group[0]
                pskey, chunk = self._chunks[layer.key][0]
                buckets.append((pskey, chunk, [(i, 0, layer.plan.size)],
                                payload.arrays[0].reshape((-1,)),
                                mx.nd.empty((layer.plan.size,))))
                continue
            signature = tuple(layer.key for _, layer, _ in group)
            if signature not in self._bucket_keys:
                raise RuntimeError("no bucket for layers %s: call prepare(layers) before "
                                   "exchange" % ", ".join(l.plan.name for _, l, _ in group))
            pskey, chunk, recv = self._bucket_keys[signature]
            members, offset = [], 0
            for i, layer, _ in group:
                members.append((i, offset, layer.plan.size))
                offset += layer.plan.size
            send = mx.nd.concat(*[p.arrays[0].reshape((-1,)) for _, _, p in group], dim=0)
            buckets.append((pskey, chunk, members, send, recv))
        return buckets

    def _route(self, layer, payload):
        """The [(ps key, ChunkLayout)] a payload travels in: the layer's own keys, or
        for a compressed layer's warm-up (dense) payload its dense keys."""
        if payload.strategy == "none" and layer.plan.strategy != "none":
            warm = self._warm_chunks.get(layer.key)
            if warm is None:
                raise RuntimeError("layer %r sent uncompressed without warm-up keys: create "
                                   "the store with warmup_steps > 0" % (layer.plan.name,))
            return warm
        return self._chunks[layer.key]

    def _encode_pushes(self, chunks, payload):
        """Per chunk: (value to push, bytes on the wire)."""
        if payload.strategy == "none":
            flat = payload.arrays[0].reshape((-1,))
            return [(flat[c.lo:c.hi], 4 * c.size) for _, c in chunks]
        if payload.strategy == "conv_topk":
            spans = self._topk_spans(chunks, payload.arrays[0])
            return [self._topk_push(c, a, b, payload) for (_, c), (a, b) in zip(chunks, spans)]
        codes, threshold = payload.arrays[0].asnumpy().view(np.uint8), payload.scalars[0]
        return [push_2bit(c, self.rank, codes[c.lo // 4:4 * -(-c.hi // 16)], threshold)
                for _, c in chunks]

    @staticmethod
    def _topk_spans(chunks, indices):
        """Per chunk, the span [a, b) of the payload's (ascending) filter indices that
        fall in it. A layer in one chunk needs no look at the indices; a split layer
        reads only the k indices (not the values) to the host."""
        if len(chunks) == 1:
            return [(0, indices.shape[0])]
        idx = indices.asnumpy()
        return [tuple(int(x) for x in np.searchsorted(idx, [c.lo, c.hi])) for _, c in chunks]

    @staticmethod
    def _topk_push(chunk, a, b, payload):
        """(row_sparse push, bytes) of a conv_topk payload's rows a..b-1 in ``chunk``,
        taken from the payload's NDArrays (no numpy round trip)."""
        if b == a:
            return empty_push(chunk)
        indices, values = payload.arrays
        return push_topk(chunk, indices[a:b], values[a:b])

    # -- the servers' state (compressed pull), for checkpoints ---------------------------

    def _send_layouts(self, mode=None):
        self.kv.set_optimizer(ServerDecoder(self._layouts, self.threshold_scale, mode))
        self._layouts_sent = True

    def _server_mode(self, mode):
        """Switch every server to ``mode`` (kvstore.server.MODES) between two barriers:
        no worker pushes before every server has switched."""
        mx.nd.waitall()      # a push is asynchronous: this worker's last ones must be done
        self._barrier(mode)
        if self.rank == 0:
            self._send_layouts(mode)
        self._barrier(mode)

    def _barrier(self, mode):
        """ps-lite's barrier, with a time limit: it has none, and a worker that alone
        saves or loads a checkpoint would otherwise wait for the others forever."""
        done = threading.Event()

        def wait():
            self.kv._barrier()
            done.set()

        threading.Thread(target=wait, name="mxhylo-barrier", daemon=True).start()
        if not done.wait(self.collective_timeout):
            raise RuntimeError(
                "worker %d waited %.0f s for the other workers to %s the servers' residuals "
                "(compress_pull): save_residuals / load_residuals are collective, every "
                "worker calls them at the same step (LARSTrainer.save_states / load_states "
                "on every rank)" % (self.rank, self.collective_timeout,
                                    "save" if mode == "dump" else "load"))

    def _compressed_pull_chunks(self):
        """[(layer name, ps key, ChunkLayout)] of every chunk the servers encode."""
        return [(self._layouts[pskey][0], pskey, chunk)
                for chunks in self._chunks.values() for pskey, chunk in chunks
                if chunk.stateful_pull]

    def server_state(self):
        """The servers' residuals and thresholds, for a checkpoint (every worker calls
        this at the same point, like a pushpull).

        Returns {layer name: (residual numpy of the layer's shape, [threshold or None
        per chunk])}.
        """
        chunks = self._compressed_pull_chunks()
        if not chunks:
            return {}
        self._server_mode("dump")
        bufs = []
        for _, pskey, chunk in chunks:
            self.kv.push(pskey, empty_push(chunk)[0])
            buf = mx.nd.sparse.zeros("row_sparse", chunk.key_shape)
            self.kv.row_sparse_pull(pskey, out=buf,
                                    row_ids=mx.nd.arange(chunk.state_rows, dtype=np.int64))
            bufs.append(buf)
        state = {}
        for (name, _, chunk), buf in zip(chunks, bufs):
            piece, threshold = read_state(chunk, buf.data.asnumpy())
            shape = self._layer_shapes[name]
            residual, thresholds = state.setdefault(
                name, (np.zeros(int(np.prod(shape)), np.float32), []))
            residual[chunk.offset:chunk.offset + chunk.size] = piece
            if chunk.pull == "fc_2bit":
                thresholds.append(threshold)
        self._server_mode("run")
        return {name: (r.reshape(self._layer_shapes[name]), t)
                for name, (r, t) in state.items()}

    def load_server_state(self, state):
        """Replace the servers' state with what server_state returned (layers absent
        from it start anew); done by the next exchange (the keys may not exist yet).
        Every worker calls it; rank 0's values are the ones used."""
        self._pending_state = dict(state)
        self._pending_replace = True

    def _restore_server_state(self):
        """Send the pending state: at the first exchange after load_server_state to
        every compressed-pull chunk (zeros where the state has no entry), later to the
        chunks of layers that were not initialised yet then."""
        chunks = [c for c in self._compressed_pull_chunks()
                  if self._pending_replace or c[0] in self._pending_state]
        self._pending_replace = False
        if not chunks:
            return
        for name, _, _ in chunks:       # checked before any server changes mode
            residual = self._pending_state.get(name, (None, []))[0]
            if residual is not None and np.shape(residual) != self._layer_shapes[name]:
                raise ValueError("server residual of layer %r in the checkpoint has shape "
                                 "%s, the layer %s" % (name, np.shape(residual),
                                                       self._layer_shapes[name]))
        self._server_mode("load")
        for name, pskey, chunk in chunks:
            residual, thresholds = self._pending_state.get(name, (None, []))
            if residual is None:
                residual = np.zeros(self._layer_shapes[name], np.float32)
            if self.rank == 0:
                t = None
                if chunk.pull == "fc_2bit":
                    # thresholds are per chunk; another chunking measures them anew
                    same = [c for n, _, c in chunks if n == name]
                    t = thresholds[same.index(chunk)] if len(thresholds) == len(same) else None
                piece = np.asarray(residual, np.float32).reshape(-1)[
                    chunk.offset:chunk.offset + chunk.size]
                push = row_sparse_push(chunk, state_values(chunk, piece, t),
                                       np.arange(chunk.state_rows, dtype=np.int64))
            else:
                push = empty_push(chunk)
            self.kv.push(pskey, push[0])
        self._server_mode("run")
        for name, _, _ in chunks:
            self._pending_state.pop(name, None)
