"""The servers' route (kvstore.server_route): the rule that chooses it, what refuses it,
and the servers' side of it (kvstore.server), in one process. Through real servers:
tests/test_dist.py (equal to dist_sync bitwise, a new learning rate reaching the
servers, every worker taking rank 0's choice)."""
import contextlib

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mxhylo
from mxhylo.kvstore import cost_model, hylo as hylo_store
from mxhylo.kvstore.cost_model import (CodecCost, CostModel, LinkCosts, RouteChoice,
                                      RouteCosts, WireCost)
from mxhylo.kvstore.server import RouteOptimizer, ServerState
from mxhylo.kvstore.wire import ChunkLayout


# -- the rule ----------------------------------------------------------------------------

def test_route_rule_weighs_the_update_where_it_runs():
    # the update: on every worker in hylo's route, shared by the servers in theirs
    costs = RouteCosts(dense_s=1.0, hylo_s=0.5, update_s=0.4, servers=2)
    assert costs.servers_s == pytest.approx(1.2)
    assert costs.workers_s == pytest.approx(0.9)
    assert costs.route() == "workers"                       # 0.9 < 0.9 * 1.2
    # hylo's exchange faster, but not by the margin once the update is counted
    assert RouteCosts(1.0, 0.8, 0.2, 2).route() == "servers"    # 1.0 vs 0.9 * 1.1
    # a tie goes to the servers (the dense setup)
    assert RouteCosts(1.0, 1.0, 0.0, 2).route() == "servers"
    assert RouteCosts(1.0, 0.5, 0.0, 2).route(margin=0.6) == "servers"
    # close: the faster within 30% of the slower (1.2 vs 0.9), so measured again
    assert costs.close() and not RouteCosts(2.5, 0.9, 0.15, 2).close()
    choice = RouteChoice("workers", "measured", costs).as_dict()
    assert choice["route"] == "workers" and choice["servers_s"] == pytest.approx(1.2)
    assert RouteChoice("workers", "server_update=False").as_dict() == {
        "route": "workers", "reason": "server_update=False"}


def _timed_routes(dense, hylo, links=None):
    """RouteCosts the store's _time_routes makes when its timed exchanges give, round
    by round, ``dense`` and ``hylo`` seconds (a stand-in transport of 2 servers, whose
    cost model has ``links``: LinkCosts or None), and the warm-up flags each route's
    timer was called with."""
    kv = mxhylo.create("hylo")
    trainer = _trainer(kv)
    kv.cost = CostModel(WireCost(0.0, 1e-9), {}, 1, links=links)
    dense, hylo, warmups = iter(dense), iter(hylo), {"dense": [], "hylo": []}

    def time_dense(shapes, warmup=True):
        warmups["dense"].append(warmup)
        return next(dense)

    @contextlib.contextmanager
    def probe(names, shapes, trainer):
        def timed(warmup):
            warmups["hylo"].append(warmup)
            return next(hylo)
        yield timed
    kv.transport.time_dense, kv._hylo_probe = time_dense, probe
    kv.transport.num_servers = 2
    return kv._time_routes(trainer, 0.0), warmups


def test_routes_are_timed_again_while_close():
    # far apart: one round
    costs, warmups = _timed_routes([2.5], [0.9])
    assert costs.rounds == 1
    assert (costs.dense_s, costs.hylo_s) == pytest.approx((2.5, 0.9))   # (float32)
    assert warmups == {"dense": [True], "hylo": [True]}
    # close (3.1 vs 2.5): a second round, still close: a third, the medians decide
    costs, warmups = _timed_routes([3.1, 2.4, 2.3, 9.9], [2.5, 2.6, 2.4, 9.9])
    assert costs.rounds == 3 and warmups == {"dense": [True, False, False],
                                             "hylo": [True, False, False]}
    assert (costs.dense_s, costs.hylo_s) == pytest.approx((2.4, 2.5))
    assert costs.route() == "servers"      # the first round alone said 'workers'
    assert RouteCosts(3.1, 2.5, costs.update_s, 2).route() == "workers"
    # close, then apart: two rounds
    costs, _ = _timed_routes([3.0, 9.0, 9.0], [2.5, 1.0, 1.0])
    assert costs.rounds == 2 and costs.route() == "workers"


