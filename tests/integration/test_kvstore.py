"""The in-process hylo kvstore: MXNet's KVStoreBase contract, codec path, stats, checkpoints."""
import math

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mxhylo
from mxhylo.kvstore import DistSyncHylo, Hylo

CTX2 = [mx.cpu(0), mx.cpu(1)]



@pytest.fixture(autouse=True)
def _compress_from_the_first_step(monkeypatch):
    """These tests check the codecs step by step: no warm-up (dense first steps)."""
    monkeypatch.setattr("mxhylo.kvstore.options.DEFAULT_WARMUP_STEPS", 0)

def nd(a, ctx=mx.cpu(0)):
    return mx.nd.array(a, ctx=ctx, dtype=a.dtype)


def test_registration_and_contract():
    kv = mx.kv.create("hylo")
    assert isinstance(kv, Hylo) and kv.type == "hylo"
    assert mx.kv.create("dist_sync_hylo").type == "dist_sync_hylo"
    assert isinstance(mx.kv.create("DIST_SYNC_HYLO"), DistSyncHylo)
    assert mx.kvstore.KVStoreBase.kv_registry["hylo"] is Hylo
    assert Hylo.is_capable("optimizer") is False                # answered on the class
    assert kv.rank == 0 and kv.num_workers == 1
    with pytest.raises(NotImplementedError):
        kv.set_optimizer(mx.optimizer.SGD())
    with pytest.raises(NotImplementedError):
        kv.save_optimizer_states("x")
    with pytest.raises(NotImplementedError):
        kv.load_optimizer_states("x")
    with pytest.raises(ValueError, match="type must be"):
        mxhylo.create(type="hyl0")
    opts = mxhylo.create(size_threshold=100, conv_rate=0.25).stats()["options"]
    assert opts["size_threshold"] == 100 and opts["conv_rate"] == 0.25


def test_pushpull_uncompressed_sums_devices_single_and_list_keys():
    rng = np.random.RandomState(0)
    kv = mxhylo.create(policy={".*": "none"})
    a = [nd(rng.randn(3, 4).astype(np.float32), c) for c in CTX2]
    kv.broadcast(3, a[0], out=a)
    np.testing.assert_array_equal(a[1].asnumpy(), a[0].asnumpy())
    a[1][:] = rng.randn(3, 4)
    expect = a[0].asnumpy() + a[1].asnumpy()
    kv.pushpull(3, a)                                             # out=None: in place
    for x in a:
        np.testing.assert_array_equal(x.asnumpy(), expect)
    # list of str keys, out given
    vals = [[nd(rng.randn(5).astype(np.float32), c) for c in CTX2] for _ in range(2)]
    outs = [[mx.nd.zeros(5, ctx=c) for c in CTX2] for _ in range(2)]
    kv.pushpull(["w", "b"], vals, out=outs)
    for v, o in zip(vals, outs):
        for x in o:
            np.testing.assert_array_equal(x.asnumpy(), v[0].asnumpy() + v[1].asnumpy())


def test_outputs_aliasing_inputs_and_each_other():
    """Every reduction happens before any write: swapping outputs must not corrupt."""
    kv = mxhylo.create(policy={".*": "none"})
    a, b = nd(np.arange(4, dtype=np.float32)), nd(np.arange(4, 8, dtype=np.float32))
    a0, b0 = a.asnumpy(), b.asnumpy()
    kv.pushpull(["a", "b"], [a, b], out=[b, a])
    np.testing.assert_array_equal(b.asnumpy(), a0)
    np.testing.assert_array_equal(a.asnumpy(), b0)
    # compressed keys too
    kv = mxhylo.create(size_threshold=1, conv_rate=1.0)
    rng = np.random.RandomState(1)
    c = nd(rng.randn(4, 2, 3, 3).astype(np.float32))
    d = nd(rng.randn(4, 2, 3, 3).astype(np.float32))
    c0, d0 = c.asnumpy(), d.asnumpy()
    kv.pushpull(["c", "d"], [c, d], out=[[d, c], [c]])           # conv_rate 1: lossless
    np.testing.assert_array_equal(c.asnumpy(), d0)
    np.testing.assert_array_equal(d.asnumpy(), c0)


