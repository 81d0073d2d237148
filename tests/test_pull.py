"""Compressed pull (compress_pull): the servers encode each compressed layer's aggregate
with a codec of their own (server-side error feedback) and the workers decode it.

Covered here: the pull's wire layout (kvstore.wire), the option (kvstore.policy), the
in-process store against a numpy reference of both error-feedback loops (worker and
server), conservation of the gradient sum, edges, traffic, checkpoints, and the real
parameter servers (2 workers, 2 servers) through tests/dist_keys_worker.py.
"""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import mxhylo
from mxhylo import ops
from mxhylo.kvstore.compressors import Payload
from mxhylo.kvstore.policy import LayerPolicy, compress_pull_mode, pull_codec
from mxhylo.kvstore.compressors import PullEncoder
from mxhylo.kvstore.wire import plan_chunks, pull_payload, pull_values


@pytest.fixture(autouse=True)
def _compress_from_the_first_step(monkeypatch):
    """These tests check the codecs step by step: no warm-up (dense first steps)."""
    monkeypatch.setattr("mxhylo.kvstore.hylo.DEFAULT_WARMUP_STEPS", 0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX2 = [mx.cpu(0), mx.cpu(1)]
TINY = np.float32(np.finfo(np.float32).tiny)


def ceil_div(a, b):
    return -(-a // b)


# -- 1. the wire layout of pulls ---------------------------------------------------------

# int32 code words whose bits, read as float32, are NaNs (quiet, signalling, negative),
# infinities, denormals and -0: a pull must carry them unchanged
SPECIAL_WORDS = np.array([0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0xFFC00001, 0xFFFFFFFF,
                          0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x80000001,
                          0x807FFFFF, 0x80000000, 0x00000000, 0x55555555, 0xAAAAAAAA],
                         np.uint32).view(np.int32)


def _random_layouts(rng, count=60):
    """[(strategy, pull codec, pull rate, shape, chunks, workers)] of random layers and
    chunkings (1-4 workers, 1-3 servers, chunks from 1 filter / 16 elements up)."""
    out = []
    for i in range(count):
        workers, servers = rng.randint(1, 5), rng.randint(1, 4)
        kind = i % 3
        if kind == 0:                                   # fc_2bit layer, 2-bit pull
            strategy, pull, rate = "fc_2bit", "fc_2bit", None
            shape = (int(rng.randint(1, 300)), int(rng.randint(1, 700)))
            chunk = int(rng.choice([16, 160, 1024, 2000, 4096, 10 ** 6]))
        else:                                           # conv layer, top-k or 2-bit pull
            strategy = "conv_topk"
            pull = "conv_topk" if kind == 1 else "fc_2bit"
            rate = float(rng.choice([0.01, 0.05, 0.1, 0.25, 0.5, 1.0, rng.uniform(0.01, 1)]))
            shape = (int(rng.randint(1, 200)), int(rng.randint(1, 9)),
                     int(rng.choice([1, 3])), int(rng.choice([1, 3])))
            chunk = int(rng.choice([1, 64, 500, 2048, 10 ** 6]))
        n = int(np.prod(shape))
        split = int(rng.choice([1, n, 10 ** 7]))
        chunks = plan_chunks(strategy, shape, workers, servers, chunk, split,
                             pull=pull, pull_rate=rate)
        out.append((strategy, pull, rate, shape, chunks, workers))
    return out


def _expected_pull(strategy, pull, rate, c):
    """(codec, pull rows) the chunk should have, computed from the layout alone."""
    if pull == "fc_2bit":
        rows = ceil_div(1 + ceil_div(c.size, 16), c.cols)      # threshold, then the words
    else:
        filters = c.hi - c.lo
        k = min(filters, max(1, int(round(rate * filters))))
        rows = ceil_div(k, c.cols) + k                          # index rows, filter rows
    dense_rows = ceil_div(c.size, c.cols)
    return (pull, rows) if rows < dense_rows else ("none", dense_rows)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _through_mxnet(layout, values):
    """The pulled values as the server stores them and a worker reads them back: rows of
    a row_sparse array listed from 0 (mx copies only: the bits must survive)."""
    rows = values.reshape(layout.pull_rows, layout.cols)
    stored = mx.nd.sparse.row_sparse_array(
        (mx.nd.array(rows), mx.nd.arange(layout.pull_rows, dtype=np.int64)),
        shape=layout.key_shape)
    return stored.data.asnumpy().reshape(-1)


def test_pull_layout_rows_fallback_and_state_rows():
    rng = np.random.RandomState(0)
    seen = {"compressed": 0, "dense": 0}
    for strategy, pull, rate, shape, chunks, workers in _random_layouts(rng, 300):
        n = int(np.prod(shape))
        assert sum(c.size for c in chunks) == n
        for c in chunks:
            codec, rows = _expected_pull(strategy, pull, rate, c)
            assert c.pull == codec, (shape, c)
            assert c.pull_rows == rows, (shape, c)
            if codec == "none":
                seen["dense"] += 1
                assert c.pull_rows == c.dense_rows and c.pull_k == 0
                continue
            seen["compressed"] += 1
            assert c.pull_rows < c.dense_rows
            assert c.pull_rows <= c.rows                # the key holds the pull ...
            assert c.state_rows <= c.rows               # ... and the server's state
            assert c.state_rows * c.cols >= c.size + (1 if codec == "fc_2bit" else 0)
            assert c.dense_rows <= c.rows
            if codec == "conv_topk":
                filters = c.hi - c.lo
                assert c.pull_k == min(filters, max(1, int(round(rate * filters))))
            if c.kind == "slots":                        # every worker's slot still fits
                assert c.rows >= workers * c.slot_rows
    assert seen["compressed"] > 100 and seen["dense"] > 20, seen


def test_pull_values_payload_round_trip_is_bit_exact():
    rng = np.random.RandomState(1)
    done = {"fc_2bit": 0, "conv_topk": 0}
    for strategy, pull, rate, shape, chunks, _ in _random_layouts(rng, 120):
        for c in chunks:
            if c.pull == "none":
                with pytest.raises(ValueError, match="dense"):
                    pull_values(c, Payload("fc_2bit", (c.size,), ()))
                continue
            if c.pull == "fc_2bit":
                words = ceil_div(c.size, 16)
                codes = rng.randint(0, 2 ** 32, size=words, dtype=np.uint64)
                codes = codes.astype(np.uint32).view(np.int32)
                m = min(words, len(SPECIAL_WORDS))
                codes[rng.permutation(words)[:m]] = SPECIAL_WORDS[:m]
                t = float(rng.uniform(1e-6, 10))
                payload = Payload("fc_2bit", (c.size,), (mx.nd.array(codes, dtype=np.int32),),
                                  (t,))
            else:
                filters = c.hi - c.lo
                idx = np.sort(rng.choice(filters, c.pull_k, replace=False)).astype(np.int32)
                vals = rng.randn(c.pull_k, c.cols).astype(np.float32)
                payload = Payload("conv_topk", (filters, c.cols),
                                  (mx.nd.array(idx, dtype=np.int32), mx.nd.array(vals)))
            values = pull_values(c, payload)
            assert values.dtype == np.float32 and values.shape == (c.pull_rows * c.cols,)
            wire = _through_mxnet(c, values)
            np.testing.assert_array_equal(_bits(wire), _bits(values))
            back = pull_payload(c, wire)
            assert back.strategy == c.pull
            if c.pull == "fc_2bit":
                assert back.shape == (c.size,)
                assert back.scalars == (float(np.float32(t)),)
                (got,) = back.arrays
                assert got.dtype == np.int32
                np.testing.assert_array_equal(_bits(got.asnumpy()), _bits(codes))
            else:
                assert back.shape == (c.hi - c.lo, c.cols)
                got_idx, got_vals = back.arrays
                assert got_idx.dtype == np.int32
                np.testing.assert_array_equal(got_idx.asnumpy(), idx)
                np.testing.assert_array_equal(_bits(got_vals.asnumpy()), _bits(vals))
            done[c.pull] += 1
    assert done["fc_2bit"] > 20 and done["conv_topk"] > 20, done


def test_real_2bit_codes_include_denormal_words_and_decode_after_the_trip():
    """Codes the quantizer really emits: a tail word (few codes, high bits 0) reads as a
    float32 denormal; after pull_values -> MXNet -> pull_payload it decodes the same."""
    rng = np.random.RandomState(2)
    (c,) = [c for c in plan_chunks("fc_2bit", (37, 113), 2, pull="fc_2bit")
            if c.pull == "fc_2bit"]
    grad = mx.nd.array(rng.randn(c.size).astype(np.float32))
    residual = mx.nd.zeros((c.size,))
    codes, _ = ops.quantize_2bit(grad, residual, 0.8)
    raw = codes.asnumpy()
    as_float = raw.view(np.float32)
    assert np.any((as_float != 0) & (np.abs(as_float) < np.finfo(np.float32).tiny))
    payload = Payload("fc_2bit", (c.size,), (codes,), (0.8,))
    back = pull_payload(c, _through_mxnet(c, pull_values(c, payload)))
    np.testing.assert_array_equal(back.arrays[0].asnumpy(), raw)
    want = ops.dequantize_2bit(codes, 0.8, (c.size,)).asnumpy()
    got = ops.dequantize_2bit(back.arrays[0], back.scalars[0], (c.size,)).asnumpy()
    np.testing.assert_array_equal(got, want)
    expect = np.where(grad.asnumpy() >= np.float32(0.8), np.float32(0.8),
                      np.where(grad.asnumpy() <= -np.float32(0.8), -np.float32(0.8), 0))
    np.testing.assert_array_equal(got, expect)


def test_plan_chunks_pull_errors_and_unchanged_layout():
    with pytest.raises(ValueError, match="pull codec"):
        plan_chunks("fc_2bit", (64, 64), 2, pull="topk")
    with pytest.raises(ValueError, match="conv_topk"):
        plan_chunks("fc_2bit", (64, 64), 2, pull="conv_topk", pull_rate=0.1)
    # uncompressed layers and dense pulls keep the published layout
    assert all(c.pull == "none" for c in plan_chunks("none", (5000,), 2, pull="fc_2bit"))
    for strategy, pull, rate in [("fc_2bit", "fc_2bit", None), ("conv_topk", "conv_topk", 0.1),
                                 ("conv_topk", "fc_2bit", 0.1)]:
        shape = (300, 300) if strategy == "fc_2bit" else (200, 64, 3, 3)
        dense = plan_chunks(strategy, shape, 2, 2, 20000, 10 ** 9)
        pulled = plan_chunks(strategy, shape, 2, 2, 20000, 10 ** 9, pull=pull, pull_rate=rate)
        assert all(c.pull == "none" and c.pull_k == 0 for c in dense)
        assert all(c.pull == pull for c in pulled)
        # a compressed pull changes only the pull and, for the server's state, the rows
        assert [dataclasses.replace(c, pull="none", pull_k=0, rows=d.rows)
                for c, d in zip(pulled, dense)] == dense
        assert all(c.rows >= d.rows for c, d in zip(pulled, dense))


# -- 2. the option ------------------------------------------------------------------------

@pytest.mark.parametrize("value,mode", [(False, None), (None, None), ("off", None),
                                        (True, "layer"), ("layer", "layer"),
                                        ("2bit", "2bit"), ("gather", "gather")])
def test_compress_pull_mode_normalises(value, mode):
    assert compress_pull_mode(value) == mode
    kv = mxhylo.create(compress_pull=value)
    assert kv.compress_pull == mode
    assert kv.stats()["options"]["compress_pull"] == mode


@pytest.mark.parametrize("bad", ["yes", 3, "2-bit", "topk", 0.5, [True]])
def test_compress_pull_mode_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="compress_pull.*got " + re.escape(repr(bad))):
        compress_pull_mode(bad)
    with pytest.raises(ValueError, match="compress_pull"):
        mxhylo.create(compress_pull=bad)


def test_pull_codec_table():
    table = {("none", None): "none", ("conv_topk", None): "none", ("fc_2bit", None): "none",
             ("none", "layer"): "none", ("conv_topk", "layer"): "conv_topk",
             ("fc_2bit", "layer"): "fc_2bit", ("none", "2bit"): "none",
             ("conv_topk", "2bit"): "fc_2bit", ("fc_2bit", "2bit"): "fc_2bit",
             ("none", "gather"): "none", ("conv_topk", "gather"): "gather",
             ("fc_2bit", "gather"): "gather", ("fp16", "layer"): "none",
             ("fp16", "2bit"): "fc_2bit", ("fp16", "gather"): "gather"}
    for (strategy, mode), codec in table.items():
        assert pull_codec(strategy, mode) == codec, (strategy, mode)


# -- 3. in one process: numpy reference of both error-feedback loops -----------------------

def _threshold(a, scale=1.0):
    """scale * mean |a| as the codec takes it: float32, at least the smallest normal."""
    return max(np.float32(scale * np.abs(a.astype(np.float64)).sum() / a.size), TINY)


class Ref2Bit:
    """One 2-bit error-feedback loop: t lags one step (the first step measures first);
    the elements with |a| >= t go as +-v, v the mean of their |a| (``used``)."""

    def __init__(self, shape, scale=1.0):
        self.r = np.zeros(shape, np.float32)
        self.t = None
        self.scale = scale

    def __call__(self, g):
        a = g.astype(np.float32) + self.r
        t = _threshold(a, self.scale) if self.t is None else self.t
        sent = np.abs(a) >= t
        v = np.float32(np.abs(a[sent]).astype(np.float64).mean()) if sent.any() else t
        q = np.where(a >= t, v, np.where(a <= -t, -v, 0)).astype(np.float32)
        self.threshold_used, self.used = t, v
        self.r = (a - q).astype(np.float32)
        self.t = _threshold(a, self.scale)
        return q


class RefTopK:
    """One top-k error-feedback loop: k rows of largest L2 norm, ties to the lower index."""

    def __init__(self, shape, k):
        self.r = np.zeros(shape, np.float32)
        self.k = k

    def __call__(self, g):
        a = g.astype(np.float32) + self.r
        norms = (a.reshape(len(a), -1).astype(np.float64) ** 2).sum(1)
        top = np.sort(np.argsort(-norms, kind="stable")[:self.k])
        sent = np.zeros_like(a)
        sent[top] = a[top]
        self.r = (a - sent).astype(np.float32)
        return sent


def _ref(strategy, shape, k=None):
    return Ref2Bit(shape) if strategy == "fc_2bit" else RefTopK(shape, k)


def _server_residual(kv, name):
    return kv.transport.server.memory.get(name).asnumpy()


def test_fc_2bit_server_error_feedback_matches_numpy():
    """Two devices reduce, the worker 2-bit encodes, the server 2-bit encodes the
    aggregate plus its residual with its own lag-one threshold.

    With one worker the server sends its aggregate on unchanged: the aggregate is
    {0, +-v} with v >= the worker's threshold, mean |a| of the worker's previous step,
    which is at least the mean |aggregate| of that step, the server's threshold. (The
    servers' own loop on other aggregates: the PullEncoder tests below.)"""
    rng = np.random.RandomState(10)
    kv = mxhylo.create(size_threshold=10, compress_pull="layer")
    plain = mxhylo.create(size_threshold=10)                    # the same without it
    shape = (20, 33)                                        # 660: not a multiple of 16
    worker, server = Ref2Bit(shape), Ref2Bit(shape)
    for step in range(6):
        scale = 0.01 if step % 2 == 0 else 0.001                # thresholds lag behind
        g = [(rng.randn(*shape) * scale).astype(np.float32) for _ in CTX2]
        arrs = [mx.nd.array(x, ctx=c) for x, c in zip(g, CTX2)]
        plain_arrs = [mx.nd.array(x, ctx=c) for x, c in zip(g, CTX2)]
        pushed = worker(g[0] + g[1])
        want = server(pushed)
        kv.pushpull("fc", arrs)
        plain.pushpull("fc", plain_arrs)
        for x, y in zip(arrs, plain_arrs):
            np.testing.assert_allclose(x.asnumpy(), want, rtol=1e-5, atol=0)
            np.testing.assert_allclose(y.asnumpy(), pushed, rtol=1e-5, atol=0)
        assert len(np.unique(np.abs(want))) <= 2                   # 0 and v only
        np.testing.assert_allclose(want, pushed, rtol=1e-5, atol=0)
        np.testing.assert_allclose(kv.memory.get("fc").asnumpy(), worker.r, rtol=0,
                                   atol=1e-7)
        np.testing.assert_allclose(_server_residual(kv, "fc"), server.r, rtol=0, atol=1e-7)
        assert kv.transport.server.memory.scalar("fc", "threshold") == pytest.approx(
            float(server.t), rel=1e-5)
    assert np.abs(worker.r).max() > 0 and kv.transport.server.memory.names() == ["fc"]
    assert plain.transport.server.memory.names() == []


def test_conv_topk_in_one_process_pulls_the_workers_rows_exactly():
    """One worker, same k on both loops: the aggregate has at most k non-zero filters,
    so the server sends them all and keeps nothing (small integers: ties everywhere)."""
    rng = np.random.RandomState(11)
    shape = (12, 2, 1, 1)
    kv = mxhylo.create(size_threshold=1, conv_rate=0.25, compress_pull=True)
    worker, server = RefTopK(shape, 3), RefTopK(shape, 3)
    for step in range(12):
        g = rng.randint(-1, 2, size=shape).astype(np.float32)
        want = server(worker(g))
        x = mx.nd.array(g)
        kv.pushpull("conv", x)
        np.testing.assert_array_equal(x.asnumpy(), want)
        np.testing.assert_array_equal(kv.memory.get("conv").asnumpy(), worker.r)
        np.testing.assert_array_equal(_server_residual(kv, "conv"), server.r)
    assert kv.plans()["conv"].k == 3
    assert not server.r.any() and worker.r.any()


def test_server_pull_encoder_topk_with_ties_matches_numpy():
    """The servers' encoder on aggregates of several workers (more than k non-zero
    filters): k filters of largest norm of aggregate + residual, ties to the lower index."""
    rng = np.random.RandomState(22)
    shape = (12, 3)
    enc = PullEncoder()
    ref = RefTopK(shape, 4)
    ties = 0
    for step in range(15):
        agg = rng.randint(-2, 3, size=shape).astype(np.float32)
        agg[rng.rand(12) < 0.3] = 0
        norms = np.sort(((agg + ref.r) ** 2).sum(1))[::-1]
        ties += norms[3] == norms[4]                    # a tie across the k-th filter
        want = ref(agg)
        payload = enc.encode("key7", "conv_topk", mx.nd.array(agg), k=4)
        idx, vals = (a.asnumpy() for a in payload.arrays)
        assert list(idx) == sorted(idx) and len(idx) == 4
        got = ops.scatter_kernels(*payload.arrays, shape).asnumpy()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(enc.memory.get("key7").asnumpy(), ref.r)
    assert ref.r.any() and ties >= 3
    residual, threshold = enc.state("key7", shape)
    np.testing.assert_array_equal(residual, ref.r)
    assert threshold is None


def test_server_pull_encoder_2bit_with_threshold_scale_matches_numpy():
    rng = np.random.RandomState(23)
    enc = PullEncoder(threshold_scale=1.5)
    ref = Ref2Bit((1000,), scale=1.5)
    for step in range(6):
        agg = (rng.randn(1000) * 0.1).astype(np.float32)
        want = ref(agg)
        payload = enc.encode("key3", "fc_2bit", mx.nd.array(agg))
        assert payload.scalars[0] == pytest.approx(float(ref.used), rel=1e-6)
        got = ops.dequantize_2bit(payload.arrays[0], payload.scalars[0], (1000,)).asnumpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        np.testing.assert_allclose(enc.memory.get("key3").asnumpy(), ref.r, rtol=0, atol=1e-7)
    # set_state / state: what the servers' checkpoint modes move
    other = PullEncoder(threshold_scale=1.5)
    residual, threshold = enc.state("key3", (1000,))
    other.set_state("key3", residual, threshold)
    agg = (rng.randn(1000) * 0.1).astype(np.float32)
    a = enc.encode("key3", "fc_2bit", mx.nd.array(agg))
    b = other.encode("key3", "fc_2bit", mx.nd.array(agg))
    assert a.scalars == b.scalars
    np.testing.assert_array_equal(a.arrays[0].asnumpy(), b.arrays[0].asnumpy())


def test_2bit_mode_pulls_conv_layers_as_2bit():
    rng = np.random.RandomState(13)
    shape = (16, 8, 3, 3)
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25, compress_pull="2bit")
    worker, server = RefTopK(shape, 4), Ref2Bit(shape)
    for step in range(5):
        g = rng.randn(*shape).astype(np.float32)
        want = server(worker(g))
        x = mx.nd.array(g)
        kv.pushpull("conv", x)
        np.testing.assert_allclose(x.asnumpy(), want, rtol=1e-5, atol=0)
        np.testing.assert_allclose(_server_residual(kv, "conv"), server.r, rtol=0, atol=1e-6)
    assert kv.transport.server.memory.scalar("conv", "threshold") == pytest.approx(
        float(server.t), rel=1e-6)


