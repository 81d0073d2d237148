"""The planner (kvstore.plan.make_plan): a pure function of the layers, the options, the
Trainer's facts and measured costs. No network: costs are given directly."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mxhylo.kvstore.compressors import make_compressors
from mxhylo.kvstore.cost_model import CodecCost, WireCost
from mxhylo.kvstore.plan import Costs, Plan, TrainerFacts, make_plan
from mxhylo.kvstore.policy import LayerPolicy

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

LAYERS = (("conv0_weight", (64, 3, 7, 7)),          # 9408: 2-bit by the rule
          ("bn0_gamma", (64,)),
          ("conv1_weight", (256, 256, 3, 3)),       # 2-bit (top-k at a conv_rate)
          ("conv1_bias", (256,)),
          ("embed_weight", (8, 32, 64)),            # 3-D: dense by the rule
          ("fc_weight", (1000, 2048)),              # 2-bit
          ("fc_bias", (1000,)))
COMPRESSED = ("conv0_weight", "conv1_weight", "fc_weight")
SMALL = ("bn0_gamma", "conv1_bias", "fc_bias")

CHEAP = {"conv_topk": CodecCost(1e-9, 1e-10), "fc_2bit": CodecCost(1e-9, 1e-10)}
REAL = {"conv_topk": CodecCost(5e-9, 2e-9), "fc_2bit": CodecCost(5e-9, 2e-9)}
DEAR = {"conv_topk": CodecCost(1e-6, 1e-6), "fc_2bit": CodecCost(1e-6, 1e-6)}
W, S = 4, 2


def wire(gbit):
    """A dense exchange's cost at ``gbit`` Gbit/s, W workers through S servers."""
    return WireCost(1e-4, 8.0 / (gbit * 1e9) * W / S)


SLOW = Costs(wire(1), CHEAP, momentum_s=1e-10)
FAST = Costs(wire(100), REAL, momentum_s=1e-9)
SGD = TrainerFacts("SGD", "mxnet", False, True, None, ())


def plan(costs, policy=None, trainer=SGD, server_update="auto", compress_pull="gather",
         transport="ps", servers=S, layers=LAYERS, warmup_steps=30, step_s=None):
    return make_plan(layers, policy=policy or LayerPolicy(), compress_pull=compress_pull,
                     server_update=server_update, costs=costs, trainer=trainer,
                     num_workers=W, num_servers=servers, transport=transport,
                     warmup_steps=warmup_steps, step_s=step_s)


def test_slow_wire_compresses_big_layers():
    p = plan(SLOW)
    for name in COMPRESSED:
        d = p.layer(name)
        assert d.codec != "none" and d.pull == "gather", d
        assert d.codec_s < 0.9 * d.dense_s and "predicted" in d.reason
    assert p.layer("conv1_weight").codec == "fc_2bit"
    assert p.layer("fc_weight").codec == "fc_2bit"
    assert plan(SLOW, LayerPolicy(conv_rate=0.05)).layer("conv1_weight").codec == "conv_topk"
    for name in SMALL:
        d = p.layer(name)
        assert (d.codec, d.pull) == ("none", "dense")
        assert d.reason == "below size_threshold (8192 elements)"
        assert d.payload_bytes == 4 * d.size
    assert p.layer("embed_weight").codec == "none"
    assert p.pushed_bytes < p.dense_bytes


def test_fast_wire_keeps_every_layer_dense_and_takes_the_servers_route():
    p = plan(FAST)
    assert all(d.codec == "none" and d.pull == "dense" for d in p.layers)
    for name in COMPRESSED:
        assert "predicted no faster than dense" in p.layer(name).reason
    assert (p.route, p.settled) == ("servers", True)
    assert "no layer compresses" in p.route_reason


