"""kvstore.cost_model: payload sizes known before encoding, the fit, the rule."""
import mxnet as mx
import numpy as np
import pytest

from mxhylo.kvstore.compressors import make_compressors
from mxhylo.kvstore.cost_model import CodecCost, CostModel, WireCost, time_codec
from mxhylo.kvstore.memory import ResidualMemory
from mxhylo.kvstore.policy import LayerPolicy

SHAPES = {"conv_topk": [(1, 1, 1, 1), (3, 5, 3, 3), (17, 7, 1, 1), (64, 3, 5, 5)],
          "fc_2bit": [(1, 1), (3, 5), (17, 33), (7, 16), (1000, 13)],
          "fp16": [(1,), (5, 7), (3, 2, 2)],
          "none": [(1,), (4, 9), (2, 3, 5)]}


@pytest.mark.parametrize("strategy", sorted(SHAPES))
def test_payload_nbytes_equals_what_encode_produces(strategy):
    policy = LayerPolicy(size_threshold=1, conv_rate=0.3)
    codec = make_compressors()[strategy]
    rng = np.random.RandomState(3)
    for shape in SHAPES[strategy]:
        plan = policy.plan_as("w", shape, strategy)
        grad = mx.nd.array(rng.normal(size=shape).astype(np.float32))
        payload = codec.encode(plan, grad, ResidualMemory())
        assert codec.payload_nbytes(plan) == payload.nbytes, (strategy, shape)


def test_wire_fit_recovers_a_line_and_refuses_one_size():
    sizes = [65536, 1 << 20, 4 << 20]
    fit = WireCost.fit(sizes, [0.002 + s * 8e-9 for s in sizes])
    assert fit.latency_s == pytest.approx(0.002, rel=1e-6)
    assert fit.per_byte_s == pytest.approx(8e-9, rel=1e-6)
    assert WireCost.fit([1, 2], [5.0, 1.0]).per_byte_s > 0     # noise never gives < 0
    with pytest.raises(ValueError, match="two sizes"):
        WireCost.fit([100, 100], [1.0, 2.0])


def _model(per_byte, encode_s=2e-9, pull="gather", workers=4):
    codecs = {"conv_topk": CodecCost(encode_s, 1e-10), "fc_2bit": CodecCost(encode_s, 1e-9)}
    return CostModel(WireCost(1e-4, per_byte), codecs, workers, pull)


def test_slow_network_compresses_fast_network_stays_dense():
    policy = LayerPolicy()
    fc = policy.plan("fc", (4096, 4096))
    conv = policy.plan("conv", (512, 512, 3, 3))
    nbytes = {p.name: make_compressors()[p.strategy].payload_nbytes(p) for p in (fc, conv)}
    slow = _model(per_byte=2 * 8 / 1e9)          # 1 Gbit/s, W/S = 2
    fast = _model(per_byte=1 / 20e9)             # faster than the codecs
    for plan in (fc, conv):
        assert slow.decide(plan, nbytes[plan.name]) == plan.strategy
        assert fast.decide(plan, nbytes[plan.name]) == "none"
    p = fast.decisions["fc"]
    assert p.codec_s > p.dense_s and p.strategy == "none"
    assert slow.decide(policy.plan("b", (10,)), 40) == "none"        # never compressed


def test_prediction_formula_for_each_pull():
    plan = LayerPolicy().plan("fc", (1024, 1024))
    n, p = plan.size, 4 * (plan.size // 16) + 4
    wire = WireCost(0.001, 1e-8)
    codecs = {"fc_2bit": CodecCost(3e-9, 2e-9)}
    for pull, down, decodes in (("gather", 4 * p, 4), (None, 4 * n, 0), ("layer", p, 1),
                                ("allgather", 2 * p, 4)):
        pred = CostModel(wire, codecs, 4, pull).predict(plan, p)
        assert pred.dense_s == pytest.approx(0.001 + 4 * n * 1e-8)
        assert pred.codec_s == pytest.approx(0.001 + max(p, down) * 1e-8
                                             + n * (3e-9 + decodes * 2e-9))


def test_momentum_correction_is_priced_on_compressed_layers():
    """Under a momentum-SGD Trainer a compressed layer also pays momentum correction's
    passes (n * momentum_s): enough of them turn a marginal layer dense."""
    plan = LayerPolicy().plan("fc", (1024, 1024))
    n, p = plan.size, 4 * (plan.size // 16) + 4
    model = CostModel(WireCost(0.001, 1e-9), {"fc_2bit": CodecCost(1e-9, 2e-10)}, 4,
                      "gather", momentum_s=1.5e-9)
    plain, with_mc = model.predict(plan, p), model.predict(plan, p, momentum=True)
    assert with_mc.codec_s == pytest.approx(plain.codec_s + n * 1.5e-9)
    assert with_mc.dense_s == plain.dense_s
    assert plain.strategy == "fc_2bit" and with_mc.strategy == "none"


def test_time_momentum_gives_a_positive_per_element_cost():
    from mxhylo.kvstore.cost_model import time_momentum

    assert 0 < time_momentum(elements=1 << 16, repeats=1) < 1e-6


def test_model_round_trips_through_an_array():
    m = _model(3e-9)
    m.momentum_s = 4e-10
    strategies = ("conv_topk", "fc_2bit")
    back = CostModel.from_array(m.to_array(strategies), strategies, 4, "gather")
    assert back.wire == m.wire and back.codecs == m.codecs and back.momentum_s == 4e-10
    with pytest.raises(ValueError, match="values"):
        CostModel.from_array(np.zeros(6), strategies, 4, "gather")


def test_time_codec_gives_positive_per_element_costs():
    policy = LayerPolicy()
    for strategy in ("conv_topk", "fc_2bit"):
        cost = time_codec(policy, make_compressors()[strategy], repeats=1)
        assert 0 < cost.encode_s < 1e-6 and 0 < cost.decode_s < 1e-6, (strategy, cost)