LAYERS = {"fc": (64, 48), "conv": (16, 8, 3, 3), "bias": (48,), "fc_odd": (7, 333)}


def _run_steps(kv, rng, steps, shapes=LAYERS, scale=0.01, dtype=np.float32):
    """Random gradients through pushpull; returns [(grads, outputs)] as numpy."""
    names = sorted(shapes)
    history = []
    for _ in range(steps):
        g = [(rng.randn(*shapes[n]) * scale).astype(dtype) for n in names]
        x = [mx.nd.array(a, dtype=dtype) for a in g]
        kv.pushpull(names, x)
        history.append((dict(zip(names, g)), {n: o.asnumpy() for n, o in zip(names, x)}))
    return history


@pytest.mark.parametrize("mode", ["layer", "2bit"])
def test_conservation_over_many_steps(mode):
    """sum of gradients == sum delivered + worker residual + server residual."""
    rng = np.random.RandomState(14)
    kv = mxhylo.create(size_threshold=300, conv_rate=0.1, compress_pull=mode)
    history = _run_steps(kv, rng, 40)
    plans = kv.plans()
    assert {n: p.strategy for n, p in plans.items()} == {
        "fc": "fc_2bit", "conv": "conv_topk", "bias": "none", "fc_odd": "fc_2bit"}
    for name in LAYERS:
        sent = sum(g[name].astype(np.float64) for g, _ in history)
        got = sum(o[name].astype(np.float64) for _, o in history)
        kept = np.zeros(LAYERS[name])
        if plans[name].strategy != "none":
            worker = kv.memory.get(name).asnumpy()
            server = _server_residual(kv, name)
            if pull_codec(plans[name].strategy, mode) == "conv_topk":
                assert not server.any(), name       # one worker: at most k rows to send
            else:
                assert np.abs(server).max() > 0, name
            kept = worker.astype(np.float64) + server
            last = history[-1][1][name]
            if mode == "2bit" or plans[name].strategy == "fc_2bit":
                assert len(np.unique(np.abs(last))) <= 2, name        # {0, v}
            else:
                assert (np.abs(last.reshape(16, -1)).sum(1) > 0).sum() <= plans[name].k
        else:
            assert kv.transport.server.memory.get(name) is None
        scale = np.abs(sent).max()
        np.testing.assert_allclose(got + kept, sent, rtol=0, atol=1e-5 * scale, err_msg=name)