def _np_2bit(a, t):
    """(sent, residual): +-v where |a| >= t, v = the mean |a| of those elements."""
    sent = np.abs(a) >= t
    v = np.float32(np.abs(a[sent]).astype(np.float64).mean()) if sent.any() else t
    q = np.where(a >= t, v, np.where(a <= -t, -v, 0)).astype(np.float32)
    return q, (a - q).astype(np.float32)


def _np_bound_rows(r, u, wait=1.0):
    """kvstore.stages.BoundedResidual in numpy: each row of r at most ``wait`` times the
    norm of u's row (wait: the layer's mean wait, stages.mean_wait)."""
    rows = r.shape[0]
    held = np.sqrt((r.reshape(rows, -1).astype(np.float64) ** 2).sum(1))
    allowed = wait * np.sqrt((u.reshape(rows, -1).astype(np.float64) ** 2).sum(1))
    scale = np.minimum(allowed / np.maximum(held, np.finfo(np.float32).tiny), 1.0)
    return (r.reshape(rows, -1) * scale[:, None]).reshape(r.shape).astype(np.float32)


def test_fc_2bit_path_matches_numpy_error_feedback_and_threshold():
    """Two devices reduce, then 2-bit with residual, each residual row bounded by its
    row of the input; threshold lags one step (mean |a|)."""
    rng = np.random.RandomState(2)
    kv = mxhylo.create(size_threshold=10)
    shape = (20, 33)                                               # 660: not a multiple of 16
    r = np.zeros(shape, np.float32)
    t = None
    for step in range(4):
        g = [rng.randn(*shape).astype(np.float32) * 0.01 for _ in CTX2]
        arrs = [nd(x, c) for x, c in zip(g, CTX2)]
        a = (g[0] + g[1]) + r
        if t is None:
            t = np.float32(np.abs(a).mean())
        q, r = _np_2bit(a, np.float32(t))
        r = _np_bound_rows(r, g[0] + g[1])
        kv.pushpull("fc", arrs)
        for x in arrs:
            np.testing.assert_allclose(x.asnumpy(), q, rtol=1e-5, atol=0)
        t = np.float32(np.abs(a).mean())                            # next step's threshold
    layer = kv.stats()["layers"]["fc"]
    assert layer["policy"] == "fc_2bit"
    assert layer["last_bytes"] == 4 * math.ceil(660 / 16) + 4      # codes + value
    assert layer["ratio"] == pytest.approx(660 * 4 / (4 * 42 + 4))


def test_conv_topk_path_matches_numpy():
    rng = np.random.RandomState(3)
    kv = mxhylo.create(size_threshold=10, conv_rate=0.25)
    shape = (8, 3, 3, 3)
    r = np.zeros(shape, np.float32)
    for step in range(3):
        g = rng.randn(*shape).astype(np.float32)
        a = g + r
        norms = np.sqrt((a.reshape(8, -1).astype(np.float64) ** 2).sum(1))
        top = np.sort(np.argsort(-norms, kind="stable")[:2])
        sent = np.zeros_like(a)
        sent[top] = a[top]
        r = _np_bound_rows(a - sent, g, wait=8 / 2)         # 2 of 8 filters a step
        x = nd(g)
        kv.pushpull("conv", x)
        # (the bound's norms round differently in numpy: equal to float32 rounding)
        np.testing.assert_allclose(x.asnumpy(), sent, rtol=1e-5, atol=1e-7)
    layer = kv.stats()["layers"]["conv"]
    assert layer["policy"] == "conv_topk" and layer["k"] == 2
    assert layer["last_bytes"] == 2 * 4 + 2 * 27 * 4


def test_fp16_gradients_and_outputs():
    rng = np.random.RandomState(4)
    kv = mxhylo.create(size_threshold=10)
    g = rng.randn(16, 16).astype(np.float16)
    x = nd(g)
    kv.pushpull("fc16", x)
    assert x.dtype == np.float16
    a = g.astype(np.float32)
    q, _ = _np_2bit(a, np.float32(np.abs(a).mean()))
    np.testing.assert_allclose(x.asnumpy().astype(np.float32), q, rtol=1e-3)


