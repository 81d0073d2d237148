"""LARSTrainer: the LARS formula, fp16 master weights, loss scaling, distributed
averaging, bit-for-bit resume, bf16 AMP. All on CPU, seconds each.

Toy parameters get exact, known gradients from a linear loss ``sum(w * c)``
(gradient ``c``, loss-scaled ``S * c``, exact in fp16 for a power-of-two ``S``),
so the trainer can be compared with an independent numpy LARS.
"""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon

import mxhylo.lars as lars
from mxhylo.lars import LARSTrainer, make_schedule
from mxhylo.loss_scale import DynamicLossScaler

TOY_SHAPES = [("fc0_weight", (6, 5)), ("fc0_bias", (6,)), ("bn0_gamma", (6,)),
              ("bn0_beta", (6,)), ("fc1_weight", (3, 6))]
TOY_EXCLUDED = {"fc0_bias", "bn0_gamma", "bn0_beta"}


# ---- helpers ---------------------------------------------------------------------
def toy_params(dtype, seed=0):
    """Toy Parameters (names as Gluon's Dense/BatchNorm) with fp16-representable values,
    plus a running mean that must never be touched (grad_req='null')."""
    rng = np.random.RandomState(seed)
    params = []
    for name, shape in TOY_SHAPES:
        p = gluon.Parameter(name, shape=shape, dtype=dtype)
        p.initialize(ctx=mx.cpu())
        p.set_data(mx.nd.array(rng.randn(*shape).astype(np.float16), dtype=dtype))
        params.append(p)
    stat = gluon.Parameter("bn0_running_mean", shape=(6,), dtype=dtype, grad_req="null")
    stat.initialize(mx.init.Zero(), ctx=mx.cpu())
    params.append(stat)
    return params


def toy_grads(step, scale=0.5):
    """Known per-step gradients, fp16-representable, float64 arrays."""
    rng = np.random.RandomState(100 + step)
    return [(rng.randn(*shape) * scale).astype(np.float16).astype(np.float64)
            for _, shape in TOY_SHAPES]


def backward_linear(trainer, params, grads):
    """Back-propagate sum_i sum(w_i * c_i) through the trainer's loss scaling."""
    with autograd.record():
        loss = sum((p.data() * mx.nd.array(c, dtype=p.dtype)).sum()
                   for p, c in zip(params, grads))
    autograd.backward(trainer.scale_loss(loss))


def weights(params):
    return [p.data().asnumpy().astype(np.float64) for p in params]


def master_weights(trainer, params):
    """fp32 master copies (the parameter itself when it is fp32)."""
    states = trainer._updaters[0].states
    out = []
    for i, p in enumerate(params):
        if p.grad_req == "null":
            continue
        st = states.get(i)
        if np.dtype(p.dtype) == np.float16:
            out.append(st[1].asnumpy().astype(np.float64))
        else:
            out.append(p.data().asnumpy().astype(np.float64))
    return out


def optimizer_state(trainer):
    """Every NDArray of the updater's state, as numpy, by index."""
    snap = {}
    for i, st in trainer._updaters[0].states.items():
        arrays = st if isinstance(st, tuple) else (st,)
        snap[i] = [a.asnumpy().copy() for a in arrays if a is not None]
    return snap


