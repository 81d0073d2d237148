"""Batch-size and momentum schedules on a Trainer (mxhylo.schedules), in one process.

The distributed cases (dist_sync and hylo over the parameter server) are in
tests/distributed/test_schedules_dist.py."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import mxhylo
from mxhylo import schedules
from mxhylo.paced_schedule import pace_schedule

IN, OUT, MICRO = 12, 3, 4          # a Dense net of IN inputs; MICRO samples a micro-batch


def _net(seed=0):
    """A net without BatchNorm (its batch statistics would differ by construction)."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential(prefix="net_")
    with net.name_scope():
        net.add(gluon.nn.Dense(16, activation="tanh", in_units=IN), gluon.nn.Dense(OUT, in_units=16))
    net.initialize(mx.init.Xavier())
    return net


def _batches(n, seed=1):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.normal(size=(MICRO, IN))),
             mx.nd.array(rng.randint(0, OUT, size=MICRO))) for _ in range(n)]


LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def _step(net, trainer, x, y):
    with autograd.record():
        loss = LOSS(net(x), y)
    loss.backward()
    trainer.step(x.shape[0])


def _params(net):
    return {k: p.data().asnumpy() for k, p in net.collect_params().items()}


def _close(a, b, rtol=2e-5, atol=1e-6):
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


STORES = {
    "device": lambda: "device",
    "hylo_uncompressed": lambda: mxhylo.create(policy={".*": "none"}),
}


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("hybridize", [False, True])
def test_k_micro_batches_step_like_one_batch_k_times_larger(store, hybridize):
    """Accumulating k = 3 micro-batches, then one update, is one update on the 3x batch,
    for 4 updates under momentum SGD with weight decay, to float32 rounding."""
    k, updates = 3, 4
    opts = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
    data = _batches(k * updates)
    acc, big = _net(), _net()
    if hybridize:
        acc.hybridize()
        big.hybridize()
    t_acc = gluon.Trainer(acc.collect_params(), "sgd", dict(opts), kvstore=STORES[store]())
    sched = schedules.attach(t_acc, iters_per_epoch=k * updates,
                             batch=schedules.StepBatch([], base=k))
    t_big = gluon.Trainer(big.collect_params(), "sgd", dict(opts), kvstore=STORES[store]())
    for u in range(updates):
        group = data[u * k:(u + 1) * k]
        for x, y in group:
            _step(acc, t_acc, x, y)
        _step(big, t_big, mx.nd.concat(*[x for x, _ in group], dim=0),
              mx.nd.concat(*[y for _, y in group], dim=0))
        _close(_params(acc), _params(big))
    assert (sched.updates, sched.micro_batches, sched.pending) == (updates, k * updates, 0)
    assert t_acc._optimizer.num_update == t_big._optimizer.num_update == updates
    # backward kept writing (MXNet's grad_req='add' backward is slower): the sums are
    # the schedule's own
    assert {p.grad_req for p in acc.collect_params().values()} == {"write"}


def test_the_batch_grows_at_its_milestone_with_the_lr_scaled_linearly():
    """k = 1 for the first epoch (2 micro-batches), then 2: the third update takes two
    micro-batches at twice the lr (the linear rule), as a hand-made reference does."""
    opts = {"learning_rate": 0.05, "momentum": 0.9}
    data = _batches(6)
    acc, ref = _net(), _net()
    t_acc = gluon.Trainer(acc.collect_params(), "sgd", dict(opts))
    sched = schedules.attach(t_acc, iters_per_epoch=2, batch=schedules.StepBatch([1]))
    t_ref = gluon.Trainer(ref.collect_params(), "sgd", dict(opts))
    for x, y in data:
        _step(acc, t_acc, x, y)
    cat = lambda items: mx.nd.concat(*items, dim=0)       # noqa: E731
    _step(ref, t_ref, *data[0])
    _step(ref, t_ref, *data[1])
    t_ref.set_learning_rate(0.1)
    for pair in (data[2:4], data[4:6]):
        _step(ref, t_ref, cat([x for x, _ in pair]), cat([y for _, y in pair]))
    _close(_params(acc), _params(ref))
    assert sched.updates == 4 and sched.k == 2
    assert t_acc.learning_rate == pytest.approx(0.1)


def test_the_lr_scheduler_is_read_at_the_micro_batch_count():
    """With k = 2 from the start and a cosine schedule sized in micro-batches, the lr of
    the update that completes micro-batch n is the schedule's at n (not at the update
    count n / 2), scaled by k / k0 = 1; under mxhylo.run's pacing (W = 4) at 4 n."""
    cosine = mx.lr_scheduler.CosineScheduler(max_update=100, base_lr=0.1, final_lr=0.0)
    net = _net()
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "lr_scheduler": cosine})
    schedules.attach(trainer, iters_per_epoch=4, batch=schedules.StepBatch([], base=2))
    seen = []
    for x, y in _batches(8):
        _step(net, trainer, x, y)
        seen.append(trainer.learning_rate)
    # the Trainer reports the lr of the last update (micro-batch 2, 4, 6, 8)
    assert seen[1::2] == [pytest.approx(cosine(n)) for n in (2, 4, 6, 8)]
    pace_schedule(trainer, 4)
    for x, y in _batches(2, seed=5):
        _step(net, trainer, x, y)
    assert trainer.learning_rate == pytest.approx(cosine(4 * 10))