def test_non_finite_gradient_names_the_layer():
    kv = mxhylo.create(size_threshold=10)
    g = np.ones((8, 8), np.float32)
    g[3, 4] = np.nan
    with pytest.raises(FloatingPointError, match="'fc_bad'.*1 of 64"):
        kv.pushpull("fc_bad", nd(g))
    c = np.ones((4, 2, 3, 3), np.float32)
    c[0, 0, 0, 0] = np.inf
    with pytest.raises(FloatingPointError, match="'conv_bad'"):
        kv.pushpull("conv_bad", nd(c))
    # the residual did not absorb the NaN
    assert np.isfinite(kv.memory.residual("fc_bad", nd(g)).asnumpy()).all()


def test_key_shape_change_is_an_error():
    kv = mxhylo.create()
    kv.pushpull(0, mx.nd.ones((3,)))
    with pytest.raises(ValueError, match="first used with shape"):
        kv.pushpull(0, mx.nd.ones((4,)))


def _gradient_stream(steps, seed=5):
    rng = np.random.RandomState(seed)
    return [(rng.randn(64, 64).astype(np.float32), rng.randn(16, 8, 3, 3).astype(np.float32))
            for _ in range(steps)]


def _exchange(kv, grads):
    outs = []
    for g, h in grads:
        g, h = nd(g), nd(h)
        kv.pushpull(["fc", "conv"], [g, h])
        outs.append((g.asnumpy(), h.asnumpy()))
    return outs


def test_residual_checkpoint_resumes_exactly(tmp_path):
    opts = dict(size_threshold=10, conv_rate=0.25)
    stream = _gradient_stream(6)
    full = _exchange(mxhylo.create(**opts), stream)
    kv = mxhylo.create(**opts)
    _exchange(kv, stream[:3])
    kv.save_residuals(str(tmp_path / "res"))
    resumed = mxhylo.create(**opts)
    resumed.load_residuals(str(tmp_path / "res"))
    rest = _exchange(resumed, stream[3:])
    for (g0, h0), (g1, h1) in zip(full[3:], rest):
        np.testing.assert_array_equal(g0, g1)
        np.testing.assert_array_equal(h0, h1)
    # without the residuals the continuation differs: the test can fail
    fresh = _exchange(mxhylo.create(**opts), stream[3:])
    assert not np.array_equal(fresh[0][0], full[3][0])


def test_trainer_names_from_gluon_and_policy_regex():
    net = gluon.nn.Dense(4, in_units=4096)
    net.initialize(ctx=CTX2)
    kv = mxhylo.create(policy={"bias": "none"})
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    with mx.autograd.record():
        losses = [net(mx.nd.ones((2, 4096), ctx=c)).sum() for c in CTX2]
    mx.autograd.backward(losses)
    trainer.step(4)
    layers = kv.stats()["layers"]
    assert set(layers) == {net.weight.name, net.bias.name}
    assert layers[net.weight.name]["policy"] == "fc_2bit"