class FakeStore(mx.kv.KVStoreBase):
    """In-process store with error feedback and optionally simulated peer workers.

    pushpull sends round(g + residual) to a grid of ``grid`` (None: exact) and keeps
    the rounding error as this worker's residual, like a compressing store. The
    result is the sum over ``num_workers`` workers; the others contribute
    ``self.other[key]`` (default: the same as this worker).
    """

    def __init__(self, num_workers=1, kv_type="fake_local", grid=None):
        self._num_workers = num_workers
        self._type = kv_type
        self.grid = grid
        self.residuals = {}
        self.other = {}
        self.pushed_keys = []

    def broadcast(self, key, value, out, priority=0):
        for o in (out if isinstance(out, list) else [out]):
            o[:] = value

    def pushpull(self, key, value, out=None, priority=0):
        values = value if isinstance(value, list) else [value]
        self.pushed_keys.append(key)
        acc = sum(v.astype(np.float32) for v in values)
        acc = acc + self.residuals.get(key, mx.nd.zeros(acc.shape))
        sent = acc if self.grid is None else mx.nd.round(acc / self.grid) * self.grid
        if self.grid is not None:
            self.residuals[key] = acc - sent
        other = self.other.get(key)
        total = sent * self._num_workers if other is None else sent + other
        outs = values if out is None else (out if isinstance(out, list) else [out])
        for o in outs:
            o[:] = total.astype(o.dtype)

    @staticmethod
    def is_capable(capability):
        return False

    @property
    def type(self):
        return self._type

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return self._num_workers

    def save_residuals(self, fname):
        with open(fname, "wb") as f:
            np.savez(f, **{str(k): v.asnumpy() for k, v in self.residuals.items()})

    def load_residuals(self, fname):
        with np.load(fname) as data:
            self.residuals = {int(k): mx.nd.array(data[k]) for k in data.files}


def residual_snapshot(kv):
    return {k: v.asnumpy().copy() for k, v in kv.residuals.items()}


# ---- the independent numpy LARS ----------------------------------------------------
def np_lr(t, base, warmup, total, power=2.0):
    """Warmup then poly decay, update t (1-based)."""
    if t < warmup:
        return base * t / warmup
    return base * (1.0 - (t - warmup) / (total - warmup)) ** power


def np_lars_step(ws, ms, gs, excluded, lr, wd, eta, eps, momentum, rescale):
    """One LARS step in float64; ws/ms lists updated in place."""
    for k, (w, g) in enumerate(zip(ws, gs)):
        g = g * rescale
        if excluded[k]:
            lr_k, wd_k = lr, 0.0
        else:
            wn, gn = np.linalg.norm(w), np.linalg.norm(g)
            wd_k = wd
            lr_k = lr * eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else lr
        ms[k] = momentum * ms[k] - lr_k * (g + wd_k * w)
        ws[k] = w + ms[k]


# ---- tests --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_steps_match_numpy_lars(dtype):
    params = toy_params(dtype)
    lr, wd, eta, eps, mom, batch, scale = 0.4, 0.01, 0.02, 1e-9, 0.9, 4, 2.0 ** 10
    trainer = LARSTrainer(params, lr, momentum=mom, wd=wd, eta=eta, epsilon=eps,
                          warmup_steps=2, total_steps=10, schedule="poly",
                          loss_scale=DynamicLossScaler(init_scale=scale), kvstore=None)
    assert set(trainer.excluded) == TOY_EXCLUDED
    trained = [p for p in params if p.grad_req != "null"]
    excluded = [p.name in TOY_EXCLUDED for p in trained]
    ref_w = weights(trained)
    ref_m = [np.zeros_like(w) for w in ref_w]
    stat_before = params[-1].data().asnumpy().copy()
    for t in range(1, 4):
        grads = toy_grads(t)
        backward_linear(trainer, params, grads)
        assert trainer.step(batch) is True
        np_lars_step(ref_w, ref_m, [g * scale for g in grads], excluded,
                     np_lr(t, lr, 2, 10), wd, eta, eps, mom, 1.0 / (batch * scale))
        assert trainer.learning_rate == pytest.approx(np_lr(t, lr, 2, 10))
        for got, want in zip(master_weights(trainer, params), ref_w):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for p, want in zip(trained, ref_w):   # fp16 parameter = rounded master
            np.testing.assert_allclose(p.data().asnumpy().astype(np.float64), want,
                                       rtol=2e-3 if dtype == "float16" else 1e-5, atol=1e-6)
    assert np.array_equal(params[-1].data().asnumpy(), stat_before)
    assert trainer.num_update == 3
    # the comparison is sensitive to LARS: fc0's trust ratio at step 1 is far from 1
    w0, g1 = toy_params(dtype)[0].data().asnumpy(), toy_grads(1)[0] / batch
    assert eta * np.linalg.norm(w0) / (np.linalg.norm(g1) + wd * np.linalg.norm(w0)) < 0.5