def test_dense_route_is_not_timed_where_its_floor_loses():
    """Hylo's route is timed first; where it beats the links' floor of a dense exchange
    (LinkCosts.dense_floor_s) by the margin, the dense exchange is not timed at all."""
    links = LinkCosts((WireCost(0.0, 0.03), WireCost(0.0, 0.06)), 0.0)
    # the trainer's parameters: 15 float32 (60 bytes); the links carry 1/0.03 + 1/0.06
    # bytes per second together, both ways at once: no dense exchange under 0.6 s
    assert links.dense_floor_s(60) == pytest.approx(0.6)
    costs, warmups = _timed_routes([], [0.3], links)
    assert warmups == {"dense": [], "hylo": [True]}
    assert costs.dense_bound and costs.rounds == 1 and costs.route() == "workers"
    assert costs.dense_s == pytest.approx(0.6) and costs.hylo_s == pytest.approx(0.3)
    assert RouteChoice("workers", "measured", costs).as_dict()["dense_bound"]
    # hylo's exchange not clearly below the floor: the dense one is timed, as before
    costs, warmups = _timed_routes([2.5], [0.9], links)
    assert warmups == {"dense": [True], "hylo": [True]}
    assert not costs.dense_bound and costs.dense_s == pytest.approx(2.5)
    # without the links' figures (one server, Horovod, cost model off): timed
    costs, warmups = _timed_routes([2.5], [0.3])
    assert warmups == {"dense": [True], "hylo": [True]} and not costs.dense_bound


def _route_choice(monkeypatch, available_bytes, per_byte_s=1.0, encode_s=0.0, cost=True):
    """The RouteChoice a store with size_threshold=4 makes for a Trainer of one Dense
    layer (a 3x4 weight planned fc_2bit, 15 float32 elements in all) when its host has
    ``available_bytes`` of memory available, its cost model a wire of ``per_byte_s``
    and codecs of ``encode_s`` per element (cost=False: none), and 2 servers; with
    whether the probes ran (the stand-ins record it)."""
    monkeypatch.setattr(hylo_store, "available_memory_bytes", lambda: available_bytes)
    kv = mxhylo.create("hylo", size_threshold=4)
    trainer = _trainer(kv)
    codec = CodecCost(encode_s, 0.0)
    kv.cost = CostModel(WireCost(0.0, per_byte_s), {"fc_2bit": codec, "conv_topk": codec},
                        1) if cost else None
    probed = []

    def time_dense(shapes, warmup=True):
        probed.append("dense")
        return 2.0

    @contextlib.contextmanager
    def probe(names, shapes, trainer):
        probed.append("hylo")
        yield lambda warmup: 1.0
    kv.transport.time_dense, kv._hylo_probe = time_dense, probe
    kv.transport.num_servers = 2
    return kv._choose_route(trainer), probed


def test_route_is_predicted_where_the_probes_would_not_fit_in_memory(monkeypatch):
    """The probes hold ROUTE_PROBE_BYTES_PER_ELEMENT per parameter element on every
    worker at once: where rank 0's host has not that much to spare (ROUTE_MEMORY_SHARE)
    nothing is probed, and the cost model's sums over the layers decide; hylo's route
    only where its own state fits too. (vgg16's probes, 4 workers on one 24 GiB
    machine, ran it out of memory.)"""
    share = hylo_store.ROUTE_MEMORY_SHARE
    probes = hylo_store.ROUTE_PROBE_BYTES_PER_ELEMENT * 15       # one worker
    state = hylo_store.ROUTE_WORKERS_BYTES_PER_ELEMENT * 15
    assert state < probes
    # room for the probes: timed, as before
    choice, probed = _route_choice(monkeypatch, probes / share * 1.01)
    assert choice.reason == "measured" and probed == ["hylo", "dense"]
    assert choice.route == "workers" and choice.costs.rounds == 1   # 1.0 s against 2.0
    # no room for the probes, room for hylo's route; a slow wire: compressing pays
    tight = probes / share * 0.99
    choice, probed = _route_choice(monkeypatch, tight)
    assert probed == [] and choice.route == "workers"
    assert choice.reason.startswith("predicted: the route probes would need")
    assert choice.costs.predicted and choice.costs.rounds == 0
    assert choice.costs.dense_s == pytest.approx(4 * 15 * 1.0)          # 60 bytes dense
    assert choice.costs.hylo_s < 0.5 * choice.costs.dense_s
    assert choice.as_dict()["predicted"] is True
    # codecs that cost more than the bytes they save: every layer dense, the servers
    choice, probed = _route_choice(monkeypatch, tight, per_byte_s=1e-9, encode_s=1.0)
    assert probed == [] and choice.route == "servers"
    assert choice.costs.hylo_s == pytest.approx(choice.costs.dense_s)
    # no room for hylo's route either: the servers, though compressing would pay
    choice, probed = _route_choice(monkeypatch, state / share * 0.99)
    assert probed == [] and choice.route == "servers"
    assert "hylo's route would hold" in choice.reason and choice.costs.route() == "workers"
    # no cost model to predict by: the servers (dist_sync's exchange, the lighter)
    choice, probed = _route_choice(monkeypatch, tight, cost=False)
    assert probed == [] and choice.route == "servers" and choice.costs is None
    assert "no cost model" in choice.reason