def test_trainer_step_exchanges_last_layer_first_and_order_changes_no_value(monkeypatch):
    """The Trainer's step reaches the transport last layer first (the order backward
    mostly produces gradients) with overlap off, and every layer once, in the order
    they were written, with it on; the same keys exchanged first layer first give
    bitwise the same outputs, residuals included, over several compressed steps."""
    for overlap in (False, True):
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(32, 3, in_channels=16),
                gluon.nn.Dense(64, in_units=32 * 36), gluon.nn.Dense(10, in_units=64))
        net.initialize(ctx=CTX2)
        monkeypatch.setattr("mxhylo.kvstore.hylo.OVERLAP", overlap)   # read by create
        kv = mxhylo.create(warmup_steps=0)
        seen = []
        exchange = kv.transport.exchange

        def recording(*args, exchange=exchange, seen=seen):
            items = list(args[-1])          # (the transport's items come last)
            seen.append([layer.plan.name for layer, _, _ in items])
            return exchange(*args[:-1], items)
        kv.transport.exchange = recording
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=kv)
        with mx.autograd.record():
            losses = [net(mx.nd.ones((2, 16, 8, 8), ctx=c)).sum() for c in CTX2]
        mx.autograd.backward(losses)
        trainer.step(4)
        names = [p.name for p in trainer._params]        # the Trainer's key order
        assert names[0] in (net[0].weight.name, net[0].bias.name)
        if overlap:
            assert len(seen) == 1 and sorted(seen[0]) == sorted(names), seen
        else:
            assert seen == [names[::-1]]

    rng = np.random.RandomState(3)
    # (the conv named top-k so that every codec takes part)
    shapes = {"conv": (256, 32, 3, 3), "fc": (64, 1152), "bias": (64,), "out": (10, 64)}
    keys = sorted(shapes)
    steps = [[rng.normal(0, 1, shapes[k]).astype(np.float32) for k in keys] for _ in range(4)]
    forward, backward = [mxhylo.create(warmup_steps=0, policy={"^conv$": "conv_topk"})
                         for _ in range(2)]
    for grads in steps:
        a = [mx.nd.array(g) for g in grads]
        b = [mx.nd.array(g) for g in grads][::-1]
        forward.pushpull(keys, a)
        backward.pushpull(keys[::-1], b)
        for x, y, k in zip(a, b[::-1], keys):
            np.testing.assert_array_equal(x.asnumpy(), y.asnumpy(), err_msg=k)
    policies = {p.strategy for p in forward.plans().values()}
    assert policies == {"none", "conv_topk", "fc_2bit"}      # every codec took part


def test_trainer_hook_names_keys_before_the_first_step_and_leaves_other_stores():
    """kvstore.trainer_hook: a plain gluon.Trainer given a hylo store attaches it when
    Gluon creates the store, so even the parameters' broadcast uses their names; each
    step is one exchange_step; a Trainer with another store runs Gluon's own loop.
    (Sparse gradients: Gluon itself refuses a KVStoreBase store for them.)"""
    net = gluon.nn.Dense(4, in_units=4096)
    net.initialize(ctx=CTX2)
    kv = mxhylo.create(warmup_steps=0)
    steps = []
    exchange_step = kv.exchange_step
    kv.exchange_step = lambda trainer: (steps.append(trainer), exchange_step(trainer))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    trainer._init_kvstore()
    trainer._init_params()                  # the broadcast, before any step
    assert set(kv.plans()) == {net.weight.name, net.bias.name}
    for _ in range(2):
        with mx.autograd.record():
            losses = [net(mx.nd.ones((2, 4096), ctx=c)).sum() for c in CTX2]
        mx.autograd.backward(losses)
        trainer.step(4)
    assert steps == [trainer, trainer]
    del kv.exchange_step                    # the instance attribute set above

    other = gluon.nn.Dense(4, in_units=8)
    other.initialize(ctx=CTX2)
    native = gluon.Trainer(other.collect_params(), "sgd", {"learning_rate": 0.1},
                           kvstore="device")
    with mx.autograd.record():
        losses = [other(mx.nd.ones((2, 8), ctx=c)).sum() for c in CTX2]
    mx.autograd.backward(losses)
    native.step(4)                          # Gluon's own loop: the device store sums
    grads = other.weight.list_grad()
    np.testing.assert_array_equal(grads[0].asnumpy(), grads[1].asnumpy())


class _RecordingDistStore(mx.kv.KVStoreBase):
    """A distributed-looking store that logs broadcasts and pushpulls (no network)."""

    def __init__(self, kv_type, log):
        self._type, self.log = kv_type, log

    @property
    def type(self):
        return self._type

    @property
    def rank(self):
        return 1

    @property
    def num_workers(self):
        return 2

    def is_capable(self, capability):
        return False

    def broadcast(self, key, value, out, priority=0):
        self.log.append(("broadcast", key))
        for o in (out if isinstance(out, list) else [out]):
            if o is not value:
                value.copyto(o)

    def pushpull(self, key, value, out=None, priority=0):
        self.log.append(("pushpull", key))

    def set_optimizer(self, optimizer):
        raise NotImplementedError

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError

    def load_optimizer_states(self, fname):
        raise NotImplementedError


