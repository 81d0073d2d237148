"""Momentum correction (kvstore.momentum) and the warm-up, in one process."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mxhylo
from mxhylo.kvstore import momentum, stages
from mxhylo.kvstore.pipeline import Layer
from mxhylo.kvstore.memory import ResidualMemory


def test_corrected_aggregates_step_plainly_under_a_decaying_learning_rate():
    """With the learning rate changing every step (a cosine schedule in MXNet's SGD),
    the corrected aggregates still move the weights by exactly -lr_t * rescale * agg_t
    per step: the ratio of learning rates is part of the correction. The context's lr
    is the one the optimizer then applies."""
    rng = np.random.RandomState(1)
    m, steps = 0.9, 8
    # (to max_update + 2: at lr 0 nothing can cancel the buffer, documented)
    sched = mx.lr_scheduler.CosineScheduler(max_update=steps + 2, base_lr=0.1, final_lr=0.0)
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=m, wd=0.0, lr_scheduler=sched,
                           rescale_grad=0.5)
    w = mx.nd.array(rng.normal(size=(4, 3)))
    expected = w.asnumpy().astype(np.float64)
    state = opt.create_state(0, w)
    memory = ResidualMemory()
    for step in range(steps):
        ctx = momentum.from_optimizer(opt)
        agg = rng.normal(size=(4, 3)).astype(np.float32)
        corrected = mx.nd.array(agg)
        momentum.correct("w", corrected, memory, ctx)
        opt.update(0, w, corrected, state)
        assert ctx.lr == pytest.approx(opt._get_lr(0)), step       # the lr just applied
        expected -= ctx.lr * 0.5 * agg
        np.testing.assert_allclose(w.asnumpy(), expected, rtol=1e-5, atol=1e-6,
                                   err_msg="step %d" % step)


def test_corrected_aggregates_make_mxnet_sgd_step_plainly():
    """Fed the corrected aggregates, MXNet's momentum SGD moves the weights by exactly
    -lr * rescale * aggregate per step (no second momentum), also when rescale_grad
    changes (a smaller last batch); weight decay keeps its own momentum."""
    rng = np.random.RandomState(0)
    m, lr = 0.9, 0.1
    opt = mx.optimizer.SGD(learning_rate=lr, momentum=m, wd=0.0)
    w = mx.nd.array(rng.normal(size=(5, 3)))
    expected = w.asnumpy().astype(np.float64)
    state = opt.create_state(0, w)
    memory = ResidualMemory()
    for step, rescale in enumerate([0.5, 0.5, 0.25, 0.5, 0.5]):
        agg = rng.normal(size=(5, 3)).astype(np.float32)
        opt.rescale_grad = rescale
        corrected = mx.nd.array(agg)
        momentum.correct("w", corrected, memory, momentum.MomentumContext(m, rescale))
        opt.update(0, w, corrected, state)
        expected -= lr * rescale * agg
        np.testing.assert_allclose(w.asnumpy(), expected, rtol=1e-5, atol=1e-6,
                                   err_msg="step %d" % step)


def _conv_layer(conv_rate=0.25):
    kv = mxhylo.create(size_threshold=10, conv_rate=conv_rate, warmup_steps=0)
    plan = kv.policy.plan("conv", (8, 2, 3, 3))
    return plan, kv.compressors[plan.strategy]


@pytest.mark.parametrize("strategy", ["conv_topk", "fc_2bit"])
def test_error_feedback_delivers_dense_momentum(strategy):
    """What a worker has sent after T steps, plus its residual, is exactly the sum of
    dense momentum's velocities u_t = m u_{t-1} + g_t: the velocity runs on whole,
    nothing of it is masked where sent."""
    rng = np.random.RandomState(2)
    m, steps = 0.9, 12
    if strategy == "conv_topk":
        plan, compressor = _conv_layer(conv_rate=0.125)
    else:
        kv = mxhylo.create(size_threshold=10, warmup_steps=0)
        plan = kv.policy.plan("fc", (6, 20))
        compressor = kv.compressors[plan.strategy]
    grads = [rng.normal(size=plan.shape).astype(np.float32) for _ in range(steps)]
    u, dense_sum = np.zeros(plan.shape, np.float64), np.zeros(plan.shape, np.float64)
    for g in grads:
        u = m * u + g
        dense_sum += u
    memory, total = ResidualMemory(), np.zeros(plan.shape, np.float64)
    for g in grads:
        v = momentum.accumulate(plan.name, mx.nd.array(g), memory,
                                momentum.MomentumContext(m, 1.0))
        payload = compressor.encode(plan, v, memory)
        momentum.keep_velocity(plan.name, v, memory)
        sent = mx.nd.zeros(plan.shape)
        compressor.decode(payload, sent)
        total += sent.asnumpy()
    delivered = total + memory.get(plan.name).asnumpy()
    np.testing.assert_allclose(delivered, dense_sum, rtol=1e-4, atol=1e-4)


def _trainer_steps(kv, steps, seed=0, optimizer="sgd", opts=None):
    """A Dense(64) on 256 inputs trained a few steps through ``kv``; returns weights."""
    mx.random.seed(seed)
    rng = np.random.RandomState(seed)
    net = gluon.nn.Dense(64, in_units=256, prefix="fc_")
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), optimizer,
                            opts or {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
    for _ in range(steps):
        x = mx.nd.array(rng.normal(size=(8, 256)))
        with mx.autograd.record():
            loss = (net(x) ** 2).mean()
        loss.backward()
        trainer.step(8)
    return {k: p.data().asnumpy() for k, p in net.collect_params().items()}, kv


def test_warmup_steps_travel_exactly_then_compress():
    """The first warmup_steps exchanges of a compressed layer are the plain sum (the
    same weights as a store that never compresses); the next one compresses."""
    dense, _ = _trainer_steps(mxhylo.create(policy={".*": "none"}), 3)
    warm, kv = _trainer_steps(mxhylo.create(warmup_steps=3), 3)
    for name in dense:
        np.testing.assert_array_equal(warm[name], dense[name], err_msg=name)
    assert kv.stats()["layers"]["fc_weight"]["policy"] == "fc_2bit"
    four, kv4 = _trainer_steps(mxhylo.create(warmup_steps=3), 4)
    dense4, _ = _trainer_steps(mxhylo.create(policy={".*": "none"}), 4)
    assert not np.array_equal(four["fc_weight"], dense4["fc_weight"])
    assert kv4.memory.scalar("fc_weight", "warmup_done") == 3


def test_momentum_correction_follows_the_trainer_optimizer():
    _, kv = _trainer_steps(mxhylo.create(warmup_steps=0), 2)
    assert kv.memory.get("fc_weight") is not None
    # SGD with momentum: velocity and previous aggregate are kept (and checkpointed)
    state = kv.memory.state_dict()
    assert "velocity/fc_weight" in state and "previous_aggregate/fc_weight" in state
    # without momentum, or with another optimizer: none
    for optimizer, opts in (("sgd", {"learning_rate": 0.1}), ("adam", {"learning_rate": 0.01})):
        _, kv = _trainer_steps(mxhylo.create(warmup_steps=0), 2, optimizer=optimizer,
                               opts=opts)
        assert "velocity/fc_weight" not in kv.memory.state_dict(), optimizer
    with pytest.raises(ValueError, match="momentum_correction=True needs"):
        _trainer_steps(mxhylo.create(warmup_steps=0, momentum_correction=True), 1,
                       optimizer="adam", opts={"learning_rate": 0.01})
    with pytest.raises(ValueError, match="momentum_correction must be"):
        mxhylo.create(momentum_correction="yes")
    with pytest.raises(ValueError, match="warmup_steps must be"):
        mxhylo.create(warmup_steps=-1)


def test_momentum_state_checkpoint_resumes_bitwise(tmp_path):
    """Velocity, previous aggregate and warm-up count travel in save_residuals."""
    _, kv = _trainer_steps(mxhylo.create(warmup_steps=1), 3)
    kv.save_residuals(str(tmp_path / "r"))
    fresh = mxhylo.create(warmup_steps=1)
    fresh.load_residuals(str(tmp_path / "r"))
    a, b = kv.memory.state_dict(), fresh.memory.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k].asnumpy(), b[k].asnumpy(), err_msg=k)


# a fixed momentum, and one that a schedule (mxhylo.schedules) changes at every step
MOMENTA = {"fixed": [0.9] * 10, "scheduled": [0.95, 0.9, 0.85, 0.8, 0.9, 0.5, 0.3, 0.7,
                                              0.99, 0.9]}


@pytest.mark.parametrize("momenta", sorted(MOMENTA))
@pytest.mark.parametrize("strategy", ["conv_topk", "fc_2bit"])
def test_held_gradients_keep_the_learning_rate_of_their_step(strategy, momenta, monkeypatch):
    """Under a changing learning rate and rescale_grad, what the stages have sent, each
    step's send at its lr_t * c_t, plus the residual at the last step's, is exactly dense
    momentum SGD's total update (the sum of its buffers B_t = m_t B_{t-1} + lr_t c_t g_t):
    velocity and residual are kept in the coming step's units (kvstore.momentum,
    "Units"), also where a schedule changes m_t at every step. The bound is off: it
    drops what it cuts, by design."""
    monkeypatch.setattr(stages, "ROW_BOUND", 1e30)
    rng = np.random.RandomState(3)
    ms = MOMENTA[momenta]
    lrs = [0.1, 0.09, 0.07, 0.05, 0.05, 0.03, 0.02, 0.01, 0.004, 0.001]
    rescales = [0.5] * 6 + [0.25] + [0.5] * 3
    if strategy == "conv_topk":
        plan, _ = _conv_layer(conv_rate=0.125)
        kv = mxhylo.create(size_threshold=10, conv_rate=0.125, warmup_steps=0)
    else:
        kv = mxhylo.create(size_threshold=10, warmup_steps=0)
        plan = kv.policy.plan("fc", (6, 20))
    assert plan.strategy == strategy
    memory = ResidualMemory()
    layer = Layer(0, plan, stages.chain(plan, kv.compressors, 0, memory))
    buffer, dense_total = np.zeros(plan.shape), np.zeros(plan.shape)
    applied = np.zeros(plan.shape)
    for m, lr, c in zip(ms, lrs, rescales):
        g = rng.normal(size=plan.shape).astype(np.float32)
        buffer = m * buffer + lr * c * g.astype(np.float64)
        dense_total += buffer
        step = stages.Step(memory, momentum.MomentumContext(m, c, lr))
        payload = layer.stages.encode(layer, mx.nd.array(g), step)
        sent = mx.nd.zeros(plan.shape)
        kv.compressors[strategy].decode(payload, sent)
        applied += lr * c * sent.asnumpy()
        layer.stages.finish(layer, sent, step)
    held = lrs[-1] * rescales[-1] * memory.get(plan.name).asnumpy()
    np.testing.assert_allclose(applied + held, dense_total, rtol=1e-5, atol=1e-6)


def _scheduled(kv, steps=12):
    """_trainer_steps' parameters after ``steps`` steps of a cosine schedule."""
    sched = mx.lr_scheduler.CosineScheduler(max_update=steps + 4, base_lr=0.1, final_lr=0.0)
    params, _ = _trainer_steps(kv, steps, opts={"learning_rate": 0.1, "momentum": 0.9,
                                                "lr_scheduler": sched})
    return params


def test_a_store_sending_every_row_is_mxnet_momentum_sgd_under_a_schedule():
    """Top-k at k = every filter sends the whole velocity every step: under a cosine
    schedule the weights are plain momentum SGD's to float32 rounding (the velocity
    kept in the step's units; with it kept in gradient units they differ by 4e-3)."""
    dense = _scheduled(None)
    every_row = _scheduled(mxhylo.create(policy={"fc_weight": "conv_topk"},
                                                 conv_rate=1.0, warmup_steps=0))
    for name in dense:
        np.testing.assert_allclose(every_row[name], dense[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)