def test_exclude_patterns():
    params = toy_params("float32")
    assert set(LARSTrainer(params, 0.1, total_steps=5, kvstore=None).excluded) == TOY_EXCLUDED
    only_bias = LARSTrainer(toy_params("float32"), 0.1, total_steps=5, kvstore=None,
                            exclude=[r"_bias$"])
    assert only_bias.excluded == ["fc0_bias"]
    assert LARSTrainer(toy_params("float32"), 0.1, total_steps=5, kvstore=None,
                       exclude=None).excluded == []


def test_overflow_skips_step_and_scale_regrows():
    params = toy_params("float16")
    kv = FakeStore(grid=1.0 / 64)
    trainer = LARSTrainer(params, 0.2, wd=0.01, eta=0.02, total_steps=20, kvstore=kv,
                          loss_scale=DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3))
    backward_linear(trainer, params, toy_grads(1))
    assert trainer.step(8)
    assert kv.residuals and trainer.loss_scale == 2.0 ** 10
    before = (weights(params), optimizer_state(trainer), residual_snapshot(kv),
              len(kv.pushed_keys), trainer.num_update)
    for bad in (np.inf, np.nan):
        backward_linear(trainer, params, toy_grads(2))
        params[4].grad()[0, 0] = bad
        assert trainer.step(8) is False
        after = (weights(params), optimizer_state(trainer), residual_snapshot(kv),
                 len(kv.pushed_keys), trainer.num_update)
        for a, b in zip(before[0], after[0]):
            assert np.array_equal(a, b)
        for i in before[1]:
            for a, b in zip(before[1][i], after[1][i]):
                assert np.array_equal(a, b)
        assert before[2].keys() == after[2].keys()
        assert all(np.array_equal(before[2][k], after[2][k]) for k in before[2])
        assert after[3:] == before[3:]          # nothing pushed, schedule did not move
    assert trainer.loss_scale == 2.0 ** 8 and trainer.loss_scaler.num_skipped == 2
    for t in range(3):
        backward_linear(trainer, params, toy_grads(3 + t))
        assert trainer.step(8)
        assert trainer.loss_scale == (2.0 ** 9 if t == 2 else 2.0 ** 8)


def test_fp16_master_weights_keep_tiny_updates():
    """1e-4 per step is under half an fp16 ulp at 1.0: lost without master weights."""
    out = {}
    for mp in (True, False):
        p = gluon.Parameter("w_bias", shape=(16,), dtype="float16")   # excluded: plain SGD
        p.initialize(mx.init.One(), ctx=mx.cpu())
        trainer = LARSTrainer([p], 1e-4, momentum=0.0, schedule="constant", kvstore=None,
                              multi_precision=mp, loss_scale=None)
        for t in range(300):
            with autograd.record():
                loss = p.data().sum()
            loss.backward()
            if t == 0 and not mp:
                with pytest.warns(UserWarning, match="multi_precision"):
                    trainer.step(1)
            else:
                trainer.step(1)
        out[mp] = p.data().asnumpy().astype(np.float64)
        if mp:
            master = trainer._updaters[0].states[0][1]
            assert master.dtype == np.float32
            np.testing.assert_allclose(master.asnumpy(), 1.0 - 300 * 1e-4, rtol=1e-5)
    np.testing.assert_allclose(out[True], 0.97, atol=5e-4)      # fp16 rounding of 0.97
    assert np.all(out[False] == 1.0)


