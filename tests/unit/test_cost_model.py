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
    for pull, down, decodes in (("gather", 4 * p, 4), (None, 4 * n, 0),
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


# -- each link alone (LinkCosts): where keys go, when a layer is cut ----------------------

def _links(*per_byte, message_s=1e-3, latency_s=1e-3):
    from mxhylo.kvstore.cost_model import LinkCosts
    return LinkCosts(tuple(WireCost(latency_s, b) for b in per_byte), message_s)


def test_link_fit_recovers_each_link_and_the_message_cost():
    from mxhylo.kvstore.cost_model import LinkCosts
    sizes = [65536, 1 << 20]
    seconds = [[0.001 + s * 4e-9 for s in sizes], [0.002 + s * 1.6e-8 for s in sizes]]
    links = LinkCosts.fit(sizes, seconds, one_key_s=0.003, many_keys_s=0.010, keys=8)
    assert [l.latency_s for l in links.links] == pytest.approx([0.001, 0.002])
    assert [l.per_byte_s for l in links.links] == pytest.approx([4e-9, 1.6e-8])
    assert links.message_s == pytest.approx(0.001)
    # more keys measured faster than one (noise): no negative message cost
    assert LinkCosts.fit(sizes, seconds, 0.003, 0.002, 8).message_s == 0.0


def test_links_within_tolerance_place_as_equal_slower_ones_take_fewer_bytes():
    from mxhylo.kvstore.cost_model import LINK_TOLERANCE
    assert _links(1e-9, 1.2e-9).placement_weights() == (1e-9, 1e-9)
    slow = 2.5 * LINK_TOLERANCE * 1e-9
    assert _links(1e-9, slow).placement_weights() == (1e-9, slow)


def test_a_layer_is_cut_where_the_bytes_saved_outweigh_the_messages():
    from mxhylo.kvstore.cost_model import MIN_SPLIT_ELEMENTS
    # 2 servers, 1 ms a message, 4 ns a byte: cutting b bytes saves b * 4e-9 / 2 s and
    # costs 1 ms, so from 2 * 1e-3 / 4e-9 = 500 KB = 125000 float32 values
    assert _links(4e-9, 4e-9).split_min_elements() == 125000
    # a slower network: cut sooner; cheaper messages: cut sooner; 4 servers: later
    assert _links(4e-8, 4e-8).split_min_elements() == 12500
    assert _links(4e-9, 4e-9, message_s=1e-4).split_min_elements() == 12500
    assert _links(*[4e-9] * 4).split_min_elements() == 250000
    assert _links(1e-6, 1e-6, message_s=1e-6).split_min_elements() == MIN_SPLIT_ELEMENTS


def test_links_travel_with_rank0s_numbers_and_are_optional():
    codecs = {"conv_topk": CodecCost(1e-9, 1e-10), "fc_2bit": CodecCost(2e-9, 1e-9)}
    strategies = ("conv_topk", "fc_2bit")
    for links in (None, _links(3e-9, 5e-9, message_s=7e-4)):
        model = CostModel(WireCost(1e-3, 2e-9), codecs, 4, "gather", momentum_s=1e-10,
                          links=links)
        back = CostModel.from_array(model.to_array(strategies), strategies, 4, "gather")
        assert back.links == links and back.wire == model.wire
        assert back.codecs == codecs and back.momentum_s == model.momentum_s
    with pytest.raises(ValueError, match="cost model array"):
        CostModel.from_array(model.to_array(strategies)[:-1], strategies, 4, "gather")


class _NoServers:
    """What KeyTable asks of MXNet's store while it only places keys."""
    rank, num_workers = 0, 1

    def init(self, *args):
        pass


def _placed(links, sizes, servers=2):
    from mxhylo.kvstore.ps_keys import KeyTable
    table = KeyTable(_NoServers(), servers, 1 << 20, 1 << 18, 1 << 16, None)
    if links is not None:
        table.use_links(links, 1234)
        assert table.split_elements == 1234
    placed = [table._place(n)[1] for n in sizes]
    return placed, [sum(n for n, s in zip(sizes, placed) if s == k) for k in range(servers)]


def test_keys_go_where_they_finish_first():
    sizes = [4 << 20, 1 << 20, 3 << 20, 2 << 20, 1 << 20, 5 << 20, 64 << 10] * 4
    by_load, _ = _placed(None, sizes)
    # equal links (within tolerance): exactly the placement by load alone
    assert _placed(_links(1e-9, 1.1e-9), sizes)[0] == by_load
    # a link 4x slower takes about a fifth of the bytes
    _, loads = _placed(_links(1e-9, 4e-9), sizes)
    assert 0.12 < loads[1] / sum(loads) < 0.28, loads
    _, loads = _placed(_links(4e-9, 1e-9), sizes)
    assert 0.12 < loads[0] / sum(loads) < 0.28, loads
