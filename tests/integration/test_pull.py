"""The pull: how a compressed layer's aggregate comes back (compress_pull).

Over the parameter server 'gather' (the default, and what True means) returns the
workers' own payloads and every worker decodes them: bitwise the dense pull's
aggregate; False pulls the dense float32 aggregate. In one process every pull is the
dense aggregate; over Horovod the allgather returns every worker's payload whatever
compress_pull says.

Covered here: the option (kvstore.policy), the gather layout (kvstore.wire), the
in-process store against a numpy reference of the worker's error-feedback loop
(conservation, edges, float16, non-finite gradients). Over real parameter servers:
tests/distributed/test_pull_dist.py.
"""
import re

import mxnet as mx
import numpy as np
import pytest

import mxhylo
from mxhylo.kvstore import stages
from mxhylo.kvstore.policy import compress_pull_mode, pull_codec
from mxhylo.kvstore.wire import plan_chunks


@pytest.fixture(autouse=True)
def _compress_from_the_first_step(monkeypatch):
    """These tests check the codecs step by step: no warm-up (dense first steps)."""
    monkeypatch.setattr("mxhylo.kvstore.options.DEFAULT_WARMUP_STEPS", 0)


TINY = np.float32(np.finfo(np.float32).tiny)


# -- 1. the option ----------------------------------------------------------------------

@pytest.mark.parametrize("value,mode", [(False, None), (None, None), ("auto", "gather"),
                                        (True, "gather"), ("gather", "gather")])
def test_compress_pull_mode_normalises(value, mode):
    assert compress_pull_mode(value) == mode                    # over the parameter server
    assert compress_pull_mode(value, distributed=False) is None
    kv = mxhylo.create(compress_pull=value)                     # in one process: dense
    assert kv.options.compress_pull is None
    assert kv.stats()["options"]["compress_pull"] is None


@pytest.mark.parametrize("bad", ["yes", 3, "2-bit", "topk", 0.5, [True]])
def test_compress_pull_mode_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="compress_pull.*got " + re.escape(repr(bad))):
        compress_pull_mode(bad)
    with pytest.raises(ValueError, match="compress_pull"):
        mxhylo.create(compress_pull=bad)


def test_pull_codec_table():
    table = {("none", None): "none", ("conv_topk", None): "none", ("fc_2bit", None): "none",
             ("fp16", None): "none", ("none", "gather"): "none",
             ("conv_topk", "gather"): "gather", ("fc_2bit", "gather"): "gather",
             ("fp16", "gather"): "gather"}
    for (strategy, mode), codec in table.items():
        assert pull_codec(strategy, mode) == codec, (strategy, mode)


def test_default_compresses_the_pull_only_over_the_parameter_server():
    assert compress_pull_mode("auto", distributed=True) == "gather"
    assert compress_pull_mode("auto", distributed=False) is None
    kv = mxhylo.create()                      # in one process: nothing to save
    assert kv.options.compress_pull is None and kv.stats()["options"]["compress_pull"] is None
    assert mxhylo.create(compress_pull="gather").options.compress_pull is None


def test_plan_chunks_refuses_other_pulls_and_pulls_uncompressed_layers_dense():
    for pull in ("topk", "fc_2bit", "conv_topk"):
        with pytest.raises(ValueError, match="pull codec"):
            plan_chunks("fc_2bit", (64, 64), 2, pull=pull)
    assert all(c.pull == "none" for c in plan_chunks("none", (5000,), 2, pull="gather"))


# -- 2. the gather layout ---------------------------------------------------------------

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
    from mxhylo.ops.formats import pack_bytes
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


# -- 3. in one process: numpy reference of the worker's error-feedback loop -------------

def _threshold(a):
    """mean |a| as the codec takes it: float32, at least the smallest normal."""
    return max(np.float32(np.abs(a.astype(np.float64)).sum() / a.size), TINY)


def _bound_rows(r, u, wait=1.0):
    """kvstore.stages.BoundedResidual in numpy: (each row of r cut to ``wait`` times the
    norm of u's row, float64 what was cut away); wait: the layer's mean wait."""
    rows = r.shape[0] if r.ndim > 1 else 1
    held = np.sqrt((r.reshape(rows, -1).astype(np.float64) ** 2).sum(1))
    allowed = wait * np.sqrt((u.reshape(rows, -1).astype(np.float64) ** 2).sum(1))
    scale = np.minimum(allowed / np.maximum(held, np.finfo(np.float32).tiny), 1.0)
    kept = (r.reshape(rows, -1) * scale[:, None]).reshape(r.shape).astype(np.float32)
    return kept, r.astype(np.float64) - kept