def test_all_zero_gradients_then_tiny_threshold():
    """Zero steps send zeros and keep zero residuals; the next step's threshold is the
    one measured on zeros (the smallest normal float32), on both loops."""
    shapes = {"fc": (40, 40), "conv": (8, 4, 3, 3)}
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25, compress_pull="layer")
    refs = {"fc": (Ref2Bit(shapes["fc"]), Ref2Bit(shapes["fc"])),
            "conv": (RefTopK(shapes["conv"], 2), RefTopK(shapes["conv"], 2))}
    rng = np.random.RandomState(15)
    for step in range(5):
        zero = step < 2
        g = {n: np.zeros(s, np.float32) if zero else rng.randn(*s).astype(np.float32)
             for n, s in shapes.items()}
        x = {n: mx.nd.array(a) for n, a in g.items()}
        kv.pushpull(["fc", "conv"], [x["fc"], x["conv"]])
        for n in shapes:
            w, s = refs[n]
            want = s(w(g[n]))
            if n == "fc":
                np.testing.assert_allclose(x[n].asnumpy(), want, rtol=1e-5, atol=0)
            else:
                np.testing.assert_array_equal(x[n].asnumpy(), want)
            if zero:
                assert not x[n].asnumpy().any()
                assert not kv.memory.get(n).asnumpy().any()
                assert not _server_residual(kv, n).any()
        if step == 1:
            assert kv.memory.scalar("fc", "threshold") == float(TINY)
            assert kv.transport.server.memory.scalar("fc", "threshold") == float(TINY)
        if step == 2:       # the first real step: every element over +-tiny, both ways
            w, s = refs["fc"]
            assert w.threshold_used == s.threshold_used == TINY
            assert (x["fc"].asnumpy() != 0).all()
            np.testing.assert_allclose(np.abs(x["fc"].asnumpy()), s.used, rtol=1e-6)
    # one worker's {0, +-v} goes through the server unchanged while v >= its threshold
    np.testing.assert_allclose(_server_residual(kv, "fc"), refs["fc"][1].r, rtol=0, atol=1e-5)
    assert np.abs(kv.memory.get("fc").asnumpy()).max() > 0.1