def test_the_route_is_tried_on_the_jobs_steps_and_the_faster_kept():
    """Where a layer compresses, the route is on trial: the warm-up on the servers'
    route, then compressed steps on the workers'; the measured step seconds decide, the
    layers' decisions never change with them."""
    start = plan(SLOW)
    assert (start.route, start.settled) == ("servers", False)
    assert "the 30 warm-up steps" in start.route_reason
    assert start.workers_s is None and start.servers_s is None
    timing = plan(SLOW, step_s={"servers": 2.0})
    assert (timing.route, timing.settled, timing.servers_s) == ("workers", False, 2.0)
    assert "2000.0 ms a step on the servers' route" in timing.route_reason
    for servers_s, workers_s, want in ((2.0, 1.5, "workers"), (1.5, 2.0, "servers"),
                                       (2.0, 2.0, "workers")):     # a tie: the workers'
        p = plan(SLOW, step_s={"servers": servers_s, "workers": workers_s})
        assert (p.route, p.settled) == (want, True), (servers_s, workers_s)
        assert (p.servers_s, p.workers_s) == (servers_s, workers_s)
        assert "measured" in p.route_reason
        assert p.layers == start.layers
    no_warmup = plan(SLOW, warmup_steps=0)
    assert (no_warmup.route, no_warmup.settled) == ("workers", True)
    assert "warmup_steps=0" in no_warmup.route_reason


def test_expensive_codecs_on_a_slow_wire_stay_dense():
    p = plan(dataclasses.replace(SLOW, codecs=DEAR))
    for name in COMPRESSED:
        d = p.layer(name)
        assert d.codec == "none" and "predicted no faster than dense" in d.reason


def test_momentum_correction_is_priced_only_with_a_momentum_trainer():
    plain = plan(SLOW, trainer=dataclasses.replace(SGD, momentum=False))
    corrected = plan(SLOW)
    d0, d1 = plain.layer("fc_weight"), corrected.layer("fc_weight")
    assert d1.codec_s - d0.codec_s == pytest.approx(d1.size * SLOW.momentum_s)
    assert plain.layer("fc_bias") == corrected.layer("fc_bias")


@pytest.mark.parametrize("trainer, words", [
    (dataclasses.replace(SGD, update_on_kvstore=False), "update_on_kvstore=False"),
    (TrainerFacts("LARS", "mxhylo"), "not one of MXNet's elementwise ones"),
    (TrainerFacts("Nadam", "mxnet"), "not one of MXNet's elementwise ones"),
    (dataclasses.replace(SGD, multi_precision=True), "multi_precision"),
    (dataclasses.replace(SGD, dtypes=(("fc_weight", "float16"),)), "fc_weight is float16"),
    (None, "no Trainer"),
])
def test_a_refused_route_runs_on_the_workers_and_forcing_it_names_why(trainer, words):
    p = plan(FAST, trainer=trainer)
    assert p.route == "workers" and words in p.route_reason
    with pytest.raises(ValueError, match="server_update=True, but .*" + words.split()[-1]):
        plan(FAST, trainer=trainer, server_update=True)


def test_server_update_forces_the_route_and_no_servers_refuses():
    assert plan(FAST, server_update=False).route == "workers"
    assert plan(FAST, server_update=False).route_reason == "server_update=False"
    assert plan(SLOW, server_update=True).route == "servers"
    p = plan(SLOW, transport="horovod", servers=0)
    assert p.route == "workers" and "no servers" in p.route_reason and p.settled
    with pytest.raises(ValueError, match="no servers"):
        plan(FAST, transport="horovod", servers=0, server_update=True)
    with pytest.raises(ValueError, match="server_update"):
        plan(FAST, server_update="yes")


def test_without_costs_the_plan_is_the_policys_exactly():
    policy = LayerPolicy()
    compressors = make_compressors()
    p = plan(None, policy=policy)
    assert [d.name for d in p.layers] == [n for n, _ in LAYERS]
    for name, shape in LAYERS:
        want, d = policy.plan(name, shape), p.layer(name)
        assert (d.shape, d.size, d.codec, d.rate, d.k) == (want.shape, want.size,
                                                           want.strategy, want.rate, want.k)
        assert d.payload_bytes == compressors[want.strategy].payload_nbytes(want)
        assert d.dense_s is None and d.codec_s is None
    assert p.route == "workers" and "not measured" in p.route_reason
    assert p.workers_s is None and p.servers_s is None and p.costs is None