def test_fp16_lars_tracks_fp32_reference():
    """Quadratic loss, gradient computed in the parameter's dtype: 40 LARS steps."""
    rng = np.random.RandomState(7)
    targets = [rng.randn(*shape).astype(np.float16) for _, shape in TOY_SHAPES]
    final = {}
    for dtype in ("float32", "float16"):
        params = toy_params(dtype)
        trainer = LARSTrainer(params, 1.0, momentum=0.9, wd=1e-3, eta=0.05, warmup_steps=5,
                              total_steps=40, kvstore=None,
                              loss_scale=DynamicLossScaler(init_scale=2.0 ** 8))
        trained = [p for p in params if p.grad_req != "null"]
        tgt = [mx.nd.array(t, dtype=dtype) for t in targets]
        for _ in range(40):
            with autograd.record():
                loss = sum(((p.data() - t) ** 2).sum() * 0.5 for p, t in zip(trained, tgt))
            autograd.backward(trainer.scale_loss(loss))
            assert trainer.step(1)
        final[dtype] = weights(trained)
        if dtype == "float16":
            assert all(np.dtype(p.dtype) == np.float16 for p in trained)
            masters = master_weights(trainer, params)
            assert all(trainer._updaters[0].states[i][1].dtype == np.float32
                       for i in range(len(trained)))
    start = weights([p for p in toy_params("float32") if p.grad_req != "null"])
    for w16, w32, w0 in zip(final["float16"], final["float32"], start):
        assert np.abs(w32 - w0).max() > 0.05                 # it did train
        np.testing.assert_allclose(w16, w32, rtol=1e-2, atol=5e-3)
    for m, w32 in zip(masters, final["float32"]):
        np.testing.assert_allclose(m, w32, rtol=1e-2, atol=5e-3)


def test_distributed_step_averages_over_workers():
    grads = [toy_grads(1), toy_grads(2)]
    results = {}
    for name, kv in (("local", None), ("dist", FakeStore(num_workers=2, kv_type="dist_sync_fake"))):
        params = toy_params("float32")
        trainer = LARSTrainer(params, 0.3, wd=0.01, eta=0.02, total_steps=10, kvstore=kv,
                              loss_scale=DynamicLossScaler(init_scale=2.0 ** 4))
        for g in grads:
            backward_linear(trainer, params, g)
            assert trainer.step(8)       # 8 samples per worker; no "* num_workers"
        results[name] = weights(params)
        if kv is not None:
            vote_key = len(params)
            assert kv.pushed_keys.count(vote_key) == 2
            assert trainer._num_workers() == 2
    for a, b in zip(results["local"], results["dist"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_distributed_overflow_vote_skips_everywhere():
    kv = FakeStore(num_workers=2, kv_type="dist_sync_fake")
    params = toy_params("float32")
    trainer = LARSTrainer(params, 0.3, total_steps=10, kvstore=kv,
                          loss_scale=DynamicLossScaler(init_scale=2.0 ** 4))
    backward_linear(trainer, params, toy_grads(1))
    trainer.step(8)
    kv.other[len(params)] = mx.nd.array([1.0])   # the peer saw Inf in its gradients
    before, pushes = weights(params), len(kv.pushed_keys)
    backward_linear(trainer, params, toy_grads(2))
    assert trainer.step(8) is False
    assert kv.pushed_keys[pushes:] == [len(params)]          # only the vote travelled
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(params)))
    assert trainer.loss_scale == 2.0 ** 3


def _digits_run(net, trainer, steps, start=0, batch=32):
    from mxhylo.data import load_digits
    x, y, _, _ = load_digits()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for t in range(start, start + steps):
        idx = np.random.RandomState(t).choice(len(y), batch, replace=False)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
        autograd.backward(trainer.scale_loss(loss))
        trainer.step(batch)


def _make_digits(kv):
    from mxhylo.models import digits_net
    mx.random.seed(3)
    with mx.name.NameManager():     # the same parameter names every time
        net = digits_net(width=8, hidden=32)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 1, 8, 8)))
    trainer = LARSTrainer(list(net.collect_params().values()), 0.5, eta=0.02, warmup_steps=2,
                          total_steps=8, kvstore=kv,
                          loss_scale=DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=2))
    return net, trainer


