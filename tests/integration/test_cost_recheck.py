"""The cost model measured again mid-run (Hylo.recheck_costs), in one process.

The store's measurements are replaced by fixed models (a slow network, then a fast
one, then slow again), so the plans change at known steps; the distributed version,
with real probes over the parameter server, is in tests/distributed/test_dist.py.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mxhylo
from mxhylo.kvstore import planner
from mxhylo.kvstore.cost_model import CodecCost, CostModel, WireCost

SHAPES = {"conv_weight": (64, 16, 3, 3), "fc_weight": (64, 256), "fc_bias": (64,)}


def _model(per_byte):
    codecs = {"conv_topk": CodecCost(1e-9, 1e-10), "fc_2bit": CodecCost(1e-9, 1e-9)}
    return CostModel(WireCost(1e-4, per_byte), codecs, 1, "gather")


@pytest.fixture
def forced_costs(monkeypatch):
    """Each measurement of the cost model returns the next model of ``models``, and
    the layers are priced with their payloads gathered on the way back, as over the
    parameter server (in one process the pull is the dense aggregate)."""
    models = []

    def measure_now(self):
        self.pull = "gather"
        return models.pop(0)
    monkeypatch.setattr(planner.Planner, "measure_now", measure_now)
    return models


def _train(kv, steps, seed=3, after_step=None):
    """Momentum SGD (m 0.9, lr 0.1, no weight decay) of SHAPES' parameters, fed fixed
    random gradients (they do not depend on the weights); returns the weights after
    every step (list of dicts)."""
    rng = np.random.RandomState(seed)
    params = []
    for name, shape in SHAPES.items():
        p = gluon.Parameter(name, shape=shape)
        p.initialize(mx.init.Constant(0.5), ctx=mx.cpu())
        params.append(p)
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.0},
                            kvstore=kv, update_on_kvstore=False if kv is not None else None)
    history = []
    for step in range(steps):
        for p in params:
            p.grad()[:] = rng.normal(0, 1, p.shape).astype(np.float32)
            p.data()._fresh_grad = True
        trainer.step(1)
        history.append({p.name: p.data().asnumpy() for p in params})
        if after_step:
            after_step(step + 1)
    return history


def test_replanned_dense_layers_catch_up_with_dense_momentum_sgd(forced_costs):
    """Warm-up 2 steps, step 3 compressed (momentum correction), the fast network seen
    after step 3 (recheck_costs between the steps): the layers go dense, send what they
    owed with the next exchange and keep their velocity, so at steps 4-7 the weights
    are dense momentum SGD's (at step 3 the residual holds part of the step back). The
    recheck after step 7 sees a slow network again: compressed, without a second
    warm-up."""
    forced_costs += [_model(1e-6), _model(1e-15), _model(1e-6)]
    kv = mxhylo.create(cost_model=True, warmup_steps=2)
    seen = []

    def after_step(step):
        seen.append({n: p.strategy for n, p in kv.plans().items()})
        if step in (3, 7):
            kv.recheck_costs()
    got = _train(kv, 10, after_step=after_step)
    dense = _train(None, 10)
    compressed = [n for n in SHAPES if seen[0][n] != "none"]
    assert compressed == ["conv_weight", "fc_weight"]
    # rechecked before the 4th and the 8th exchange
    for step, plans in enumerate(seen, 1):
        want = "none" if step in (4, 5, 6, 7) else None
        for n in compressed:
            assert (plans[n] == "none") == (want == "none"), (step, n, plans[n])
    for step in range(10):
        for n in SHAPES:
            same = np.allclose(got[step][n], dense[step][n], rtol=1e-5, atol=1e-6)
            # steps 1-2 warm-up, 4-7 dense (the 4th flushes); 3 and 8+ owe a residual
            expect = n == "fc_bias" or step + 1 in (1, 2, 4, 5, 6, 7)
            assert same == expect, (step + 1, n)
    assert kv.memory.scalar("fc_weight", "warmup_done") == 2
    assert kv.stats()["steps"] == 10
    assert kv.stats()["cost_model"]["layers"]["fc_weight"]["strategy"] == "fc_2bit"


def test_recheck_needs_the_cost_model():
    with pytest.raises(ValueError, match="recheck_costs needs the cost model"):
        mxhylo.create().recheck_costs()


def test_pop_codec_state_returns_the_residual_and_keeps_the_store_state():
    from mxhylo.kvstore.memory import ResidualMemory

    memory = ResidualMemory()
    like = mx.nd.zeros((3, 4))
    assert memory.pop_codec_state("w") is None
    memory.residual("w", like)[:] = 2.0
    memory.set_scalar("w", "threshold", 0.5)
    memory.set_scalar("w", "warmup_done", 3)
    memory.set_scalar("w", "previous_rescale", 1.0)
    memory.array("w", "velocity", like)[:] = 1.0
    res = memory.pop_codec_state("w")
    np.testing.assert_array_equal(res.asnumpy(), np.full((3, 4), 2.0, np.float32))
    assert memory.get("w") is None and memory.scalar("w", "threshold") is None
    assert memory.scalar("w", "warmup_done") == 3
    assert memory.scalar("w", "previous_rescale") == 1.0
    assert memory.array("w", "velocity", like).asnumpy().sum() == 12.0


def test_exchange_drift_is_a_change_of_the_median_by_the_factor():
    from mxhylo.kvstore.cost_model import ExchangeDrift

    drift = ExchangeDrift(2.0, window=4)
    for s in (0.10, 0.11, 0.09, 0.10):          # the baseline
        drift.add(s)
    assert not drift.drifted()                  # no recent steps yet
    for s in (0.10, 0.30, 0.12, 0.11):          # one slow step: the median holds
        drift.add(s)
    assert not drift.drifted()
    for s in (0.25, 0.22, 0.30):                # 3 of the last 4 steps 2x slower or more
        drift.add(s)
    assert drift.drifted()
    drift.reset()
    assert not drift.drifted()
    for s in (0.2,) * 4 + (0.09,) * 4:          # faster by more than the factor
        drift.add(s)
    assert drift.drifted()
    with pytest.raises(ValueError, match="drift factor"):
        ExchangeDrift(1.0)


def test_drifted_exchanges_measure_the_cost_model_again(forced_costs, monkeypatch):
    """The exchanges take 0.01 s for 9 steps, then 0.05 s; the drift checks come every
    5 steps (window 4): the first check that sees 4 slow steps measures again and
    re-plans (the network is now slow: compressed), and the checks after it, with a
    new baseline, do not. A store whose exchanges only jitter never measures again."""
    from mxhylo.kvstore import cost_model

    monkeypatch.setattr(planner, "DRIFT_CHECK_STEPS", 5)
    monkeypatch.setattr(planner, "DRIFT_WINDOW", 4)
    times = iter([0.01] * 9 + [0.05] * 100)
    real_add = cost_model.ExchangeDrift.add
    monkeypatch.setattr(cost_model.ExchangeDrift, "add",
                        lambda self, seconds: real_add(self, next(times)))
    forced_costs += [_model(1e-15), _model(1e-6)]       # fast at start-up, then slow
    kv = mxhylo.create(cost_model=True, warmup_steps=0)
    seen = []
    _train(kv, 25, after_step=lambda s: seen.append(kv.plans()["fc_weight"].strategy))
    # exchanges 1-4 are the baseline; the checks run after the exchanges of steps 5,
    # 10, 15, ...: at step 10 the last 4 (7-10) hold one slow step, at step 15 (12-15)
    # only slow ones, so from step 16 the new plan is in force (seen: after each step)
    assert seen[:14] == ["none"] * 14, seen
    assert seen[14:] == ["fc_2bit"] * 11, seen
    assert kv.stats()["cost_model"]["rechecks"] == {"drift": 1}
    assert not forced_costs                    # measured exactly twice

    forced_costs += [_model(1e-15)]
    steady = mxhylo.create(cost_model=True, warmup_steps=0)
    times = iter([0.01, 0.02, 0.015] * 10)      # noise within the factor
    _train(steady, 25)
    assert steady.stats()["cost_model"]["rechecks"] == {"drift": 0}