def test_the_pull_follows_compress_pull_and_horovod_prices_an_allgather():
    dense = plan(SLOW, compress_pull=None)
    assert {d.pull for d in dense.layers} == {"dense"}
    ps, hvd = plan(SLOW), plan(SLOW, transport="horovod", servers=0)
    assert hvd.layer("fc_weight").pull == "gather"     # the allgather, whatever the option
    assert plan(SLOW, compress_pull=None, transport="horovod", servers=0) == \
        dataclasses.replace(hvd, options=dict(hvd.options, compress_pull=None))
    assert hvd.layer("fc_weight").codec_s < ps.layer("fc_weight").codec_s


def test_a_layer_named_by_the_policy_is_not_second_guessed_by_costs():
    policy = LayerPolicy(policy={"^fc_weight$": "fc_2bit", "conv0": "fp16"})
    p = plan(FAST, policy=policy)
    fc = p.layer("fc_weight")
    assert fc.codec == "fc_2bit" and fc.codec_s > fc.dense_s
    assert fc.reason.startswith("policy '^fc_weight$'") and "not second-guessed" in fc.reason
    conv0 = p.layer("conv0_weight")            # a codec the costs did not measure
    assert conv0.codec == "fp16" and conv0.payload_bytes == 2 * conv0.size
    assert p.layer("conv1_weight").codec == "none"      # the rule's: judged by costs
    assert p.options["policy"] == {"^fc_weight$": "fc_2bit", "conv0": "fp16"}


def test_same_inputs_give_equal_plans_that_print_and_serialise():
    a, b = plan(SLOW), plan(Costs(wire(1), dict(reversed(list(CHEAP.items()))),
                                  momentum_s=1e-10))
    assert isinstance(a, Plan) and a == b
    assert a.as_dict() == b.as_dict()
    text = json.dumps(a.as_dict())
    assert json.loads(text)["route"] == "servers"
    table = a.table()
    for name, _ in LAYERS:
        assert name in table
    assert "route: servers, on trial" in table
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.route = "servers"
    with pytest.raises(KeyError):
        a.layer("nope")


def test_trainer_facts_from_a_gluon_trainer():
    import mxnet as mx
    net = mx.gluon.nn.Dense(4, in_units=3)
    net.initialize()
    facts = TrainerFacts.from_trainer(mx.gluon.Trainer(
        net.collect_params(), "sgd", {"momentum": 0.9}, update_on_kvstore=False))
    assert facts == TrainerFacts("SGD", "mxnet", False, True, False, ())
    adam = TrainerFacts.from_trainer(mx.gluon.Trainer(net.collect_params(), "adam"),
                                     momentum_correction="auto")
    assert (adam.optimizer, adam.momentum, adam.update_on_kvstore) == ("Adam", False, None)
    off = TrainerFacts.from_trainer(mx.gluon.Trainer(
        net.collect_params(), "sgd", {"momentum": 0.9}), momentum_correction=False)
    assert off.momentum is False
    with pytest.raises(ValueError, match="momentum_correction=True"):
        TrainerFacts.from_trainer(mx.gluon.Trainer(net.collect_params(), "adam"),
                                  momentum_correction=True)


def test_cli_prints_a_json_plan():
    out = subprocess.run(
        [sys.executable, "-m", "mxhylo.plan", "--model", "resnet18_v1b", "--workers", "4",
         "--servers", "2", "--gbit", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["route"] in ("workers", "servers") and doc["route_reason"]
    assert len(doc["layers"]) > 20
    assert any(d["codec"] != "none" for d in doc["layers"])
    assert doc["costs"]["wire"]["per_byte_s"] == pytest.approx(8e-9 * 2)