def test_resume_is_bit_exact_digits(tmp_path):
    kv_a = FakeStore(grid=1.0 / 256)
    net_a, tr_a = _make_digits(kv_a)
    _digits_run(net_a, tr_a, 8)

    kv_b = FakeStore(grid=1.0 / 256)
    net_b, tr_b = _make_digits(kv_b)
    _digits_run(net_b, tr_b, 4)
    net_b.save_parameters(str(tmp_path / "net.params"))
    tr_b.save_states(str(tmp_path / "trainer.states"))
    assert os.path.exists(str(tmp_path / "trainer.states.residuals"))
    scale_at_ckpt = tr_b.loss_scale
    del net_b, tr_b, kv_b

    kv_c = FakeStore(grid=1.0 / 256)
    net_c, tr_c = _make_digits(kv_c)      # fresh weights, fresh state: all must come back
    net_c.load_parameters(str(tmp_path / "net.params"))
    tr_c.load_states(str(tmp_path / "trainer.states"))
    assert tr_c.num_update == 4 and tr_c.loss_scale == scale_at_ckpt != 2.0 ** 12
    assert kv_c.residuals
    _digits_run(net_c, tr_c, 4, start=4)

    for pa, pc in zip(net_a.collect_params().values(), net_c.collect_params().values()):
        assert np.array_equal(pa.data().asnumpy(), pc.data().asnumpy()), pa.name
    assert tr_a.loss_scale == tr_c.loss_scale and tr_a.num_update == tr_c.num_update == 8
    assert all(np.array_equal(kv_a.residuals[k].asnumpy(), kv_c.residuals[k].asnumpy())
               for k in kv_a.residuals)


def test_resume_is_bit_exact_fp16_master(tmp_path):
    def make():
        params = toy_params("float16")
        return params, LARSTrainer(params, 0.5, eta=0.02, warmup_steps=2, total_steps=8,
                                   kvstore=None, loss_scale=DynamicLossScaler(2.0 ** 8))

    def run(params, trainer, steps, start):
        for t in range(start, start + steps):
            backward_linear(trainer, params, toy_grads(t))
            trainer.step(4)

    pa, ta = make()
    run(pa, ta, 6, 0)
    pb, tb = make()
    run(pb, tb, 3, 0)
    saved = [p.data().copy() for p in pb]
    tb.save_states(str(tmp_path / "s"))
    pc, tc = make()
    for p, v in zip(pc, saved):
        p.set_data(v)
    tc.load_states(str(tmp_path / "s"))
    run(pc, tc, 3, 3)
    for a, c in zip(pa, pc):
        assert np.array_equal(a.data().asnumpy(), c.data().asnumpy())
    for a, c in zip(master_weights(ta, pa), master_weights(tc, pc)):
        assert np.array_equal(a, c)


def test_resume_is_bit_exact_with_hylo_kvstore(tmp_path):
    """The real hylo store's residuals go into the checkpoint (skipped without it)."""
    pytest.importorskip("mxhylo.kvstore.hylo")
    import mxhylo  # noqa: F401  registers the store types
    from mxhylo.models import digits_net

    def make():
        kv = mx.kv.create("hylo")
        if not callable(getattr(kv, "save_residuals", None)):
            pytest.skip("this hylo store has no save_residuals")
        mx.random.seed(5)
        with mx.name.NameManager():   # hylo keys residuals by parameter name
            net = digits_net()        # full size: conv2 goes conv_topk, dense1 fc_2bit
        net.initialize(mx.init.Xavier())
        net(mx.nd.zeros((1, 1, 8, 8)))
        return net, LARSTrainer(list(net.collect_params().values()), 0.5, eta=0.02,
                                total_steps=6, kvstore=kv,
                                loss_scale=DynamicLossScaler(2.0 ** 12, growth_interval=2))

    net_a, tr_a = make()
    _digits_run(net_a, tr_a, 4)
    net_b, tr_b = make()
    _digits_run(net_b, tr_b, 2)
    net_b.save_parameters(str(tmp_path / "net.params"))
    tr_b.save_states(str(tmp_path / "t.states"))
    assert os.path.exists(str(tmp_path / "t.states.residuals"))
    net_c, tr_c = make()
    net_c.load_parameters(str(tmp_path / "net.params"))
    tr_c.load_states(str(tmp_path / "t.states"))
    _digits_run(net_c, tr_c, 2, start=2)
    for pa, pc in zip(net_a.collect_params().values(), net_c.collect_params().values()):
        assert np.array_equal(pa.data().asnumpy(), pc.data().asnumpy()), pa.name