@pytest.mark.parametrize("mode", ["layer", "2bit"])
def test_tiny_and_odd_shapes(mode):
    shapes = {"a": (1, 1), "b": (1, 17), "c": (1, 1, 1, 1), "d": (3, 1, 1, 1), "v": (5,),
              "e": (17, 1), "f": (2, 3, 1, 5)}
    kv = mxhylo.create(size_threshold=1, conv_rate=0.4, policy={"^v$": "fc_2bit"},
                       compress_pull=mode)
    rng = np.random.RandomState(16)
    history = _run_steps(kv, rng, 12, shapes=shapes, scale=1.0)
    plans = kv.plans()
    assert plans["v"].strategy == "fc_2bit" and plans["d"].strategy == "conv_topk"
    assert plans["c"].k == 1 and plans["d"].k == 1 and plans["f"].k == 1
    for name, shape in shapes.items():
        p = plans[name]
        w = _ref(p.strategy, shape, p.k)
        s = _ref(pull_codec(p.strategy, kv.compress_pull), shape, p.k)
        for g, o in history:
            np.testing.assert_allclose(o[name], s(w(g[name])), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        sent = sum(g[name].astype(np.float64) for g, _ in history)
        got = sum(o[name].astype(np.float64) for _, o in history)
        kept = kv.memory.get(name).asnumpy() + _server_residual(kv, name).astype(np.float64)
        np.testing.assert_allclose(got + kept, sent, rtol=0, atol=1e-5, err_msg=name)


def test_float16_gradients():
    rng = np.random.RandomState(17)
    shapes = {"fc": (32, 40), "conv": (8, 4, 3, 3)}
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25, compress_pull="layer")
    refs = {"fc": (Ref2Bit(shapes["fc"]), Ref2Bit(shapes["fc"])),
            "conv": (RefTopK(shapes["conv"], 2), RefTopK(shapes["conv"], 2))}
    for step in range(4):
        g = {n: rng.randn(*s).astype(np.float16) for n, s in shapes.items()}
        x = {n: mx.nd.array(a, dtype=np.float16) for n, a in g.items()}
        kv.pushpull(["fc", "conv"], [x["fc"], x["conv"]])
        for n in shapes:
            assert x[n].dtype == np.float16
            w, s = refs[n]
            want = s(w(g[n].astype(np.float32)))
            np.testing.assert_allclose(x[n].asnumpy().astype(np.float32),
                                       want.astype(np.float16).astype(np.float32),
                                       rtol=2e-3, atol=0, err_msg=n)
            np.testing.assert_allclose(_server_residual(kv, n), s.r, rtol=0, atol=1e-5)
            np.testing.assert_allclose(kv.memory.get(n).asnumpy(), w.r, rtol=0, atol=1e-5)