def test_a_momentum_schedule_sets_the_optimizers_momentum_at_each_update():
    net = _net()
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9})
    cycle = schedules.OneCycleMomentum(epochs=2, high=0.95, low=0.85)
    schedules.attach(trainer, iters_per_epoch=2, momentum=cycle)
    seen = []
    for x, y in _batches(5):
        _step(net, trainer, x, y)
        seen.append(trainer._optimizer.momentum)
    # update n completes micro-batch n: epoch n / 2
    assert seen == [pytest.approx(cycle(n / 2.0)) for n in range(1, 6)]
    assert cycle(0) == 0.95 and cycle(1) == pytest.approx(0.85) and cycle(3) == 0.95


def _momentum_sgd_run(kv, momenta, updates=10):
    """A Dense(64) of 256 inputs, MXNet's momentum SGD under a cosine lr and the
    per-update momenta ``momenta`` (StepMomentum, one update per epoch)."""
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    net = gluon.nn.Dense(64, in_units=256, prefix="fc_")
    net.initialize(mx.init.Xavier())
    sched = mx.lr_scheduler.CosineScheduler(max_update=updates + 4, base_lr=0.1, final_lr=0.0)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9, "lr_scheduler": sched},
                            kvstore=kv)
    schedules.attach(trainer, iters_per_epoch=1,
                     momentum=schedules.StepMomentum(list(range(1, len(momenta))), momenta))
    for _ in range(updates):
        x = mx.nd.array(rng.normal(size=(8, 256)))
        with autograd.record():
            loss = (net(x) ** 2).mean()
        loss.backward()
        trainer.step(8)
    return {k: p.data().asnumpy() for k, p in net.collect_params().items()}


def test_momentum_correction_is_exact_when_the_momentum_changes(monkeypatch):
    """Through a Trainer: top-k sending every filter, with a momentum that changes at
    every update (and a cosine lr; 0 at one update, where MXNet's SGD leaves its buffer
    as it was), gives MXNet's momentum SGD's weights under the same momenta, to float32
    rounding. (Sending every row, velocity and correction cancel whatever m they use:
    tests/integration/test_momentum.py test_held_gradients_keep_the_learning_rate_of_their_step,
    with a changing momentum, is the one that sees m.)"""
    from mxhylo.kvstore import momentum

    momenta = [0.95, 0.9, 0.85, 0.8, 0.9, 0.5, 0.0, 0.7, 0.99, 0.9]
    dense = _momentum_sgd_run(None, momenta)
    seen, read = [], momentum.from_optimizer

    def spy(optimizer):
        ctx = read(optimizer)
        seen.append(None if ctx is None else ctx.momentum)
        return ctx

    monkeypatch.setattr(momentum, "from_optimizer", spy)
    every_row = _momentum_sgd_run(mxhylo.create(policy={"fc_weight": "conv_topk"},
                                                conv_rate=1.0, warmup_steps=0), momenta)
    # the store's correction used each update's scheduled momentum (none at m = 0;
    # the first reading is the plan's, before the first update)
    schedule = schedules.StepMomentum(list(range(1, len(momenta))), momenta)
    assert seen[1:] == [schedule(n) or None for n in range(1, 11)]     # update n: epoch n
    assert None in seen
    fixed = _momentum_sgd_run(None, [0.9])
    _close(every_row, dense, rtol=1e-5, atol=1e-7)
    assert not np.allclose(fixed["fc_weight"], dense["fc_weight"], rtol=1e-4, atol=1e-6)


def _resumable(kv_factory, path, stop_at=None, total=12):
    """Train 12 micro-batches under a batch change at epoch 1 (4 micro-batches an epoch)
    and a momentum step at epoch 2; with ``stop_at``, save after that many micro-batches,
    then rebuild net and Trainer, load, and go on."""
    data = _batches(total, seed=3)
    opts = {"learning_rate": 0.05, "momentum": 0.9}

    def build():
        net = _net()
        trainer = gluon.Trainer(net.collect_params(), "sgd", dict(opts), kvstore=kv_factory())
        schedules.attach(trainer, iters_per_epoch=4, batch=schedules.StepBatch([1]),
                         momentum=schedules.StepMomentum([2], [0.9, 0.8]))
        return net, trainer

    net, trainer = build()
    for i, (x, y) in enumerate(data):
        if i == stop_at:
            assert trainer.schedules.pending == 0
            net.save_parameters(str(path / "p"))
            trainer.save_states(str(path / "s"))
            net, trainer = build()
            net.load_parameters(str(path / "p"))
            trainer.load_states(str(path / "s"))
        _step(net, trainer, x, y)
    return _params(net), trainer


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_resume_across_the_schedule_change_is_bitwise(tmp_path, store):
    whole, t_whole = _resumable(STORES[store], tmp_path)
    resumed, t_resumed = _resumable(STORES[store], tmp_path, stop_at=6)
    for name in whole:
        np.testing.assert_array_equal(whole[name], resumed[name], err_msg=name)
    s = t_resumed.schedules
    assert (s.micro_batches, s.updates, s.k) == (12, 8, 2)
    assert t_resumed._optimizer.momentum == 0.8


