"""The servers' route (kvstore.server_route): the rule that chooses it, what refuses it,
and the servers' side of it (kvstore.server), in one process. Through real servers:
tests/distributed/test_dist.py (equal to dist_sync bitwise, a new learning rate reaching the
servers, every worker taking rank 0's choice)."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mxhylo
from mxhylo.kvstore.cost_model import CodecCost, CostModel, WireCost
from mxhylo.kvstore.plan import TrainerFacts, refusal
from mxhylo.kvstore.server import RouteOptimizer, ServerState
from mxhylo.kvstore.wire import ChunkLayout


# -- the rule ----------------------------------------------------------------------------

def _route_plan(per_byte_s=1.0, encode_s=0.0):
    """The Plan a store with size_threshold=4 makes for a Trainer of one Dense layer (a
    3x4 weight planned fc_2bit, 15 float32 elements in all) when its measurement found
    a wire of ``per_byte_s`` and codecs of ``encode_s`` per element, over 2 servers;
    with the exchanges it ran to choose."""
    kv = mxhylo.create("hylo", size_threshold=4)
    trainer = _trainer(kv)
    codec = CodecCost(encode_s, 0.0)
    kv.planner.cost = CostModel(WireCost(0.0, per_byte_s),
                                {"fc_2bit": codec, "conv_topk": codec}, 1)
    # as over the parameter server: 2 servers, compressed layers' payloads gathered
    kv.transport.num_servers, kv.planner.pull = 2, "gather"
    exchanged = []
    exchange = kv.transport.exchange
    kv.transport.exchange = lambda *args: (exchanged.append(args), exchange(*args))[1]
    return kv.planner.plan_trainer(trainer), exchanged


def test_the_trainers_first_step_times_nothing_and_puts_the_route_on_trial():
    """At the Trainer's first step nothing is exchanged or timed to choose the route:
    where a layer compresses it goes on trial (kvstore.route: the job's own steps
    decide), where none does it is the servers'."""
    plan, exchanged = _route_plan()
    assert exchanged == [] and (plan.route, plan.settled) == ("servers", False)
    assert [d.codec for d in plan.layers if d.size == 12] == ["fc_2bit"]
    assert plan.workers_s is None and plan.servers_s is None
    # codecs that cost more than the bytes they save: every layer dense, the servers
    plan, exchanged = _route_plan(per_byte_s=1e-9, encode_s=1.0)
    assert exchanged == [] and (plan.route, plan.settled) == ("servers", True)
    assert all(d.codec == "none" for d in plan.layers)


def test_the_trial_times_the_engines_steps_not_pythons_run_ahead():
    """A training loop that never waits (no asnumpy() in its step) queues work in
    MXNet's engine and comes back at once; a step's start is taken only once the work
    queued before it is done, so both routes are timed as the engine runs them."""
    import time
    from mxhylo.kvstore.route import RouteTrial

    trial = RouteTrial(warmup_steps=30)
    a = mx.nd.random.uniform(shape=(1500, 1500))
    a.wait_to_read()
    clock = time.perf_counter()
    for _ in range(6):
        a = mx.nd.dot(a, a) / 1500.0        # queued: Python does not wait for it
    queued = time.perf_counter() - clock
    trial.at_step(store=None, trainer=None)    # (a servers' route step, no move yet)
    started = trial.starts[0] - clock
    clock = time.perf_counter()
    a.wait_to_read()
    left = time.perf_counter() - clock
    # the start comes after the engine's work, which took longer than queueing it
    assert left < 0.2 * started and queued < started


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
    with pytest.raises(ValueError, match="server_update=True, but the local transport has "
                                         "no servers"):
        trainer.step(1, ignore_stale_grad=True)
    kv = mxhylo.create("hylo")          # 'auto': the workers, and stats() says why
    trainer = _trainer(kv)
    for p in trainer._params:
        p.grad()[:] = 1.0
    trainer.step(1, ignore_stale_grad=True)
    assert trainer._kvstore is kv and not trainer._update_on_kvstore
    route = kv.stats()["route"]
    assert (route["route"], route["reason"]) == ("workers",
                                                 "the local transport has no servers")


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
    def refused(trainer):
        return refusal(TrainerFacts.from_trainer(trainer), 2, "ps")
    assert match in refused(trainer)
    assert refused(_trainer(kv, "adam")) is None
    assert refused(_trainer(kv, "nag", {"momentum": 0.9})) is None


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


def test_a_changed_optimizer_waits_for_the_last_steps_pushes(monkeypatch):
    """The servers take a new optimizer at once (a command), while the last step's
    pushes are engine operations that may not have left: the route waits for them
    before it sends a changed setting (a last, smaller batch's rescale_grad), and
    not when nothing changed."""
    from mxhylo.kvstore import server_route

    events = []

    class Keys:
        layouts_sent = True
        state_keys = None

        def send_route(self, route):
            events.append(("sent", route.optimizer.rescale_grad))

    monkeypatch.setattr(server_route.mx.nd, "waitall", lambda: events.append("waited"))
    route = server_route.ServerRoute(Keys(), [])
    optimizer = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1 / 32)
    route.set_optimizer(optimizer)               # the first: no step before it
    route.sync_optimizer(optimizer)              # unchanged: nothing sent, no wait
    optimizer.rescale_grad = 1 / 2               # a last batch of 2
    route.sync_optimizer(optimizer)
    assert events == [("sent", 1 / 32), "waited", ("sent", 1 / 2)]