def _warm_store(mode="layer", steps=3):
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25, compress_pull=mode)
    rng = np.random.RandomState(18)
    for _ in range(steps):
        kv.pushpull(["fc", "conv"], [mx.nd.array(rng.randn(16, 16)),
                                     mx.nd.array(rng.randn(8, 3, 3, 3))])
    return kv, rng


def _snapshot(kv):
    names = ["fc", "conv"]
    return ({n: kv.memory.get(n).asnumpy().copy() for n in names},
            {n: _server_residual(kv, n).copy() for n in names},
            kv.memory.scalar("fc", "threshold"),
            kv.transport.server.memory.scalar("fc", "threshold"))


def _nan_grads(rng):
    g = rng.randn(16, 16).astype(np.float32)
    g[2, 3] = np.nan
    c = rng.randn(8, 3, 3, 3).astype(np.float32)
    c[1, 0, 0, 0] = np.inf
    return g, c


@pytest.mark.parametrize("mode", ["layer", "2bit"])
def test_non_finite_gradient_raises_and_leaves_the_server_state(mode):
    kv, rng = _warm_store(mode)
    before = _snapshot(kv)
    g, c = _nan_grads(rng)
    with pytest.raises(FloatingPointError, match="'fc'.*1 of 256"):
        kv.pushpull("fc", mx.nd.array(g))
    with pytest.raises(FloatingPointError, match="'conv'.*1 of 216"):
        kv.pushpull("conv", mx.nd.array(c))
    after = _snapshot(kv)
    for n in ["fc", "conv"]:
        np.testing.assert_array_equal(after[1][n], before[1][n], err_msg=n)
        assert np.isfinite(after[0][n]).all()
    assert after[2:] == before[2:]                      # thresholds
    stats = kv.stats()["layers"]
    assert stats["fc"]["steps"] == stats["conv"]["steps"] == 3


