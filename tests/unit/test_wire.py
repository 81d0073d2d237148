"""Round trips of kvstore.wire's push layouts: each writer against its reader, on
random chunkings, through MXNet's own row_sparse sum (what a server does with the
workers' pushes). The pull layouts' round trips are in test_pull.py."""
import mxnet as mx
import numpy as np
import pytest

from mxhylo import ops
from mxhylo.kvstore.codec import Payload
from mxhylo.kvstore.compressors import make_compressors
from mxhylo.kvstore.wire import (ROW_ID_BYTES, empty_push, flat, plan_chunks, push_slot,
                                 push_rows, slot_payload)


def _server_sum(pushes):
    """What a server stores for a key after summing row_sparse pushes."""
    total = pushes[0]
    for p in pushes[1:]:
        total = mx.nd.sparse.elemwise_add(total, p)
    return total


@pytest.mark.parametrize("seed", [
    # (seeds 3 and 5: 16-element chunks, as seed 0's, of 3 and 4 workers: thousands of
    # chunks; several workers' slots, as seeds 1 and 4's, in fewer)
    pytest.param(s, marks=pytest.mark.slow) if s in (3, 5) else s for s in range(6)])
def test_2bit_slots_round_trip_through_the_servers_sum(seed):
    """Every worker's slot comes out of the sum unchanged: its threshold and the exact
    code words (any bits, NaN patterns included), decoding to the worker's values."""
    rng = np.random.RandomState(seed)
    workers = rng.randint(1, 5)
    shape = (int(rng.randint(1, 200)), int(rng.randint(1, 400)))
    n = shape[0] * shape[1]
    chunks = plan_chunks("fc_2bit", shape, workers, 2, int(rng.choice([16, 1024, 4096])))
    codec = make_compressors()["fc_2bit"]
    words = -(-n // 16)
    codes = [rng.randint(0, 2 ** 32, size=words, dtype=np.uint64).astype(np.uint32)
             .view(np.int32) for _ in range(workers)]
    thresholds = [float(np.float32(rng.uniform(1e-6, 5))) for _ in range(workers)]
    fulls = []          # each worker's whole layer, decoded
    for w in range(workers):
        full = mx.nd.zeros((n,))
        ops.dequantize_2bit(mx.nd.array(codes[w], dtype=np.int32), thresholds[w], (n,),
                            out=full)
        fulls.append(full.asnumpy())
    for c in chunks:
        assert c.kind == "slots" and c.codec == "fc_2bit"
        pushes = []
        for w in range(workers):
            a, b = codec.byte_span(c.lo, c.hi)
            value, nbytes = push_slot(c, w, codes[w].view(np.uint8)[a:b], (thresholds[w],))
            assert nbytes == c.slot_rows * (4 * c.cols + ROW_ID_BYTES)
            pushes.append(value)
        summed = _server_sum(pushes)
        rows, data = summed.indices.asnumpy(), summed.data.asnumpy()
        for w in range(workers):
            mine = (rows >= w * c.slot_rows) & (rows < (w + 1) * c.slot_rows)
            payload = slot_payload(c, data[mine].reshape(-1))
            assert payload.scalars == (thresholds[w],)
            want = codes[w][c.lo // 16:-(-c.hi // 16)]
            np.testing.assert_array_equal(payload.arrays[0].asnumpy(), want)
            # and the decode is the worker's own chunk
            out = mx.nd.zeros((c.size,))
            ops.dequantize_2bit(payload.arrays[0], payload.scalars[0], (c.size,), out=out)
            np.testing.assert_array_equal(out.asnumpy(), fulls[w][c.lo:c.hi])


def test_fp16_slots_round_trip_every_bit_pattern():
    """A codec of its own file (kvstore.codec_fp16) travels in slots too: every float16
    bit pattern (NaNs, infinities, denormals, -0) comes out of the servers' sum as the
    worker pushed it, piece by piece of a layer cut into chunks."""
    codec = make_compressors()["fp16"]
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    workers, n = 3, patterns.size + 5
    chunks = plan_chunks("fp16", (n,), workers, 2, 4096)
    assert len(chunks) > 2 and all(c.kind == "slots" and c.codec == "fp16" for c in chunks)
    rng = np.random.RandomState(0)
    halves = [np.concatenate([rng.permutation(patterns), patterns[:5]]) for _ in range(workers)]
    payloads = [make_payload(codec, h) for h in halves]
    for c in chunks:
        a, b = codec.byte_span(c.lo, c.hi)
        summed = _server_sum([push_slot(c, w, codec.to_bytes(p)[a:b], p.scalars)[0]
                              for w, p in enumerate(payloads)])
        rows, data = summed.indices.asnumpy(), summed.data.asnumpy()
        for w in range(workers):
            mine = (rows >= w * c.slot_rows) & (rows < (w + 1) * c.slot_rows)
            got = slot_payload(c, data[mine].reshape(-1)).arrays[0].asnumpy()
            np.testing.assert_array_equal(got.view(np.uint16),
                                          halves[w][c.lo:c.hi].view(np.uint16))


def make_payload(codec, half):
    return Payload(codec.name, half.shape, (mx.nd.array(half, dtype=np.float16),))


def test_rows_pushes_sum_to_the_scatter_add():
    """Workers' top-k rows (some chunks without any, which push an empty row) sum to the
    dense scatter-add of every worker's filters, chunk by chunk."""
    rng = np.random.RandomState(3)
    shape, workers = (40, 3, 3, 3), 3
    chunks = plan_chunks("conv_topk", shape, workers, 2, 27 * 7, split_min=1)
    assert len(chunks) > 2
    dense = np.zeros((40, 27), np.float32)
    picks = []
    for w in range(workers):
        idx = np.sort(rng.choice(40, 5, replace=False)).astype(np.int32)
        vals = rng.randn(5, 3, 3, 3).astype(np.float32)
        picks.append((idx, vals))
        np.add.at(dense, idx, vals.reshape(5, -1))
    for c in chunks:
        pushes = []
        for idx, vals in picks:
            a, b = np.searchsorted(idx, [c.lo, c.hi])
            if a == b:
                value, nbytes = empty_push(c)
                assert nbytes == 4 * c.cols + ROW_ID_BYTES
            else:
                value, nbytes = push_rows(c, mx.nd.array(idx[a:b], dtype=np.int32),
                                          mx.nd.array(vals[a:b]))
                assert nbytes == (b - a) * (4 * c.cols + ROW_ID_BYTES)
            pushes.append(value)
        got = _server_sum(pushes).tostype("default").asnumpy()
        np.testing.assert_array_equal(got[:c.hi - c.lo], dense[c.lo:c.hi])


@pytest.mark.parametrize("n", [0, 1, 14, 15, 16, 17, 29, 30, 31, 1000, 4097])
def test_packed_bytes_are_normal_floats_that_survive_a_sum(n):
    """pack_bytes puts 15 bytes in 4 float32 values, every one a normal number (not
    zero, denormal, Inf or NaN), so that adding zeros, as the servers' sum of other
    slots does, keeps every bit; unpack_bytes returns the bytes, all 256 values and
    the edges (all zero, all ones) included."""
    from mxhylo.ops.formats import pack_bytes, carrier_values, unpack_bytes
    rng = np.random.RandomState(n)
    for data in (rng.randint(0, 256, n).astype(np.uint8), np.zeros(n, np.uint8),
                 np.full(n, 255, np.uint8), (np.arange(n) % 256).astype(np.uint8)):
        values = pack_bytes(data)
        assert values.dtype == np.float32 and len(values) == carrier_values(n) == 4 * -(-n // 15)
        assert np.all(np.isfinite(values))
        assert np.all(np.abs(values) >= np.finfo(np.float32).tiny)
        summed = (mx.nd.array(values) + mx.nd.zeros(len(values))).asnumpy() if n else values
        np.testing.assert_array_equal(summed.view(np.uint32), values.view(np.uint32))
        padded = np.concatenate([summed, np.zeros(5, np.float32)])   # a slot's padding
        np.testing.assert_array_equal(unpack_bytes(padded, n), data)


def test_unpack_names_an_altered_payload():
    from mxhylo.ops.formats import pack_bytes, unpack_bytes
    values = pack_bytes(np.arange(30, dtype=np.uint8))
    values[5] = 3.0                          # an exponent pack_bytes never writes
    with pytest.raises(ValueError, match="altered"):
        unpack_bytes(values, 30)


def test_gather_conv_layer_is_one_key_whatever_its_size():
    """A 'gather' rows key pulls up to W * push_k filters, so a layer cut into p keys
    would pull p times that: it stays whole (MXNet's split is lifted for hylo's store),
    while the other pulls still cut a large layer over the servers."""
    shape = (512, 512, 3, 3)                 # 2.4 M elements: above MXNet's 1e6 bound
    (whole,) = plan_chunks("conv_topk", shape, 4, 2, pull="gather", pull_rate=0.024,
                           push_k=12)
    assert (whole.lo, whole.hi, whole.pull_k, whole.push_rows) == (0, 512, 48, 12)
    assert whole.wire_nbytes == 4 * whole.cols * (12 + whole.pull_rows) < 4 * whole.size / 8
    assert len(plan_chunks("conv_topk", shape, 4, 2, pull="none")) >= 4


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_gather_slots_key_holds_the_slots_only(workers):
    """A 'gather' slots key is as tall as the W slots it carries, not as the layer's
    dense rows (a key's rows are fixed by its initial value: a dense-tall key would keep
    a dense copy of the layer on its server); the dense pull keeps the dense rows."""
    shape = (4096, 4096)
    for c in plan_chunks("fc_2bit", shape, workers, 2, pull="gather"):
        assert c.pull == "gather"
        assert c.rows == c.pull_rows == workers * c.slot_rows < c.dense_rows
        assert c.key_shape == (c.rows, c.cols)
    for c in plan_chunks("fc_2bit", shape, workers, 2, pull="none"):
        assert c.rows >= c.dense_rows


def test_the_store_is_made_with_the_split_lifted_and_the_environment_restored(monkeypatch):
    import os
    from mxhylo.kvstore import transport_ps
    seen = []
    monkeypatch.setattr(mx.kv, "create", lambda name: seen.append(
        (name, os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND"))) or "store")
    for before in (None, "1000"):
        if before is None:
            monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
        else:
            monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", before)
        assert transport_ps._native_store_unsplit() == "store"
        assert os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND") == before
    assert seen == [("dist_sync", str(2 ** 31 - 1))] * 2


class _RecordingStore:
    """MXNet's dist store as KeyTable uses it, one worker: remembers what each key was
    initialised with; a pull returns the last push (the model check's key)."""
    rank, num_workers = 0, 1

    def __init__(self):
        self.initialised, self._pushed = {}, {}

    def init(self, keys, values):
        keys, values = (keys, values) if isinstance(keys, list) else ([keys], [values])
        self.initialised.update(zip(keys, values))

    def push(self, key, value):
        self._pushed[key] = value.copy()

    def pull(self, key, out):
        self._pushed[key].copyto(out)


@pytest.mark.parametrize("strategy, shape", [("fc_2bit", (512, 300)),
                                             ("conv_topk", (64, 32, 3, 3))])
def test_a_layer_has_a_broadcast_key_warm_up_keys_and_its_exchange_keys(strategy, shape):
    """A compressed layer broadcast: its broadcast key holds a copy of the value (MXNet
    sends nothing from an array in oneDNN's own layout: kvstore.trainer_hook), its
    warm-up keys the dense rest, and the keys of its compressed exchange no dense copy
    of the layer (MXNet keeps each key's initial value on rank 0 and on its server)."""
    from types import SimpleNamespace
    from mxhylo.kvstore.policy import LayerPlan
    from mxhylo.kvstore.ps_keys import KeyTable
    layer = SimpleNamespace(key="w", plan=LayerPlan("w", shape, strategy, rate=0.25, k=16),
                            warms_up=True)
    value, size = mx.nd.ones(shape), int(np.prod(shape))
    store = _RecordingStore()
    table = KeyTable(store, 2, 1 << 20, 1 << 18, 1 << 16, "gather")
    before = set(store.initialised)                  # (the model check's key)
    table.init([layer], [value])
    made = {k: v for k, v in store.initialised.items() if k not in before}
    sent = made[table.broadcast_key(layer)]
    assert sent is not value and np.array_equal(sent.asnumpy(), value.asnumpy())
    warm = [c.pskey for c in table.warm_chunks["w"]]
    assert sum(made[k].size for k in warm) == size
    assert all(made[k].stype == "default" for k in warm)
    exchanged = [c.pskey for c in table.chunks["w"]]
    assert not any(made[k] is value for k in exchanged)
    assert not any(made[k].stype == "default" and made[k].size >= size   # no dense copy
                   for k in exchanged)
    assert len(made) == 1 + len(warm) + len(exchanged)


def test_a_models_layers_are_made_with_one_barrier():
    """Broadcasting many layers makes their keys in one kv.init (one barrier of the job)
    after one model check, not one of each per layer: a first step of 161 layers over
    the parameter server paid 161 of each."""
    from types import SimpleNamespace
    from mxhylo.kvstore.policy import LayerPlan
    from mxhylo.kvstore.ps_keys import KeyTable
    store = _RecordingStore()
    calls = []
    init = store.init
    store.init = lambda keys, values: (calls.append(keys), init(keys, values))
    table = KeyTable(store, 2, 1 << 20, 1 << 18, 1 << 16, "gather")
    calls.clear()                                        # (the model check's key)
    layers = [SimpleNamespace(key=i, plan=LayerPlan("l%d" % i, shape, strategy, rate=0.25,
                                                    k=4), warms_up=True)
              for i, (shape, strategy) in enumerate([((64, 32, 3, 3), "conv_topk"),
                                                     ((512, 300), "fc_2bit"),
                                                     ((300,), "none")] * 5)]
    table.init(layers, [mx.nd.ones(l.plan.shape) for l in layers])
    assert len(calls) == 1
    assert all(table.broadcast_key(l) in calls[0] for l in layers)
    table.init(layers, [mx.nd.ones(l.plan.shape) for l in layers])     # made already
    assert len(calls) == 1


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_2bit_gather_decodes_in_one_pass_as_payload_by_payload(workers):
    """A 2-bit chunk's 'gather' pull (TwoBit.decode_slots, one C++ pass) is bitwise the
    sum of each worker's payload decoded in rank order (Compressor.decode_slots), on
    chunks within one block of the pass, on its edge and over several; a slot whose
    carriers were altered, or whose value is not finite and > 0, is refused by name."""
    from mxhylo.kvstore.codec import Compressor
    codec = make_compressors()["fc_2bit"]
    rng = np.random.RandomState(workers)
    for n in (1, 17, 3840, 3841, 3 * 3840 + 333):
        (c,) = plan_chunks("fc_2bit", (n,), workers, 1, 1 << 20)
        values, codes = [], []
        for w in range(workers):
            g = mx.nd.array(rng.randn(n).astype(np.float32) * 10.0 ** rng.randint(-3, 3))
            words, stats = ops.quantize_2bit(g, mx.nd.zeros((n,)), 0.7 * g.abs().mean().asscalar())
            values.append(float(stats.asnumpy()[2]))
            codes.append(words.asnumpy())
        summed = _server_sum([push_slot(c, w, codes[w].view(np.uint8), (values[w],))[0]
                              for w in range(workers)])
        slots = summed.data.asnumpy().reshape(workers, -1)
        layer, each = mx.nd.ones((n + 10,)), mx.nd.ones((n,))
        fused = layer[5:5 + n]              # a chunk's piece of its layer's aggregate
        codec.decode_slots(slots, n, fused)
        Compressor.decode_slots(codec, slots, n, each)
        assert np.abs(each.asnumpy()).sum() > 0
        np.testing.assert_array_equal(fused.asnumpy().view(np.uint32),
                                      each.asnumpy().view(np.uint32))
        kept = np.delete(layer.asnumpy(), np.arange(5, 5 + n))
        np.testing.assert_array_equal(kept, np.ones(10, np.float32))
    altered = slots.copy()
    altered[workers - 1, 2] = np.inf
    with pytest.raises(ValueError, match="rank\\(s\\) %d hold values" % (workers - 1)):
        codec.decode_slots(altered, n, fused)
    altered = slots.copy()
    altered[0, 0] = -1.0
    with pytest.raises(ValueError, match="row 0 was sent with value -1"):
        codec.decode_slots(altered, n, fused)


def test_a_reused_slot_push_carries_the_new_payload_once_the_last_one_was_read():
    """push_slot(into=) writes the slot in the array of an earlier push (a transport
    reuses one per key): after the servers' sum has read the first push, the array
    carries the second payload, bitwise the array a fresh push_slot makes."""
    (c,) = plan_chunks("fc_2bit", (3000,), 3, 1, 1 << 20)
    rng = np.random.RandomState(1)
    first, second = (rng.randint(-2 ** 31, 2 ** 31, size=188).astype(np.int32)
                     for _ in range(2))
    reused, _ = push_slot(c, 1, first.view(np.uint8), (0.5,))
    before = _server_sum([reused, push_slot(c, 0, second.view(np.uint8), (2.0,))[0]])
    again, nbytes = push_slot(c, 1, second.view(np.uint8), (0.25,), into=reused)
    fresh, fresh_nbytes = push_slot(c, 1, second.view(np.uint8), (0.25,))
    assert again is reused and nbytes == fresh_nbytes
    np.testing.assert_array_equal(again.asnumpy().view(np.uint32),
                                  fresh.asnumpy().view(np.uint32))
    mine = before.asnumpy()[c.slot_rows:2 * c.slot_rows].reshape(-1)
    assert slot_payload(c, mine).scalars == (0.5,)      # the sum read the first payload


def test_flat_is_a_one_dimensional_view_of_the_same_memory():
    """wire.flat(a) is a.reshape((-1,)): same values, and a write through it is a's."""
    a = mx.nd.array(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    f = flat(a)
    assert f.shape == (24,)
    np.testing.assert_array_equal(f.asnumpy(), np.arange(24))
    f[5:7] = -1
    assert a.asnumpy()[0, 1, 1] == -1 and a.asnumpy()[0, 1, 2] == -1
    np.testing.assert_array_equal(flat(a[1]).asnumpy(), np.arange(12, 24))


@pytest.mark.parametrize("workers,shape", [(1, (40,)), (3, (6, 5, 3, 3)), (4, (1000, 33))])
def test_a_gathered_2bit_layer_decodes_in_one_pass_as_payload_by_payload(workers, shape):
    """The Horovod transport's decode of an allgather of 2-bit blobs (read in place,
    one pass) writes bitwise what decoding each worker's payload in rank order writes,
    into the layer's own array; a blob whose value is not a 2-bit payload's is named."""
    from mxhylo.kvstore.wire import blob_payloads, blob_spans, payload_blob
    codec = make_compressors()["fc_2bit"]
    rng = np.random.RandomState(workers)
    blobs = []
    for w in range(workers):
        g = mx.nd.array(rng.randn(*shape).astype(np.float32) * 10.0 ** (w - 1))
        words, stats = ops.quantize_2bit(g, mx.nd.zeros(shape), 0.8 * g.abs().mean().asscalar())
        blobs.append(payload_blob(Payload("fc_2bit", shape, (words,),
                                          (float(stats.asnumpy()[2]),))))
    data = np.concatenate(blobs)
    one_pass = mx.nd.ones(shape)
    codec.decode_gathered(data, blob_spans(data, shape), int(np.prod(shape)), one_pass)
    each = mx.nd.zeros(shape)
    for blob in blob_payloads(data, shape):
        codec.decode(blob.payload, each.reshape(blob.payload.shape), accumulate=True)
    assert np.abs(each.asnumpy()).sum() > 0
    np.testing.assert_array_equal(one_pass.asnumpy().view(np.uint32),
                                  each.asnumpy().view(np.uint32))
    bad = data.copy()
    span = blob_spans(bad, shape)[-1]
    bad[span.body_at - 4:span.body_at] = np.array([-1.0], np.float32).view(np.uint8)
    with pytest.raises(ValueError, match="worker %d's codes were sent with value -1"
                       % (workers - 1)):
        codec.decode_gathered(bad, blob_spans(bad, shape), int(np.prod(shape)), one_pass)
    with pytest.raises(ValueError, match="truncated|corrupt|needs"):
        blob_spans(data[:-4], shape)


def test_decode_gathered_2bit_refuses_what_it_cannot_read():
    """Offsets that are not multiples of 4 or run past the data, and unequal numbers of
    offsets and values, are refused with the problem named."""
    data = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="cannot start at byte 2"):
        ops.decode_gathered_2bit(data, [2], [1.0], 16)
    with pytest.raises(ValueError, match="cannot start at byte 64"):
        ops.decode_gathered_2bit(data, [0, 64], [1.0, 1.0], 16)
    with pytest.raises(ValueError, match="one offset and one value per worker"):
        ops.decode_gathered_2bit(data, [0, 4], [1.0], 16)
    with pytest.raises(ValueError, match="address that is a multiple of 4"):
        ops.decode_gathered_2bit(data[1:], [0], [1.0], 16)
    np.testing.assert_array_equal(ops.decode_gathered_2bit(data, [0, 4], [1.0, 2.0], 17),
                                  np.zeros(17, np.float32))