class Ref2Bit:
    """One 2-bit error-feedback loop: t lags one step (the first step measures first);
    the elements with |a| >= t go as +-v, v the mean of their |a| (``used``); each row
    of the residual bounded by its row of g (``dropped``: what the bound cut, summed)."""

    def __init__(self, shape):
        self.r = np.zeros(shape, np.float32)
        self.t = None
        self.dropped = np.zeros(shape)

    def __call__(self, g):
        a = g.astype(np.float32) + self.r
        t = _threshold(a) if self.t is None else self.t
        sent = np.abs(a) >= t
        v = np.float32(np.abs(a[sent]).astype(np.float64).mean()) if sent.any() else t
        q = np.where(a >= t, v, np.where(a <= -t, -v, 0)).astype(np.float32)
        self.threshold_used, self.used = t, v
        self.r, dropped = _bound_rows((a - q).astype(np.float32), g.astype(np.float32))
        self.dropped += dropped
        self.t = _threshold(a)
        return q


class RefTopK:
    """One top-k error-feedback loop: k rows of largest L2 norm, ties to the lower index;
    each row of the residual bounded by O/k times its row of g (``dropped``, as
    Ref2Bit's)."""

    def __init__(self, shape, k):
        self.r = np.zeros(shape, np.float32)
        self.k = k
        self.dropped = np.zeros(shape)

    def __call__(self, g):
        a = g.astype(np.float32) + self.r
        norms = (a.reshape(len(a), -1).astype(np.float64) ** 2).sum(1)
        top = np.sort(np.argsort(-norms, kind="stable")[:self.k])
        sent = np.zeros_like(a)
        sent[top] = a[top]
        self.r, dropped = _bound_rows((a - sent).astype(np.float32), g.astype(np.float32),
                                      wait=len(a) / float(self.k))
        self.dropped += dropped
        return sent


def _ref(strategy, shape, k=None):
    return Ref2Bit(shape) if strategy == "fc_2bit" else RefTopK(shape, k)


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


def test_in_one_process_every_pull_is_the_dense_aggregate():
    for value in ("auto", True, "gather", False):
        kv = mxhylo.create(size_threshold=300, conv_rate=0.1, compress_pull=value)
        _run_steps(kv, np.random.RandomState(19), 5)
        stats = kv.stats()
        assert stats["bytes_pulled"] == stats["dense_bytes"], value
        assert stats["bytes_pushed"] * 5 < stats["dense_bytes"], value
        for name, layer in stats["layers"].items():
            assert layer["bytes_pulled"] == layer["dense_bytes"], (value, name)


def test_conservation_over_many_steps(monkeypatch):
    """Error feedback alone (the residual's bound off: tests/integration/test_bounded_residual.py is
    its own): sum of gradients == sum delivered + the worker's residual."""
    monkeypatch.setattr(stages, "ROW_BOUND", 1e30)     # off: (times a wait) above any row
    rng = np.random.RandomState(14)
    kv = mxhylo.create(size_threshold=300, conv_rate=0.1)
    history = _run_steps(kv, rng, 40)
    plans = kv.plans()
    assert {n: p.strategy for n, p in plans.items()} == {
        "fc": "fc_2bit", "conv": "conv_topk", "bias": "none", "fc_odd": "fc_2bit"}
    for name in LAYERS:
        sent = sum(g[name].astype(np.float64) for g, _ in history)
        got = sum(o[name].astype(np.float64) for _, o in history)
        kept = np.zeros(LAYERS[name])
        if plans[name].strategy != "none":
            kept = kv.memory.get(name).asnumpy().astype(np.float64)
            assert np.abs(kept).max() > 0, name
            last = history[-1][1][name]
            if plans[name].strategy == "fc_2bit":
                assert len(np.unique(np.abs(last))) <= 2, name        # {0, v}
            else:
                assert (np.abs(last.reshape(16, -1)).sum(1) > 0).sum() <= plans[name].k
        scale = np.abs(sent).max()
        np.testing.assert_allclose(got + kept, sent, rtol=0, atol=1e-5 * scale, err_msg=name)


def test_all_zero_gradients_then_tiny_threshold():
    """Zero steps send zeros and keep zero residuals; the next step's threshold is the
    one measured on zeros (the smallest normal float32)."""
    shapes = {"fc": (40, 40), "conv": (8, 4, 3, 3)}
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25)
    refs = {"fc": Ref2Bit(shapes["fc"]), "conv": RefTopK(shapes["conv"], 2)}
    rng = np.random.RandomState(15)
    for step in range(5):
        zero = step < 2
        g = {n: np.zeros(s, np.float32) if zero else rng.randn(*s).astype(np.float32)
             for n, s in shapes.items()}
        x = {n: mx.nd.array(a) for n, a in g.items()}
        kv.pushpull(["fc", "conv"], [x["fc"], x["conv"]])
        for n in shapes:
            want = refs[n](g[n])
            # (the bound's norms round differently in numpy: equal within float32)
            np.testing.assert_allclose(x[n].asnumpy(), want, rtol=1e-5, atol=1e-7)
            if zero:
                assert not x[n].asnumpy().any()
                assert not kv.memory.get(n).asnumpy().any()
        if step == 1:
            assert kv.memory.scalar("fc", "threshold") == float(TINY)
        if step == 2:       # the first real step: every element over +-tiny
            ref = refs["fc"]
            assert ref.threshold_used == TINY
            assert (x["fc"].asnumpy() != 0).all()
            np.testing.assert_allclose(np.abs(x["fc"].asnumpy()), ref.used, rtol=1e-6)
    assert np.abs(kv.memory.get("fc").asnumpy()).max() > 0.1