def test_scale_loss_required_when_scaling():
    params = toy_params("float32")
    trainer = LARSTrainer(params, 0.1, total_steps=5, kvstore=None)
    with autograd.record():
        loss = sum(p.data().sum() for p in params if p.grad_req != "null")
    loss.backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        trainer.step(1)


@pytest.mark.parametrize("kwargs, error", [
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"schedule": "linear"}, "unknown schedule"),
    ({"total_steps": None}, "total_steps"),
    ({"total_steps": 5, "warmup_steps": 5}, "exceed"),
    ({"schedule": "step"}, "step_boundaries"),
    ({"schedule": "step", "step_boundaries": [5, 3]}, "increase"),
    ({"momentum": 1.0}, "momentum"),
    ({"wd": -1e-4}, "wd"),
    ({"eta": 0}, "eta"),
    ({"loss_scale": "static"}, "loss_scale"),
    ({"loss_scale": -2.0}, "positive"),
    ({"kvstore": "dist_async"}, "async"),
    ({"exclude": ["("]}, "regex"),
])
def test_bad_arguments(kwargs, error):
    args = {"learning_rate": 0.1, "total_steps": 10}
    args.update(kwargs)
    lr = args.pop("learning_rate")
    with pytest.raises(ValueError, match=error):
        LARSTrainer(toy_params("float32"), lr, **args)


def test_schedules_follow_their_formulas():
    cos = make_schedule(2.0, "cosine", warmup_steps=4, total_steps=14, final_lr=0.1)
    assert cos(2) == pytest.approx(1.0)
    assert cos(9) == pytest.approx(0.1 + 1.9 * (1 + math.cos(math.pi * 5 / 10)) / 2)
    step = make_schedule(1.0, "step", warmup_steps=2, step_boundaries=[5, 8], step_factor=0.1)
    assert [step(t) for t in (1, 3, 5, 6, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.1, 0.01])
    assert make_schedule(1.0, "constant") is None
    const = make_schedule(1.0, "constant", warmup_steps=4)
    assert [const(t) for t in (1, 4, 100)] == pytest.approx([0.25, 1.0, 1.0])


# default run: fp16 multi-precision against the fp32 reference
# (test_fp16_lars_tracks_fp32_reference), the bf16 refusal on any CPU
@pytest.mark.slow
def test_bfloat16_amp_tracks_fp32():
    """MXNet 1.9 CPU AMP (bf16 Convolution/FullyConnected via oneDNN) with LARSTrainer.

    amp.init rewrites mx.nd globally, so the bf16 run is a subprocess. Needs
    AVX-512 (see mxhylo.lars.BF16_CPU_FEATURES); elsewhere a skip naming what
    is missing (the check itself is tested below on any CPU)."""
    missing = lars.bf16_missing_features()
    if missing:
        pytest.skip("bf16 AMP needs a CPU with AVX-512 (%s); missing: %s" % (
            ", ".join(lars.BF16_CPU_FEATURES), ", ".join(missing)))
    from mxhylo.bench.lars import train_digits
    args = dict(method="lars", batch_size=256, epochs=15, seed=0, lr=0.25,
                warmup_epochs=5.0, eta=0.02)
    fp32 = train_digits(**args)["acc"]
    code = textwrap.dedent("""
        from mxnet.contrib import amp
        amp.init(target_dtype="bfloat16")
        from mxhylo.bench.lars import train_digits
        print("ACC", train_digits(**%r)["acc"])
    """ % args)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    bf16 = float(out.stdout.split("ACC")[-1])
    assert fp32 > 0.95
    assert abs(bf16 - fp32) <= 0.01, (bf16, fp32)