def test_non_finite_gradient_leaves_the_worker_residual():
    kv, rng = _warm_store("layer")
    before = _snapshot(kv)
    g, c = _nan_grads(rng)
    with pytest.raises(FloatingPointError):
        kv.pushpull("fc", mx.nd.array(g))
    with pytest.raises(FloatingPointError):
        kv.pushpull("conv", mx.nd.array(c))
    after = _snapshot(kv)
    for n in ["fc", "conv"]:
        # restored arithmetically: to within float32 rounding of |gradient + residual|
        np.testing.assert_allclose(after[0][n], before[0][n], rtol=0, atol=2e-6, err_msg=n)


def test_bytes_pulled():
    rng = np.random.RandomState(19)
    steps = 5
    kv = mxhylo.create(size_threshold=300, conv_rate=0.1, compress_pull="layer")
    _run_steps(kv, rng, steps)
    layers = kv.stats()["layers"]
    fc, conv, odd = layers["fc"], layers["conv"], layers["fc_odd"]
    assert fc["bytes_pulled"] == steps * (4 * math.ceil(64 * 48 / 16) + 4)
    assert odd["bytes_pulled"] == steps * (4 * math.ceil(7 * 333 / 16) + 4)
    k = kv.plans()["conv"].k
    assert k == 2
    assert conv["bytes_pulled"] == steps * (4 * k + 4 * k * 8 * 9)
    assert layers["bias"]["bytes_pulled"] == layers["bias"]["dense_bytes"] == steps * 4 * 48
    for name in ("fc", "conv", "fc_odd"):
        assert layers[name]["bytes_pulled"] * 7 < layers[name]["dense_bytes"], name
    total = kv.stats()
    assert total["bytes_pulled"] == sum(e["bytes_pulled"] for e in layers.values())
    assert total["bytes_pulled"] * 5 < total["dense_bytes"]
    two = mxhylo.create(size_threshold=300, conv_rate=0.1, compress_pull="2bit")
    _run_steps(two, np.random.RandomState(19), steps)
    conv2 = two.stats()["layers"]["conv"]
    assert conv2["bytes_pulled"] == steps * (4 * math.ceil(16 * 8 * 9 / 16) + 4)
    off = mxhylo.create(size_threshold=300, conv_rate=0.1)
    _run_steps(off, np.random.RandomState(19), steps)
    stats = off.stats()
    assert stats["bytes_pulled"] == stats["dense_bytes"]


@pytest.mark.parametrize("mode", ["layer", "2bit"])
def test_checkpoint_restores_server_residuals_bitwise(tmp_path, mode):
    opts = dict(size_threshold=300, conv_rate=0.1, compress_pull=mode)
    rng = np.random.RandomState(20)
    kv = mxhylo.create(**opts)
    _run_steps(kv, rng, 4)
    ckpt = str(tmp_path / "ckpt")
    kv.save_residuals(ckpt)
    saved = mx.nd.load(ckpt)
    for name in ("fc", "conv", "fc_odd"):
        np.testing.assert_array_equal(saved["server_residual/" + name].asnumpy(),
                                      _server_residual(kv, name))
    assert "server_residual/bias" not in saved
    state = rng.get_state()
    cont = _run_steps(kv, rng, 3)
    fresh = mxhylo.create(**opts)
    fresh.load_residuals(ckpt)
    rng.set_state(state)
    resumed = _run_steps(fresh, rng, 3)
    for (_, a), (_, b) in zip(cont, resumed):
        for name in LAYERS:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for name in ("fc", "conv", "fc_odd"):
        np.testing.assert_array_equal(_server_residual(fresh, name), _server_residual(kv, name))
    # the servers' part of the checkpoint matters: without it the continuation differs
    worker_only = {k: v for k, v in saved.items() if not k.startswith("server_")}
    mx.nd.save(str(tmp_path / "worker_only"), worker_only)
    partial = mxhylo.create(**opts)
    partial.load_residuals(str(tmp_path / "worker_only"))
    rng.set_state(state)
    other = _run_steps(partial, rng, 1)
    assert not np.array_equal(other[0][1]["fc"], cont[0][1]["fc"])
    assert not np.array_equal(other[0][1]["fc_odd"], cont[0][1]["fc_odd"])
    if mode == "2bit":
        assert not np.array_equal(other[0][1]["conv"], cont[0][1]["conv"])