def test_tiny_and_odd_shapes():
    shapes = {"a": (1, 1), "b": (1, 17), "c": (1, 1, 1, 1), "d": (3, 1, 1, 1), "v": (5,),
              "e": (17, 1), "f": (2, 3, 1, 5)}
    kv = mxhylo.create(size_threshold=1, conv_rate=0.4, policy={"^v$": "fc_2bit"})
    rng = np.random.RandomState(16)
    history = _run_steps(kv, rng, 12, shapes=shapes, scale=1.0)
    plans = kv.plans()
    assert plans["v"].strategy == "fc_2bit" and plans["d"].strategy == "conv_topk"
    assert plans["c"].k == 1 and plans["d"].k == 1 and plans["f"].k == 1
    for name, shape in shapes.items():
        p = plans[name]
        ref = _ref(p.strategy, shape, p.k)
        for g, o in history:
            np.testing.assert_allclose(o[name], ref(g[name]), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        sent = sum(g[name].astype(np.float64) for g, _ in history)
        got = sum(o[name].astype(np.float64) for _, o in history)
        kept = kv.memory.get(name).asnumpy().astype(np.float64)
        # what was sent is delivered, kept, or cut by the residual's bound
        np.testing.assert_allclose(got + kept + ref.dropped, sent, rtol=0, atol=1e-5,
                                   err_msg=name)


def test_float16_gradients():
    rng = np.random.RandomState(17)
    shapes = {"fc": (32, 40), "conv": (8, 4, 3, 3)}
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25)
    refs = {"fc": Ref2Bit(shapes["fc"]), "conv": RefTopK(shapes["conv"], 2)}
    for step in range(4):
        g = {n: rng.randn(*s).astype(np.float16) for n, s in shapes.items()}
        x = {n: mx.nd.array(a, dtype=np.float16) for n, a in g.items()}
        kv.pushpull(["fc", "conv"], [x["fc"], x["conv"]])
        for n in shapes:
            assert x[n].dtype == np.float16
            want = refs[n](g[n].astype(np.float32))
            np.testing.assert_allclose(x[n].asnumpy().astype(np.float32),
                                       want.astype(np.float16).astype(np.float32),
                                       rtol=2e-3, atol=0, err_msg=n)
            np.testing.assert_allclose(kv.memory.get(n).asnumpy(), refs[n].r, rtol=0,
                                       atol=1e-5)


def _warm_store(steps=3):
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25)
    rng = np.random.RandomState(18)
    for _ in range(steps):
        kv.pushpull(["fc", "conv"], [mx.nd.array(rng.randn(16, 16)),
                                     mx.nd.array(rng.randn(8, 3, 3, 3))])
    return kv, rng


def _snapshot(kv):
    return ({n: kv.memory.get(n).asnumpy().copy() for n in ("fc", "conv")},
            kv.memory.scalar("fc", "threshold"))


def _nan_grads(rng):
    g = rng.randn(16, 16).astype(np.float32)
    g[2, 3] = np.nan
    c = rng.randn(8, 3, 3, 3).astype(np.float32)
    c[1, 0, 0, 0] = np.inf
    return g, c


def test_non_finite_gradient_raises_and_leaves_the_worker_state():
    kv, rng = _warm_store()
    before = _snapshot(kv)
    g, c = _nan_grads(rng)
    with pytest.raises(FloatingPointError, match="'fc'.*1 of 256"):
        kv.pushpull("fc", mx.nd.array(g))
    with pytest.raises(FloatingPointError, match="'conv'.*1 of 216"):
        kv.pushpull("conv", mx.nd.array(c))
    after = _snapshot(kv)
    for n in ["fc", "conv"]:
        # restored arithmetically: to within float32 rounding of |gradient + residual|
        np.testing.assert_allclose(after[0][n], before[0][n], rtol=0, atol=2e-6, err_msg=n)
        assert np.isfinite(after[0][n]).all()
    assert after[1] == before[1]                        # the 2-bit threshold
    stats = kv.stats()["layers"]
    assert stats["fc"]["steps"] == stats["conv"]["steps"] == 3
