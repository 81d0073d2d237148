"""The shared-scale 2-bit codec and the 'sum' pull, against numpy: integer sums of
codes and their base-(2W+1) packing for every W (numpy's format, and the C++ and
reference operators that compute it bitwise), the codec's quantization and the
scale the workers agree on, and the pull's layout through MXNet's row_sparse sum."""
import mxnet as mx
import numpy as np
import pytest

import mxhylo
from mxhylo import ops
from mxhylo.ops import formats as sums, reference
from mxhylo.kvstore.codec_shared import NOTHING_SENT
from mxhylo.kvstore.compressors import make_compressors
from mxhylo.kvstore.memory import ResidualMemory
from mxhylo.kvstore.policy import LayerPlan
from mxhylo.kvstore.wire import (agreed_header, decode_sums, plan_chunks, push_slot,
                                 sum_payloads, sum_values, summed_aggregate)

CODEC = make_compressors()["shared_2bit"]


def _codes_of(rng, n, density=0.5):
    """Random int32 code words of n elements (codes 0, 1, 2; tail bits 0) and their
    values in {-1, 0, +1} as numpy computes them."""
    c = np.where(rng.random_sample(n) < density, rng.choice([1, 2], size=n), 0)
    words = np.zeros(-(-n // 16), np.uint64)
    for i in range(16):
        part = c[i::16].astype(np.uint64) << np.uint64(2 * i)
        words[:len(part)] |= part
    return words.astype(np.uint32).view(np.int32), np.where(c == 1, 1, np.where(c == 2, -1, 0))


@pytest.mark.parametrize("workers", range(1, 128))
def test_integer_sums_and_their_packing_for_every_worker_count(workers):
    rng = np.random.RandomState(workers)
    n = int(rng.randint(1, 300))
    coded = [_codes_of(rng, n) for _ in range(workers)]
    total = sums.sum_codes([w for w, _ in coded], n)
    np.testing.assert_array_equal(total, np.sum([v for _, v in coded], axis=0))
    packed = sums.pack_sums(total, workers)
    assert len(packed) == sums.packed_nbytes(n, workers)
    np.testing.assert_array_equal(sums.unpack_sums(packed, n, workers), total)
    # base 2W+1, as many digits as a 16-bit group holds
    d = sums.digits_per_group(workers)
    assert (2 * workers + 1) ** d <= 2 ** 16 < (2 * workers + 1) ** (d + 1)


@pytest.mark.parametrize("workers", [1, 2, 16, 64, 127])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 1000])
def test_packing_at_the_edges(workers, n):
    """All +W, all -W, all 0 and alternating extremes, at sizes around a word and a
    group."""
    d = sums.digits_per_group(workers)
    for size in {n, d, d + 1, max(1, d - 1)}:
        for s in (np.full(size, workers), np.full(size, -workers), np.zeros(size, int),
                  np.where(np.arange(size) % 2, workers, -workers)):
            got = sums.unpack_sums(sums.pack_sums(s, workers), size, workers)
            np.testing.assert_array_equal(got, s)