def test_compressed_pull_checkpoint_needs_compress_pull(tmp_path):
    kv, _ = _warm_store("layer")
    kv.save_residuals(str(tmp_path / "ckpt"))
    off = mxhylo.create(size_threshold=10, conv_rate=0.25)
    with pytest.raises(ValueError, match="compress_pull"):
        off.load_residuals(str(tmp_path / "ckpt"))
    assert off.memory.names() == []                     # nothing half-loaded
    # a checkpoint without compressed pull loads into a compressed-pull store
    plain = mxhylo.create(size_threshold=10, conv_rate=0.25)
    plain.pushpull("fc", mx.nd.ones((16, 16)))
    plain.save_residuals(str(tmp_path / "plain"))
    mxhylo.create(size_threshold=10, compress_pull=True).load_residuals(str(tmp_path / "plain"))


def test_rollback_to_an_earlier_checkpoint_resets_server_residuals(tmp_path):
    opts = dict(size_threshold=10, compress_pull="layer")
    g = [np.random.RandomState(21).randn(16, 16).astype(np.float32) for _ in range(4)]
    kv = mxhylo.create(**opts)
    kv.save_residuals(str(tmp_path / "start"))          # before any step
    for a in g[:3]:
        kv.pushpull("fc", mx.nd.array(a))
    kv.load_residuals(str(tmp_path / "start"))
    x, y = mx.nd.array(g[3]), mx.nd.array(g[3])
    kv.pushpull("fc", x)
    mxhylo.create(**opts).pushpull("fc", y)
    np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())


# -- 4. over real parameter servers: 2 workers, 2 servers ---------------------------------

def launch_keys_worker(tmp_path, mode, timeout=120):
    out = str(tmp_path / (mode.replace(":", "_") + "-{rank}.json"))
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout",
           str(timeout), sys.executable, os.path.join(ROOT, "tests", "dist_keys_worker.py"),
           mode, out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    return proc, out


# what dist_keys_worker.py's compressed_pull() trains and how it cuts layers
DIST_SHAPES = {"conv": (64, 16, 3, 3), "fc": (96, 200), "fc_odd": (50, 333),
               "bias": (10,), "conv_small": (8, 4, 1, 1)}
DIST_COMPRESSED = ("conv", "fc", "fc_odd")
DIST_POLICY = {"^conv$": "conv_topk"}       # the rule would send 'conv' 2-bit


# sha256 of rank 0's results (dist_keys_worker.py pull:MODE: every output, the sums, the
# checkpoint with the servers' state), first recorded on 2026-11-23 before the wire
# layouts moved into kvstore/wire.py (issue 14), so that a refactor of the exchange that
# changes one bit fails here; recorded again when fc_2bit began to send the mean sent
# |a| instead of the threshold (issue 16). The inputs are seeded numpy draws and every operator is
# bitwise the same at every ISA level (tests/test_ops.py), so the digest does not
# depend on the CPU. A deliberate change of the arithmetic records new digests.
RECORDED_DIGESTS = {
    "layer": "f9b2d78dd7cbcfcb8eb8a3a52a0b5e76469e532bea4f646bc2fb05556f92da95",
    "2bit": "969fe6ba58ad15d1220ca0dab9d917e242994eb0e759045a83f8f163530a759f",
    # the gather pull is bitwise the dense pull, and neither keeps server state
    "gather": "9fc69e753a64d45f1e126a75cb74fee73bde5e3dc0ea88e0068daa34f6a2d097",
    "off": "9fc69e753a64d45f1e126a75cb74fee73bde5e3dc0ea88e0068daa34f6a2d097"}


def results_digest(arrays):
    """sha256 (hex) of a dict of numpy arrays: names, dtypes, shapes and bytes."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(("%s|%s|%s|" % (name, a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def assert_recorded_digest(mode, arrays):
    digest = results_digest(arrays)
    assert digest == RECORDED_DIGESTS[mode], (
        "pull:%s results changed bitwise: digest %s, recorded %s"
        % (mode, digest, RECORDED_DIGESTS[mode]))


@pytest.mark.parametrize("mode", ["layer", "2bit"])
def test_distributed_compressed_pull(tmp_path, mode):
    proc, out = launch_keys_worker(tmp_path, "pull:" + mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.load(open(out.format(rank=r))) for r in range(2)]
    arrays = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    # the checkpoint restored the servers' residuals exactly: the same two steps again
    assert all(r["resumed"] for r in reports), reports
    a, b = arrays
    assert_recorded_digest(mode, a)
    for name in DIST_SHAPES:
        np.testing.assert_array_equal(a["got/" + name], b["got/" + name], err_msg=name)
        np.testing.assert_array_equal(a["last/" + name], b["last/" + name], err_msg=name)
        assert not np.array_equal(a["sent/" + name], b["sent/" + name])
    # the servers' state is the same in both workers' checkpoints, and only compressed
    # layers have one
    server_keys = sorted(k for k in a if k.startswith("state/server_"))
    assert server_keys == sorted(k for k in b if k.startswith("state/server_"))
    assert server_keys == sorted("state/server_%s/%s" % (f, n) for n in DIST_COMPRESSED
                                 for f in ("residual", "thresholds"))
    for key in server_keys:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # conservation: what the workers sent is what came back plus what every loop kept
    for name in DIST_SHAPES:
        sent = a["sent/" + name] + b["sent/" + name]
        total = a["got/" + name].astype(np.float64)
        for w in arrays:
            total = total + w.get("state/residual/" + name, 0)
        if name in DIST_COMPRESSED:
            server = a["state/server_residual/" + name]
            assert np.abs(server).max() > 0, name
            total = total + server
        np.testing.assert_allclose(total, sent, rtol=0, atol=1e-6, err_msg=name)
    # what came back is really compressed, chunk by chunk as the servers encode it
    policy = LayerPolicy(policy=DIST_POLICY)
    for name in DIST_COMPRESSED:
        plan = policy.plan(name, DIST_SHAPES[name])
        chunks = plan_chunks(plan.strategy, plan.shape, 2, 2, 4096, 8192,
                             pull=pull_codec(plan.strategy, mode), pull_rate=plan.rate)
        assert all(c.pull != "none" for c in chunks), (name, chunks)
        flat = a["last/" + name].reshape(-1)
        for c in chunks:
            piece = flat[c.offset:c.offset + c.size]
            if c.pull == "fc_2bit":
                assert len(np.unique(np.abs(piece[piece != 0]))) <= 1, (name, c)
            else:
                rows = np.abs(piece.reshape(-1, c.cols)).sum(1)
                assert 0 < (rows > 0).sum() <= c.pull_k, (name, c)
    # traffic: the pull is about as small as the push, far below dense
    for r in reports:
        assert r["bytes_pulled"] < 1.2 * r["bytes_pushed"], r
        assert r["bytes_pulled"] < 0.4 * r["dense_bytes"], r
    assert reports[0]["bytes_pulled"] == reports[1]["bytes_pulled"]


def test_gather_pull_equals_the_dense_pull_bitwise(tmp_path):
    """'gather' returns the workers' payloads as the server summed them: what every
    worker decodes is bitwise the dense pull's aggregate, and no server keeps state."""
    runs = {}
    for mode in ("gather", "off"):
        proc, out = launch_keys_worker(tmp_path, "pull:" + mode)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[mode] = ([dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)],
                      [json.load(open(out.format(rank=r))) for r in range(2)])
    (gather, g_reports), (dense, d_reports) = runs["gather"], runs["off"]
    assert_recorded_digest("gather", gather[0])
    assert_recorded_digest("off", dense[0])
    for name in DIST_SHAPES:
        for key in ("got/", "last/"):
            np.testing.assert_array_equal(gather[0][key + name], dense[0][key + name],
                                          err_msg=key + name)
            np.testing.assert_array_equal(gather[1][key + name], gather[0][key + name],
                                          err_msg=key + name)
    assert not any(k.startswith("state/server_") for k in gather[0])
    assert all(r["resumed"] for r in g_reports)
    for g, d in zip(g_reports, d_reports):
        # the same payloads (cut into chunks a little differently: placeholders differ)
        assert abs(g["bytes_pushed"] - d["bytes_pushed"]) < 0.01 * d["bytes_pushed"]
        # two workers' payloads come back: about twice the push, well under dense
        assert g["bytes_pulled"] < 2.5 * g["bytes_pushed"], g
        assert g["bytes_pulled"] < 0.6 * d["bytes_pulled"], (g, d)