@pytest.mark.parametrize("kv_type", ["dist_sync", "local"])
def test_trainer_hook_waits_for_the_broadcast_before_the_first_pushpull(monkeypatch, kv_type):
    """kvstore.trainer_hook: on a distributed store the parameters Trainer._init_params
    broadcast are waited for before the first step's pushpull (MXNet 1.9.1's dist store
    may otherwise send that pushpull before the broadcast's pull: a worker then trains
    on the summed gradient as weights). A local store is left as Gluon runs it."""
    log = []
    waited = mx.nd.NDArray.wait_to_read
    monkeypatch.setattr(mx.nd.NDArray, "wait_to_read",
                        lambda self: (log.append(("wait", self.handle.value)), waited(self)))
    net = gluon.nn.Dense(3, in_units=5)
    net.initialize(ctx=CTX2)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore=_RecordingDistStore(kv_type, log),
                            update_on_kvstore=False)
    with mx.autograd.record():
        losses = [net(mx.nd.ones((2, 5), ctx=c)).sum() for c in CTX2]
    mx.autograd.backward(losses)
    trainer.step(4)
    first_pushpull = log.index(next(e for e in log if e[0] == "pushpull"))
    waits = {h for kind, h in log[:first_pushpull] if kind == "wait"}
    arrays = {a.handle.value for p in (net.weight, net.bias) for a in p.list_data()}
    assert [e for e in log[:first_pushpull] if e[0] == "broadcast"] == \
        [("broadcast", 0), ("broadcast", 1)]
    if kv_type == "local":
        assert not arrays & waits
    else:
        assert arrays <= waits, "the broadcast parameters were not waited for"


def test_trainer_with_compression_off_equals_device_kvstore():
    """policy {'.*': 'none'}: hylo trains exactly like MXNet's 'device' kvstore."""
    from mxhylo.digits import train
    ref = train(kvstore="device", contexts=CTX2, epochs=2, seed=7)
    off = train(kvstore=mxhylo.create(policy={".*": "none"}), contexts=CTX2, epochs=2, seed=7)
    # two nets in one process get different name counters: compare in layer order
    assert len(ref["params"]) == len(off["params"])
    for (name, a), b in zip(ref["params"].items(), off["params"].values()):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_default_compression_trains_digits_like_uncompressed():
    """2 contexts, same seed: accuracy within 1 point of 'device'; compressed layers >= 8x."""
    from mxhylo.digits import train
    dense = train(kvstore="device", contexts=CTX2, epochs=10, seed=0)
    kv = mxhylo.create()
    hylo = train(kvstore=kv, contexts=CTX2, epochs=10, seed=0)
    assert dense["accuracy"] > 0.95
    # Hylo's promise is an accuracy loss below 1 point (here it comes out 0.7 ahead)
    assert hylo["accuracy"] >= dense["accuracy"] - 0.01, (hylo["accuracy"], dense["accuracy"])
    stats = kv.stats()
    policies = {layer["policy"] for layer in stats["layers"].values()}
    assert policies == {"fc_2bit", "none"}
    # the second conv (9216 elements) would send 6 of its 64 filters: 2 bits cost no more
    assert [layer["policy"] for layer in stats["layers"].values()
            if tuple(layer["shape"]) == (64, 16, 3, 3)] == ["fc_2bit"]
    assert stats["compressed_layers_ratio"] >= 8
    for layer in stats["layers"].values():
        if layer["policy"] != "none":
            assert layer["ratio"] >= 8, layer


def test_empty_residual_checkpoint_round_trips(tmp_path):
    kv = mxhylo.create(policy={".*": "none"})
    kv.pushpull("a", mx.nd.ones((4,)))
    kv.save_residuals(str(tmp_path / "empty"))
    other = mxhylo.create()
    other.load_residuals(str(tmp_path / "empty"))
    assert other.memory.names() == []