def test_bf16_check_names_the_missing_features(monkeypatch):
    """The check with a faked CPU probe: an AVX2-only CPU, then an AVX-512 one."""
    avx2_cpu = {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
    monkeypatch.setattr(lars, "_cpu_flags", lambda: avx2_cpu)
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKLDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    assert lars.bf16_missing_features() == ["avx512f", "avx512bw", "avx512vl", "avx512dq"]
    with pytest.raises(lars.CPUFeatureError, match=r"lacks: avx512f, avx512bw, avx512vl, "
                                                   r"avx512dq\. Train in float32"):
        lars.check_bf16_support()
    monkeypatch.setattr(lars, "_cpu_flags", lambda: avx2_cpu | {"avx512f", "avx512dq"})
    assert lars.bf16_missing_features() == ["avx512bw", "avx512vl"]
    monkeypatch.setattr(lars, "_cpu_flags",
                        lambda: avx2_cpu | set(lars.BF16_CPU_FEATURES))
    assert lars.bf16_missing_features() == []
    lars.check_bf16_support()  # no error
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx2")
    assert lars.bf16_missing_features() == ["DNNL_MAX_CPU_ISA=AVX2 (oneDNN capped below "
                                            "AVX512_CORE)"]
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core_bf16")
    assert lars.bf16_missing_features() == []
    # float32 training never asks; bfloat16 parameters (without AMP) do
    monkeypatch.setattr(lars, "_cpu_flags", lambda: avx2_cpu)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    LARSTrainer(toy_params("float32"), 0.1, loss_scale=None, schedule="constant")
    from mxnet.contrib.amp.amp import bfloat16
    p = gluon.Parameter("fc_weight", shape=(4, 3), dtype=bfloat16)
    p.initialize(mx.init.Zero())
    with pytest.raises(lars.CPUFeatureError, match="training bfloat16 parameters needs a CPU "
                                                   "with AVX-512.*lacks: avx512f"):
        LARSTrainer([p], 0.1, loss_scale=None, schedule="constant")


def test_bf16_amp_refused_before_onednn_fails():
    """On this machine too: oneDNN capped at AVX2 (DNNL_MAX_CPU_ISA) fails a bf16
    convolution exactly as an AVX2-only CPU does, and LARSTrainer refuses bf16 AMP
    first, naming the cap; with a faked AVX2-only probe it names the features."""
    code = textwrap.dedent("""
        import os
        import mxnet as mx
        from mxnet.contrib import amp
        amp.init(target_dtype="bfloat16")
        import mxhylo.lars as lars
        from mxhylo.models import digits_net
        net = digits_net()
        net.initialize()
        assert lars.bf16_amp_active()
        try:
            net(mx.nd.ones((2, 1, 8, 8))).asnumpy()
            print("FORWARD-RAN")
        except mx.base.MXNetError as err:
            print("ONEDNN:", str(err).splitlines()[0])
        try:
            lars.LARSTrainer(net.collect_params(), 0.1, loss_scale=None, schedule="constant")
        except lars.CPUFeatureError as err:
            print("CAPPED:", err)
        del os.environ["DNNL_MAX_CPU_ISA"]
        lars._cpu_flags = lambda: {"sse2", "avx", "avx2", "fma", "f16c"}
        try:
            lars.LARSTrainer(net.collect_params(), 0.1, loss_scale=None, schedule="constant")
        except lars.CPUFeatureError as err:
            print("PROBED:", err)
    """)
    env = dict(os.environ, DNNL_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ONEDNN: " in out.stdout and "could not create a primitive descriptor" in out.stdout
    assert "CAPPED: bfloat16 AMP" in out.stdout and "DNNL_MAX_CPU_ISA=AVX2" in out.stdout
    assert "PROBED: bfloat16 AMP" in out.stdout
    assert "lacks: avx512f, avx512bw, avx512vl, avx512dq" in out.stdout


def test_bench_lars_bf16_refused_with_a_clear_error():
    """bench lars --dtype bfloat16 on a CPU (here: oneDNN capped at AVX2) without
    MXNet's bf16 kernels stops at once, naming what is missing, before any training."""
    env = dict(os.environ, DNNL_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-m", "mxhylo.bench", "lars", "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "bench lars --dtype bfloat16 needs a CPU with AVX-512" in out.stderr, out.stderr[-2000:]
    assert "DNNL_MAX_CPU_ISA=AVX2" in out.stderr