def test_available_memory_is_read_from_the_host():
    available = cost_model.available_memory_bytes()
    assert available > 0
    with open("/proc/meminfo") as f:
        total = [float(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:")][0]
    assert available <= total


# -- what refuses the servers' route ------------------------------------------------------

def _trainer(kv, optimizer="sgd", params=None, dtype="float32", **trainer_kwargs):
    net = gluon.nn.Dense(3, in_units=4, dtype=dtype)
    net.initialize()
    if isinstance(optimizer, str):
        params = params or {"learning_rate": 0.1}
    return gluon.Trainer(net.collect_params(), optimizer, params, kvstore=kv,
                         **trainer_kwargs)


def test_in_one_process_there_are_no_servers_to_update_on():
    kv = mxhylo.create("hylo", server_update=True)
    trainer = _trainer(kv)
    net_params = list(trainer._params)
    for p in net_params:
        p.grad()[:] = 1.0
    with pytest.raises(ValueError, match="server_update=True, but LocalTransport has no servers"):
        trainer.step(1, ignore_stale_grad=True)
    kv = mxhylo.create("hylo")          # 'auto': the workers, and stats() says why
    trainer = _trainer(kv)
    for p in trainer._params:
        p.grad()[:] = 1.0
    trainer.step(1, ignore_stale_grad=True)
    assert trainer._kvstore is kv and not trainer._update_on_kvstore
    assert kv.stats()["route"] == {"route": "workers",
                                   "reason": "LocalTransport has no servers"}


@pytest.mark.parametrize("case, match", [
    ("update_on_kvstore", "update_on_kvstore=False"),
    ("lars", "not one of MXNet's elementwise"),
    ("nadam", "not one of MXNet's elementwise"),
    ("multi_precision", "multi_precision"),
    ("float16", "float16, not float32"),
])
def test_what_keeps_the_optimizer_on_the_workers(case, match):
    kv = mxhylo.create("hylo")
    kv.transport.num_servers = 2        # as if over the parameter server
    if case == "update_on_kvstore":
        trainer = _trainer(kv, update_on_kvstore=False)
    elif case == "lars":
        trainer = _trainer(kv, mx.optimizer.LARS(learning_rate=0.1))
    elif case == "nadam":
        trainer = _trainer(kv, "nadam")
    elif case == "multi_precision":
        trainer = _trainer(kv, params={"learning_rate": 0.1, "multi_precision": True})
    else:
        trainer = _trainer(kv, dtype="float16")
    assert match in kv._route_refused(trainer)
    assert kv._route_refused(_trainer(kv, "adam")) is None
    assert kv._route_refused(_trainer(kv, "nag", {"momentum": 0.9})) is None


def test_server_update_option_is_checked():
    with pytest.raises(ValueError, match="server_update must be"):
        mxhylo.create("hylo", server_update="yes")


# -- the servers' side --------------------------------------------------------------------

def _sgd_step(w, mom, g, lr, wd, momentum):
    """MXNet's sgd_mom_update in float32 numpy."""
    mom[:] = momentum * mom - lr * (g + wd * w)
    w += mom


def test_server_runs_the_trainers_optimizer_with_multipliers_and_keeps_state():
    rng = np.random.RandomState(0)
    server = ServerState()
    server.layouts = {5: ("a", ChunkLayout("update", 0, 6, 6)),
                      9: ("b", ChunkLayout("update", 6, 10, 4))}
    sgd = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    # key 5: wd_mult 0 (Gluon's no-wd parameters); key 9: lr_mult 2
    server.set_route(RouteOptimizer(sgd, {5: (1.0, 0.0), 9: (2.0, 1.0)}))
    weights = {5: rng.normal(size=6).astype(np.float32),
               9: rng.normal(size=4).astype(np.float32)}
    stored = {k: mx.nd.array(w) for k, w in weights.items()}
    moms = {k: np.zeros_like(w) for k, w in weights.items()}
    mults = {5: (1.0, 0.0), 9: (2.0, 1.0)}
    for step in range(3):
        if step == 2:   # a new learning rate mid-run: momentum and counts carry on
            server.set_route(RouteOptimizer(mx.optimizer.SGD(
                learning_rate=0.0, momentum=0.9, wd=0.01), mults))
        lr = 0.0 if step == 2 else 0.1
        for key in (5, 9):
            g = rng.normal(size=weights[key].shape).astype(np.float32)
            server.aggregate_into(key, stored[key], mx.nd.array(g))
            _sgd_step(weights[key], moms[key], g, np.float32(lr * mults[key][0]),
                      np.float32(0.01 * mults[key][1]), np.float32(0.9))
            np.testing.assert_allclose(stored[key].asnumpy(), weights[key], rtol=1e-6,
                                       atol=1e-7, err_msg="step %d key %d" % (step, key))
    assert server.optimizer.num_update == 3         # counts went on across the new one
    assert sorted(server.optimizer_states) == [5, 9]