@pytest.mark.parametrize("workers", range(1, 128))
def test_operators_sum_and_decode_as_numpy_for_every_worker_count(workers):
    """ops.sum_2bit writes numpy's packed bytes, ops.decode_sums reads them back as
    float32(sum) * v bitwise, in C++ and in the NDArray reference: random codes (code
    3 included: it counts 0), at a size of several blocks and a short last group."""
    rng = np.random.RandomState(1000 + workers)
    d = sums.digits_per_group(workers)
    n = 16 * d * 64 * 2 + int(rng.randint(1, 16 * d))       # the C++ blocks and a tail
    words = rng.randint(-2 ** 31, 2 ** 31, size=(workers, -(-n // 16)), dtype=np.int64)
    codes = mx.nd.array(words.astype(np.int32), dtype=np.int32)
    want = sums.pack_sums(sums.sum_codes(list(words.astype(np.int32)), n), workers)
    v = float(np.float32(rng.uniform(1e-3, 10)))
    dense = sums.unpack_sums(want, n, workers).astype(np.float32) * np.float32(v)
    for impl in (ops, reference):
        packed = impl.sum_2bit(codes, n)
        assert packed.dtype == np.uint8
        np.testing.assert_array_equal(packed.asnumpy(), want)
        got = impl.decode_sums(packed, mx.nd.array([v]), (n,), workers).asnumpy()
        np.testing.assert_array_equal(got.view(np.int32), dense.view(np.int32))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 12, 20, 64, 127])
def test_decode_reads_every_group_and_marks_those_never_written(workers):
    """Every uint16 group, in both implementations: a group below (2W+1)^d decodes to
    its digits minus W (numpy's table), one at or above it to NaN."""
    d, base = sums.digits_per_group(workers), 2 * workers + 1
    groups = np.arange(1 << 16, dtype="<u2")
    n = d * len(groups)
    packed = mx.nd.array(groups.view(np.uint8), dtype=np.uint8)
    written = groups < base ** d
    want = np.full((len(groups), d), np.nan, np.float32)
    digits = (groups[written, None].astype(np.int64) // base ** np.arange(d)) % base
    want[written] = (digits - workers).astype(np.float32) * np.float32(0.5)
    for impl in (ops, reference):
        got = impl.decode_sums(packed, mx.nd.array([0.5, 7.0]), (n,),
                               workers).asnumpy().reshape(-1, d)
        np.testing.assert_array_equal(got, want)


def test_operators_refuse_bad_arguments():
    codes = mx.nd.zeros((3, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"shape \(W, 2\) for 20 elements"):
        ops.sum_2bit(mx.nd.zeros((3, 1), dtype=np.int32), 20)
    with pytest.raises(ValueError, match="1 <= W <= 127"):
        ops.sum_2bit(mx.nd.zeros((128, 2), dtype=np.int32), 20)
    with pytest.raises(TypeError, match="int32"):
        ops.sum_2bit(codes.astype(np.float32), 20)
    packed = ops.sum_2bit(codes, 20)
    one = mx.nd.ones((1,))
    with pytest.raises(ValueError, match="must have shape"):
        ops.decode_sums(packed, one, (21,), 3)
    with pytest.raises(ValueError, match="at most 127"):
        ops.decode_sums(packed, one, (20,), 128)
    with pytest.raises(TypeError, match="scale must have dtype float32"):
        ops.decode_sums(packed, one.astype(np.float16), (20,), 3)
    with pytest.raises(ValueError, match=r"slots must be \(W, m\)"):
        ops.sum_carried_2bit(np.zeros((128, 40), np.float32), 2, 20)
    with pytest.raises(ValueError, match="from column 2 carry the codes of 200 elements"):
        ops.sum_carried_2bit(np.ones((3, 16), np.float32), 2, 200)
    with pytest.raises(ValueError, match=r"m >= 8 to carry 16 bytes"):
        ops.unpack_bytes(mx.nd.ones((7,)), 16)


@pytest.mark.parametrize("nbytes", [1, 14, 15, 16, 29, 30, 31, 1000, 4097])
def test_bytes_out_of_carriers_as_numpy(nbytes):
    """ops.unpack_bytes reads numpy's carrier values (pack_bytes) back, row by row, in
    C++ and in the reference; a value no pack_bytes writes (0, a denormal, Inf, NaN,
    a large exponent) is counted in its row."""
    rng = np.random.RandomState(nbytes)
    data = rng.randint(0, 256, size=nbytes).astype(np.uint8)
    want = sums.pack_bytes(data)
    exponent = (want.view(np.uint32) >> 23) & 0xFF
    assert ((exponent >= 1) & (exponent <= 64)).all()
    rows = np.stack([want, sums.pack_bytes(data[::-1].copy()), want])
    rows[2, len(want) // 2] = [0.0, 1e-40, np.inf, np.nan, 1e30][nbytes % 5]
    for impl in (ops, reference):
        back, bad = impl.unpack_bytes(mx.nd.array(want), nbytes)
        np.testing.assert_array_equal(back.asnumpy(), data)
        assert bad.asnumpy().tolist() == [0]
        back, bad = impl.unpack_bytes(mx.nd.array(np.pad(rows, ((0, 0), (0, 3)))), nbytes)
        np.testing.assert_array_equal(back.asnumpy()[:2], [data, data[::-1]])
        assert bad.asnumpy().tolist() == [0, 0, 1]


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("nbytes", [0, 1, 14, 15, 16, 17, 29, 30, 31, 1000, 4097])
def test_bytes_into_carriers_as_numpy(nbytes, backend, monkeypatch):
    """ops.pack_bytes (C, on the host: a worker's slot; numpy on the reference backend)
    writes numpy's carriers bitwise, for whole groups, a partial last group and none,
    into a view of a larger array without touching the values past its carriers."""
    if backend == "cpp" and ops.backend() != "cpp":
        pytest.skip("the C++ library is not in use (MXHYLO_OPS=reference or no build)")
    monkeypatch.setattr(ops, "backend", lambda: backend)
    rng = np.random.RandomState(nbytes)
    data = rng.randint(0, 256, size=nbytes).astype(np.uint8)
    want = sums.pack_bytes(data)
    slot = np.full(3 + len(want) + 5, 7.0, np.float32)
    got = ops.pack_bytes(data, out=slot[3:])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(slot[3:3 + len(want)].view(np.uint32), want.view(np.uint32))
    assert (slot[:3] == 7).all() and (slot[3 + len(want):] == 7).all()
    np.testing.assert_array_equal(ops.pack_bytes(data).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="at least %d values to carry %d bytes"
                       % (len(want) + 8, nbytes + 30)):
        ops.pack_bytes(np.zeros(nbytes + 30, np.uint8), out=slot[3:])
    with pytest.raises(TypeError, match="1-D uint8"):
        ops.pack_bytes(data.view(np.int8))


def _carried_slots(rng, workers, size, offset, extra):
    """W slots as a server sees them: ``offset`` header values, then random code words'
    bytes in carriers, then zeros; and the code words."""
    words = rng.randint(-2 ** 31, 2 ** 31, size=(workers, -(-size // 16)),
                        dtype=np.int64).astype(np.int32)
    carried = [sums.pack_bytes(w.view(np.uint8)) for w in words]
    slots = np.zeros((workers, offset + len(carried[0]) + extra), np.float32)
    slots[:, :offset] = rng.rand(workers, offset)
    for w in range(workers):
        slots[w, offset:offset + len(carried[w])] = carried[w]
    return slots, words


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7, 16, 41, 127])
def test_servers_sum_of_carried_codes_is_numpy_composed(workers):
    """ops.sum_carried_2bit (one C++ pass, block by block) is bitwise numpy's unpack,
    integer sum, base-(2W+1) packing and carriers, at sizes inside one block, on a
    block's edge and over several, and counts the altered values of each row."""
    rng = np.random.RandomState(workers)
    d = sums.digits_per_group(workers)
    for size in (1, 17, 1920 * d, 1920 * d + 1, 3 * 1920 * d + 333):
        slots, words = _carried_slots(rng, workers, size, 2, 5)
        carried, bad = ops.sum_carried_2bit(slots, 2, size)
        want = sums.pack_bytes(sums.pack_sums(sums.sum_codes(list(words), size), workers))
        np.testing.assert_array_equal(carried.view(np.uint32), want.view(np.uint32))
        assert bad.tolist() == [0] * workers
    slots[workers - 1, 9] = np.inf
    assert ops.sum_carried_2bit(slots, 2, size)[1].tolist() == [0] * (workers - 1) + [1]


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7, 16, 41, 127])
def test_workers_decode_of_carried_sums_is_numpy_composed(workers, backend, monkeypatch):
    """ops.decode_carried_sums (a 'sum' pull decoded on the host, block by block) is
    float32(s) * v of numpy's sums, bitwise what unpack_bytes then decode_sums give, at
    sizes inside one block, on a block's edge and over several; a group no sum_2bit
    writes decodes as NaN and an altered carrier value is counted."""
    if backend == "cpp" and ops.backend() != "cpp":
        pytest.skip("the C++ library is not in use (MXHYLO_OPS=reference or no build)")
    rng = np.random.RandomState(workers)
    d = sums.digits_per_group(workers)
    v = np.float32(rng.rand() + 0.1)
    for size in (1, 17, 3840 * d, 3840 * d + 1, 2 * 3840 * d + 333):
        total = rng.randint(-workers, workers + 1, size=size)
        packed = sums.pack_sums(total, workers)
        values = np.concatenate([sums.pack_bytes(packed), np.zeros(5, np.float32)])
        want = total.astype(np.float32) * v
        composed = ops.decode_sums(ops.unpack_bytes(mx.nd.array(values), len(packed))[0],
                                   mx.nd.array([v]), (size,), workers).asnumpy()
        monkeypatch.setattr(ops, "backend", lambda: backend)
        out = np.full(size, 7.0, np.float32)
        got, bad = ops.decode_carried_sums(values, v, size, workers, out=out)
        monkeypatch.undo()
        assert got is out and bad == 0
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(got.view(np.uint32), composed.view(np.uint32))
    # the last full group never written (all ones is >= (2W+1)^d), a carrier altered
    groups = packed.view("<u2").copy()
    groups[-2] = 0xFFFF
    values = sums.pack_bytes(groups.view(np.uint8))
    values[3] = np.inf
    monkeypatch.setattr(ops, "backend", lambda: backend)
    got, bad = ops.decode_carried_sums(values, v, size, workers)
    assert bad == 1
    assert np.isnan(got).sum() >= d


def test_decode_of_carried_sums_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"num_workers must be in \[1, 127\]"):
        ops.decode_carried_sums(np.ones(8, np.float32), 1.0, 4, 128)
    with pytest.raises(ValueError, match="4 values carry the sums of 20 elements of 3"):
        ops.decode_carried_sums(np.ones(3, np.float32), 1.0, 20, 3)
    with pytest.raises(ValueError, match=r"out must be writable contiguous float32 \(20,\)"):
        ops.decode_carried_sums(np.ones(8, np.float32), 1.0, 20, 3, out=np.ones(21, np.float32))


def test_out_of_range_sums_and_worker_counts_are_refused():
    with pytest.raises(ValueError, match=r"lies in \[-2, 2\]"):
        sums.pack_sums(np.array([3]), 2)
    with pytest.raises(ValueError, match="1 to 127 workers"):
        sums.digits_per_group(128)
    with pytest.raises(ValueError, match="not what pack_sums writes"):
        sums.unpack_sums(np.full(8, 255, np.uint8), 4, 2)


def _plan(shape, name="fc.weight"):
    return LayerPlan(name=name, shape=shape, strategy="shared_2bit")


def _np_quantize(a, t):
    a32 = a.astype(np.float32)
    return np.where(a32 >= np.float32(t), 1, np.where(a32 <= -np.float32(t), -1, 0))


def test_first_step_sends_nothing_and_keeps_the_gradient():
    rng = np.random.RandomState(0)
    g = rng.randn(40, 30).astype(np.float32)
    memory = ResidualMemory()
    plan = _plan(g.shape)
    payload = CODEC.encode(plan, mx.nd.array(g), memory)
    out = mx.nd.ones(g.shape)
    CODEC.decode(payload, out)
    assert not out.asnumpy().any()
    np.testing.assert_array_equal(memory.residual(plan.name, mx.nd.array(g)).asnumpy(), g)
    v, absum, sent_mean = payload.scalars
    assert v == NOTHING_SENT
    assert absum == pytest.approx(np.abs(g).sum(), rel=1e-5)
    assert sent_mean == 0.0         # nothing sent: no mean to pool


def _agreed(memory, name, threshold, value):
    """Layer ``name``'s memory as after an agreement on ``threshold`` and ``value``."""
    memory.set_scalar(name, "shared_threshold", threshold)
    memory.set_scalar(name, "shared_value", value)


def _agree(plan, payloads, memories):
    header, total = sum_payloads(payloads, plan.size)
    for m in memories:
        CODEC.agree(plan, header, len(memories), m)
    return header, total


@pytest.mark.parametrize("seed", range(4))
def test_agreed_scale_quantizes_every_worker_alike(seed):
    """W workers. Step 1 sends nothing and agrees the threshold t, the mean |a| over
    all workers, with v = t. Step 2 sends sign(a) where |a| >= t, as c * v, and leaves
    a - c * v; it agrees v, the mean over the workers of each one's mean sent |a|.
    Step 3 sends with that v, every worker alike; each summed aggregate is v times the
    sum of the codes, as numpy computes it. While v < 2t no residual element exceeds
    the element it came from."""
    rng = np.random.RandomState(seed)
    workers = int(rng.randint(1, 6))
    shape = (int(rng.randint(1, 50)), int(rng.randint(1, 70)))
    plan = _plan(shape)
    memories = [ResidualMemory() for _ in range(workers)]
    grads = [[rng.randn(*shape).astype(np.float32) for _ in range(workers)]
             for _ in range(3)]
    held = [np.zeros(shape, np.float32) for _ in range(workers)]
    t = v = None
    for step, g in enumerate(grads):
        payloads = [CODEC.encode(plan, mx.nd.array(x), m) for x, m in zip(g, memories)]
        header, total = _agree(plan, payloads, memories)
        want_codes, sent_means, abs_means = [], [], []
        for w in range(workers):
            a = held[w] + g[w]                            # float32, as the op folds
            c = _np_quantize(a, NOTHING_SENT if t is None else t)
            want_codes.append(c)
            abs_means.append(np.abs(a).mean())
            residual = memories[w].residual(plan.name, mx.nd.array(g[w])).asnumpy()
            q = c.astype(np.float32) * np.float32(NOTHING_SENT if v is None else v)
            np.testing.assert_array_equal(residual, a - q)
            if v is not None and np.float32(v) < 2 * np.float32(t):
                # the codec's contraction: no element is left more than it held
                assert (np.abs(residual) <= np.abs(a)).all()
            held[w] = residual
            sent = np.abs(a[c != 0])
            sent_means.append(sent.mean() if sent.size else
                              (0.0 if t is None else np.float32(t)))
            assert payloads[w].scalars[1] == pytest.approx(np.abs(a).sum(), rel=1e-5)
            assert payloads[w].scalars[2] == pytest.approx(sent_means[w], rel=1e-5)
        if v is not None:
            np.testing.assert_array_equal(
                sums.unpack_sums(total.asnumpy(), plan.size, workers),
                np.sum(want_codes, axis=0).reshape(-1))
            np.testing.assert_array_equal(
                decode_sums(header, total, (plan.size,), workers).asnumpy(),
                np.sum(want_codes, axis=0).reshape(-1).astype(np.float32) * np.float32(v))
        t = memories[0].scalar(plan.name, "shared_threshold")
        v = memories[0].scalar(plan.name, "shared_value")
        assert t == pytest.approx(np.mean(abs_means), rel=1e-5)
        assert v == pytest.approx(np.mean(sent_means) if step else t, rel=1e-5)
        assert all(m.scalar(plan.name, "shared_threshold") == t and
                   m.scalar(plan.name, "shared_value") == v for m in memories)


def test_workers_with_different_scales_are_refused():
    plan = _plan((4, 8))
    a, b = ResidualMemory(), ResidualMemory()
    _agreed(b, plan.name, 0.7, 0.7)
    g = mx.nd.ones((4, 8))
    with pytest.raises(ValueError, match="different shared values"):
        sum_payloads([CODEC.encode(plan, g, a), CODEC.encode(plan, g, b)], plan.size)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_refused_with_the_layer_named(bad):
    plan = _plan((8, 16), name="dense7_weight")
    memory = ResidualMemory()
    _agreed(memory, plan.name, 0.75, 0.9)
    rng = np.random.RandomState(1)
    before = rng.randn(8, 16).astype(np.float32)
    memory.residual(plan.name, mx.nd.array(before))[:] = before
    g = rng.randn(8, 16).astype(np.float32)
    g[3, 5] = bad
    with pytest.raises(FloatingPointError, match="dense7_weight"):
        CODEC.encode(plan, mx.nd.array(g), memory)
    np.testing.assert_allclose(memory.residual(plan.name, mx.nd.array(g)).asnumpy(),
                               before, rtol=1e-6, atol=1e-6)


def _server_sum(pushes):
    total = pushes[0]
    for p in pushes[1:]:
        total = mx.nd.sparse.elemwise_add(total, p)
    return total


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_sum_pull_through_the_servers_sum(workers):
    """push_slot of every worker, MXNet's row_sparse sum, sum_values on the 'server',
    summed_aggregate on the 'worker': v times the codes' sums, every chunk."""
    rng = np.random.RandomState(workers)
    shape = (int(rng.randint(20, 90)), 1000)
    n = shape[0] * shape[1]
    plan = _plan(shape)
    memories = [ResidualMemory() for _ in range(workers)]
    for m in memories:
        _agreed(m, plan.name, 1.1, 1.3)          # sent where |a| >= 1.1, as +-1.3
    grads = [rng.randn(*shape).astype(np.float32) for _ in range(workers)]
    payloads = [CODEC.encode(plan, mx.nd.array(g), m) for g, m in zip(grads, memories)]
    want = np.sum([_np_quantize(g, 1.1) for g in grads], axis=0).reshape(-1)
    chunks = plan_chunks("shared_2bit", shape, workers, 2, 16 * 1024, pull="gather")
    assert len(chunks) > 1 and all(c.pull == "sum" for c in chunks)
    for c in chunks:
        pushes = []
        for w, p in enumerate(payloads):
            a, b = CODEC.byte_span(c.lo, c.hi)
            pushes.append(push_slot(c, w, CODEC.to_bytes(p)[a:b], p.scalars)[0])
        pulled = sum_values(c, _server_sum(pushes))
        assert pulled.size == c.pull_rows * c.cols
        # pulled into an NDArray (operators in the engine) or read in host memory
        for values in (mx.nd.array(pulled), pulled):
            aggregate, header, bad = summed_aggregate(c, values)
            np.testing.assert_array_equal(
                aggregate.asnumpy(), want[c.lo:c.hi].astype(np.float32) * np.float32(1.3))
            header = agreed_header("fc", header, bad)
            assert header[0] == np.float32(1.3)
            for i in (1, 2):
                assert header[i] == pytest.approx(sum(p.scalars[i] for p in payloads),
                                                  rel=1e-6)
    # a pulled value altered on the way: the layer is named when its header is read
    altered = pulled.copy()
    altered[5] = 0.0
    for values in (mx.nd.array(altered), altered):
        _, header, bad = summed_aggregate(c, values)
        with pytest.raises(ValueError, match="layer 'fc': 1 pulled values"):
            agreed_header("fc", header, bad)


@pytest.mark.parametrize("workers, bound", [(4, 0.12), (16, 0.2), (64, 0.3), (127, 0.3)])
def test_sum_pull_bytes_do_not_grow_with_the_workers(workers, bound):
    """A large layer's 'sum' pull per worker, headers included, against its dense
    float32 bytes: at most the bound, where a 'gather' of 2-bit codes grows as W/16."""
    shape = (4096, 2048)
    chunks = plan_chunks("shared_2bit", shape, workers, 2, pull="gather")
    pulled = sum(4 * c.pull_rows * c.cols for c in chunks)
    dense = 4 * shape[0] * shape[1]
    assert pulled / dense <= bound
    gathered = sum(4 * c.pull_rows * c.cols
                   for c in plan_chunks("fc_2bit", shape, workers, 2, pull="gather"))
    assert pulled < gathered or gathered >= dense


def test_a_one_process_store_trains_with_the_shared_codec():
    """The store in one process (W = 1) past its warm-up: the first compressed step
    sends nothing, then the scale agreed from it quantizes; the net trains and
    evaluates."""
    mx.random.seed(0)
    np.random.seed(0)
    # (a prefix of its own: Gluon numbers layers process-wide)
    net = mx.gluon.nn.HybridSequential(prefix="shared_")
    with net.name_scope():
        net.add(mx.gluon.nn.Dense(64, activation="relu"), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    kv = mxhylo.create("hylo", policy={"shared_dense0_weight": "shared_2bit"},
                       size_threshold=1)
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd",
                               {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
    rng = np.random.RandomState(0)
    centers = rng.randn(10, 32).astype(np.float32)
    labels = rng.randint(0, 10, size=512)
    data = centers[labels] + 0.3 * rng.randn(512, 32).astype(np.float32)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for epoch in range(6):
        for i in range(0, 512, 64):
            xb, yb = mx.nd.array(data[i:i + 64]), mx.nd.array(labels[i:i + 64])
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(64)
    accuracy = (net(mx.nd.array(data)).argmax(axis=1).asnumpy() == labels).mean()
    assert accuracy > 0.9
    layer = kv.stats()["layers"]["shared_dense0_weight"]
    assert layer["policy"] == "shared_2bit"
    assert layer["last_bytes"] < layer["dense_bytes"] / layer["steps"] / 8   # past warm-up
    v = kv.memory.scalar("shared_dense0_weight", "shared_value")
    assert v is not None and 0 < v < 1


LAYERS = [("fc_weight", (1000, 2048)), ("conv_weight", (256, 256, 3, 3)), ("bias", (10,))]


def _plan_codecs(workers, transport="ps", policy=None, compress_pull="gather"):
    from mxhylo.kvstore.plan import make_plan
    from mxhylo.kvstore.policy import LayerPolicy
    plan = make_plan(LAYERS, policy=LayerPolicy(policy=policy), compress_pull=compress_pull,
                     server_update=False, costs=None, num_workers=workers, num_servers=2,
                     transport=transport)
    return {d.name: (d.codec, d.pull) for d in plan.layers}


def test_the_plan_takes_the_shared_scale_from_16_workers():
    from mxhylo.kvstore.plan import SHARED_SCALE_WORKERS
    assert SHARED_SCALE_WORKERS == 16
    below = _plan_codecs(15)
    assert below == {"fc_weight": ("fc_2bit", "gather"),
                     "conv_weight": ("fc_2bit", "gather"), "bias": ("none", "dense")}
    for transport in ("ps", "horovod"):
        at = _plan_codecs(16, transport)
        assert at["fc_weight"] == at["conv_weight"] == ("shared_2bit", "sum")
        assert at["bias"] == ("none", "dense")
    # a codec the user names is kept; one process has no workers to agree with
    named = _plan_codecs(64, policy={"conv": "conv_topk"})
    assert named["conv_weight"] == ("conv_topk", "gather")
    assert named["fc_weight"] == ("shared_2bit", "sum")
    assert _plan_codecs(64, "local")["fc_weight"] == ("fc_2bit", "gather")
    # the dense pull asked for: today's codecs, the dense aggregate
    assert _plan_codecs(64, compress_pull=None)["fc_weight"] == ("fc_2bit", "dense")


def test_the_cost_model_prices_the_sum_pull():
    """The shared codec's pull is its packed sums whatever W; a gather grows with W."""
    from mxhylo.kvstore.cost_model import CodecCost, CostModel, WireCost
    from mxhylo.kvstore.policy import LayerPolicy
    plan_fc = LayerPolicy().plan_as("fc", (4096, 1024), "shared_2bit")
    wire = WireCost(latency_s=0.0, per_byte_s=1e-8)
    costs = {"shared_2bit": CodecCost(0.0, 0.0), "fc_2bit": CodecCost(0.0, 0.0)}
    payload = CODEC.payload_nbytes(plan_fc)
    for workers in (16, 64):
        model = CostModel(wire, costs, workers, "gather")
        shared = model.predict(plan_fc, payload)
        two_bit = model.predict(LayerPolicy().plan_as("fc", (4096, 1024), "fc_2bit"),
                                payload)
        want = sums.packed_nbytes(plan_fc.size, workers) * 32 / 30 * 1e-8
        assert shared.codec_s == pytest.approx(want)
        assert two_bit.codec_s == pytest.approx(workers * payload * 1e-8)