def test_options_given_at_their_default_values_behave_as_the_defaults():
    """Only an option set to something other than its default fixes the plan (and with
    cost_model='auto' leaves the cost model out): size_threshold=8192, compress_pull
    'gather' over the parameter server, an empty policy are the defaults."""
    from mxhylo.kvstore.options import make_options
    from mxhylo.kvstore.policy import DEFAULT_SIZE_THRESHOLD

    def plan_options_given(policy, size_threshold, conv_rate, compress_pull, distributed):
        return list(make_options("ps" if distributed else "local", policy=policy,
                                 size_threshold=size_threshold, conv_rate=conv_rate,
                                 compress_pull=compress_pull).given)
    assert plan_options_given(None, None, None, "auto", True) == []
    assert plan_options_given({}, DEFAULT_SIZE_THRESHOLD, None, "gather", True) == []
    assert plan_options_given(None, None, None, False, False) == []   # in one process
    assert plan_options_given(None, 1024, None, "auto", True) == ["size_threshold"]
    assert plan_options_given({".*": "none"}, None, 0.05, False, True) == \
        ["policy", "conv_rate", "compress_pull"]
    # in one process every compressed pull is the dense one, the default there
    assert plan_options_given(None, None, None, "gather", False) == []
    assert plan_options_given(None, None, None, True, True) == []     # True: 'gather'
    assert plan_options_given(None, None, None, False, True) == ["compress_pull"]


# what a user of each removed option is told to do instead (a part of the message)
REMOVED = {"momentum_masking": "drop the option", "max_conv_rate": "conv_rate=",
           "min_conv_rate": "conv_rate=", "threshold_scale": "drop the option",
           "cost_recheck_steps": "cost_model=False", "cost_drift": "cost_model=False",
           "overlap": "drop the option", "chunk_elements": "drop the option",
           "bucket_bytes": "drop the option", "split_elements": "drop the option",
           "collective_timeout": "drop the option"}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_option_is_a_type_error_naming_its_replacement(name):
    from mxhylo.kvstore.options import REMOVED_OPTIONS
    assert set(REMOVED_OPTIONS) == set(REMOVED)
    for value in (True, 0, 1.5):
        with pytest.raises(TypeError) as err:
            mxhylo.create(**{name: value})
        message = str(err.value)
        assert name in message and REMOVED[name] in message, message
    with pytest.raises(TypeError, match=name):
        Hylo(**{name: 1})


def test_unknown_options_are_type_errors_naming_each():
    with pytest.raises(TypeError, match="nope: not an option of the hylo store"):
        mxhylo.create(nope=1)
    with pytest.raises(TypeError) as err:
        mxhylo.create("dist_sync_hylo", overlap=False, nope=1)
    message = str(err.value)
    assert "overlap" in message and "nope: not an option" in message, message


@pytest.mark.parametrize("value", ["layer", "2bit", "off"])
def test_a_removed_compressed_pull_is_a_value_error_naming_gather_and_false(value):
    from mxhylo.kvstore.policy import compress_pull_mode
    for distributed in (True, False):
        with pytest.raises(ValueError) as err:
            compress_pull_mode(value, distributed)
        message = str(err.value)
        assert repr(value) in message and "'gather'" in message and "False" in message, \
            message
    with pytest.raises(ValueError, match="compress_pull='gather'.* or False"):
        mxhylo.create(compress_pull=value)


def test_the_readme_options_table_is_the_one_in_kvstore_options():
    """The options table is written once (kvstore/options.py TABLE) and the README shows
    it as rendered; the store takes exactly those options."""
    import inspect
    import os
    from mxhylo.kvstore import options
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    shown = readme.split("<!-- options:")[1].split("-->", 1)[1].split("<!-- /options -->")[0]
    assert shown.strip() == options.table_markdown().strip()
    taken = [p for p in inspect.signature(options.make_options).parameters
             if p not in ("transport", "unknown")] + ["transport"]
    assert sorted(taken) == sorted(row[0] for row in options.TABLE)
    assert len(options.TABLE) <= 12