def test_schedules_that_cannot_work_are_refused():
    def trainer(**kw):
        net = _net()
        opts = {"learning_rate": 0.1, "momentum": kw.pop("momentum", 0.9)}
        return gluon.Trainer(net.collect_params(), "sgd", opts, **kw), net

    with pytest.raises(ValueError, match="base must be an int >= 1"):
        schedules.StepBatch([2], base=0)
    with pytest.raises(ValueError, match="momentum must be in"):
        schedules.StepMomentum([2], [0.9, 1.0])
    with pytest.raises(ValueError, match="momentum must be in"):
        schedules.OneCycleMomentum(10, low=-0.1)
    t, net = trainer()
    schedules.attach(t, iters_per_epoch=1, batch=lambda epoch: 0 if epoch >= 1 else 1)
    x, y = _batches(1)[0]
    _step(net, t, x, y)
    with pytest.raises(ValueError, match="k = 0 at epoch 1"):
        _step(net, t, x, y)
    t, net = trainer()
    schedules.attach(t, iters_per_epoch=1, momentum=lambda epoch: 1.5)
    with pytest.raises(ValueError, match="momentum must be in"):
        _step(net, t, x, y)
    t, _ = trainer(kvstore="device", update_on_kvstore=True)
    with pytest.raises(ValueError, match="update_on_kvstore=True"):
        schedules.attach(t, iters_per_epoch=1, batch=schedules.StepBatch([1]))
    t, _ = trainer(momentum=0.0)
    with pytest.raises(ValueError, match="made with momentum > 0"):
        schedules.attach(t, iters_per_epoch=1, momentum=schedules.StepMomentum([], [0.9]))
    t, net = trainer()
    _step(net, t, x, y)
    with pytest.raises(ValueError, match="before the Trainer's first step"):
        schedules.attach(t, iters_per_epoch=1, batch=schedules.StepBatch([1]))
    t, net = trainer()
    net.collect_params().setattr("grad_req", "add")
    with pytest.raises(ValueError, match="grad_req='add'"):
        schedules.attach(t, iters_per_epoch=1, batch=schedules.StepBatch([1]))
    t, _ = trainer()
    with pytest.raises(ValueError, match="iters_per_epoch must be"):
        schedules.attach(t, iters_per_epoch=0, batch=schedules.StepBatch([1]))


class _TwoHeads(gluon.nn.HybridBlock):
    """A body and two heads; each micro-batch uses one head (a conditional net)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.body = gluon.nn.Dense(8, activation="tanh", in_units=IN)
            self.a = gluon.nn.Dense(OUT, in_units=8)
            self.b = gluon.nn.Dense(OUT, in_units=8)

    def forward(self, x, head):
        return getattr(self, head)(self.body(x))


def test_a_parameter_a_micro_batch_did_not_use_adds_nothing():
    """k = 2, head 'a' in the first micro-batch only, head 'b' in the second only: each
    head's update holds its own micro-batch's gradient, not a stale one from the last
    update (the reference: backward with grad_req='add' into zeroed gradients)."""
    opts = {"learning_rate": 0.1, "momentum": 0.9}
    data = _batches(6)
    nets = []
    for _ in range(2):
        mx.random.seed(0)
        net = _TwoHeads(prefix="heads_")
        net.initialize(mx.init.Xavier())
        nets.append(net)
    acc, ref = nets
    t_acc = gluon.Trainer(acc.collect_params(), "sgd", dict(opts))
    schedules.attach(t_acc, iters_per_epoch=6, batch=schedules.StepBatch([], base=2))
    ref.collect_params().setattr("grad_req", "add")
    t_ref = gluon.Trainer(ref.collect_params(), "sgd", dict(opts))
    for i, (x, y) in enumerate(data):
        head = "ab"[i % 2]
        for net in (acc, ref):
            with autograd.record():
                loss = LOSS(net(x, head), y)
            loss.backward()
        t_acc.step(MICRO)
        if i % 2:
            t_ref.step(2 * MICRO)
            ref.collect_params().zero_grad()
    got = {k[len("heads_"):]: v for k, v in _params(acc).items()}
    want = {k[len("heads_"):]: v for k, v in _params(ref).items()}
    _close(got, want)