def test_gather_layout_round_trip():
    """gather_values (server) and gather_payloads (workers) carry every worker's filters
    and 2-bit slots exactly, padding and all."""
    from mxhylo.kvstore.wire import gather_payloads, gather_values
    conv = plan_chunks("conv_topk", (12, 3, 3, 3), 3, pull="gather", pull_rate=0.2,
                       push_k=2)[0]
    assert conv.pull == "gather" and conv.pull_k == 6
    rows = np.arange(4, dtype=np.int64) * 3          # filters 0, 3, 6, 9 were sent
    data = np.random.RandomState(0).normal(size=(4, 27)).astype(np.float32)
    received = mx.nd.sparse.row_sparse_array((data, rows), shape=conv.key_shape)
    values = gather_values(conv, received)
    assert values.size == conv.pull_rows * conv.cols
    (payload,) = gather_payloads(conv, values)
    np.testing.assert_array_equal(payload.arrays[0].asnumpy(), rows)
    np.testing.assert_array_equal(payload.arrays[1].asnumpy(), data)
    # as the workers read it: from the pulled NDArray, the filters' values a view of it
    pulled = mx.nd.array(values)
    (payload,) = gather_payloads(conv, pulled)
    np.testing.assert_array_equal(payload.arrays[0].asnumpy(), rows)
    np.testing.assert_array_equal(payload.arrays[1].asnumpy(), data)
    pulled[:] = 0
    assert not payload.arrays[1].asnumpy().any()
    empty = np.zeros_like(values)                         # no worker sent a filter here
    assert gather_payloads(conv, empty) == [] == gather_payloads(conv, mx.nd.array(empty))
    fc = plan_chunks("fc_2bit", (200, 100), 3, pull="gather")[0]
    assert fc.pull == "gather" and fc.slots == 3
    from mxhylo.kvstore.wire import pack_bytes
    n_bytes = 4 * -(-fc.size // 16)                      # the int32 code words
    rng = np.random.RandomState(1)
    sent = [rng.randint(0, 256, n_bytes).astype(np.uint8) for _ in range(fc.slots)]
    slots = np.zeros((fc.slots, fc.slot_rows * fc.cols), np.float32)
    for w, (threshold, data) in enumerate(zip([0.5, 0.25, 0.125], sent)):
        packed = pack_bytes(data)
        slots[w, 0] = threshold                           # each worker's threshold
        slots[w, 1:1 + len(packed)] = packed
    slots = slots.reshape(-1, fc.cols)
    received = mx.nd.sparse.row_sparse_array(
        (slots, np.arange(len(slots), dtype=np.int64)), shape=fc.key_shape)
    for values in (gather_values(fc, received).asnumpy().reshape(-1),
                   gather_values(fc, received).reshape((-1,))):
        payloads = gather_payloads(fc, values)
        assert [p.scalars[0] for p in payloads] == [0.5, 0.25, 0.125]
        for p, data in zip(payloads, sent):
            np.testing.assert_array_equal(p.arrays[0].asnumpy().view(np.uint8), data)


def test_default_compresses_the_pull_only_over_the_parameter_server():
    assert compress_pull_mode("auto", distributed=True) == "gather"
    assert compress_pull_mode("auto", distributed=False) is None
    kv = mxhylo.create()                      # in one process: nothing to save
    assert kv.compress_pull is None and kv.stats()["options"]["compress_pull"] is None
    assert mxhylo.create(compress_pull="2bit").compress_pull == "2bit"
