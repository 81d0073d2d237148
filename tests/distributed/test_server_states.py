"""trainer.save_states and load_states where the Trainer's optimizer runs on the
parameter servers (kvstore.server_route): the servers' optimizer state is saved, and
loaded back so that training goes on bitwise as if it had never stopped; the file is
Gluon's own, so it also loads where the optimizer runs on the workers, and back.

Each phase is a job of 2 workers and 2 servers (``python -m mxhylo.launch``, a free
port, a timeout on the job) running this file as the workers' script; MXNet's big-array
bound is lowered so that on the servers' route the first layer's weight (1280
elements) is cut in one piece per server, as a large parameter would be:

    python tests/distributed/test_server_states.py PHASE DIR

PHASE (below, ``PHASES``) says what the workers do; they train a Dense(64) + Dense(10)
net with SGD (momentum 0.9) on data fixed by the step and the worker's rank, and
write DIR/PHASE.RANK.npz (the parameters after each step, in their order) and
DIR/PHASE.RANK.json (what they saw).
"""
import json
import os
import pickle
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.abspath(__file__)
BATCH = 8           # samples per worker and step
FEATURES = 20
JOB_TIMEOUT_S = 60  # the launcher's bound on one phase's job
BIGARRAY_BOUND = 1000   # elements from which the servers' route cuts a parameter

# phase -> (where the optimizer runs, parameters and states to start from (None: a
# fresh net), steps trained, {after step: (parameters file, states file) rank 0 saves})
PHASES = {
    # steps 1-5 on the servers; a checkpoint after step 3
    "servers": ("servers", None, range(1, 6), {3: ("p3.params", "s3.states")}),
    # steps 4-5 on the servers from that checkpoint
    "servers_resumed": ("servers", ("p3.params", "s3.states"), range(4, 6), {}),
    # the same on the workers (Gluon's own load_states reads the servers' file); a
    # checkpoint after step 4 in Gluon's own way
    "workers_resumed": ("workers", ("p3.params", "s3.states"), range(4, 6),
                        {4: ("p4.params", "w4.states")}),
    # step 5 on the servers from the workers' checkpoint
    "servers_from_workers": ("servers", ("p4.params", "w4.states"), range(5, 6), {}),
}


# -- the workers' script ------------------------------------------------------------------

def _batch(step, rank):
    """Inputs (BATCH, FEATURES) and labels (BATCH,) of worker ``rank`` at ``step``."""
    rng = np.random.RandomState(1000 * step + rank)
    return (rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
            rng.randint(0, 10, size=BATCH).astype(np.float32))


def _worker(phase, folder):
    import mxnet as mx
    from mxnet import autograd, gluon

    import mxhylo
    where, start, steps, saves = PHASES[phase]
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, in_units=FEATURES, activation="relu"),
            gluon.nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier())
    if start is not None:
        net.load_parameters(os.path.join(folder, start[0]))
    options = {"server_update": True} if where == "servers" else \
        {"server_update": False, "policy": {".*": "none"}}
    kv = mxhylo.create("dist_sync_hylo", cost_model=False, **options)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4},
                            kvstore=kv)
    report = {"errors": {}}
    if start is not None:
        if where == "servers":
            # files that do not fit: every worker gets the same clear error, and the
            # job goes on (nothing collective ran)
            for bad in ("other_model.states", "not_states.states"):
                try:
                    trainer.load_states(os.path.join(folder, bad))
                    report["errors"][bad] = None
                except ValueError as err:
                    report["errors"][bad] = str(err)
        trainer.load_states(os.path.join(folder, start[1]))
        report["optimizer_after_load"] = type(trainer._optimizer).__name__
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    params = list(net.collect_params().values())
    arrays = {}
    for step in steps:
        x, y = _batch(step, kv.rank)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        trainer.step(BATCH)
        for i, p in enumerate(params):
            arrays["step%d/%d" % (step, i)] = p.data().asnumpy()
        if step in saves and kv.rank == 0:      # rank 0 alone, as users do
            net.save_parameters(os.path.join(folder, saves[step][0]))
            trainer.save_states(os.path.join(folder, saves[step][1]))
    report.update(rank=kv.rank, update_on_kvstore=bool(trainer._update_on_kvstore),
                  route=kv.stats()["route"], shapes=[p.shape for p in trainer._params])
    if kv._servers is not None:     # each parameter's pieces' servers
        report["servers"] = [[c.layout.server for c in kv._servers._chunks[i]]
                             for i in range(len(trainer._params))]
    np.savez(os.path.join(folder, "%s.%d.npz" % (phase, kv.rank)), **arrays)
    with open(os.path.join(folder, "%s.%d.json" % (phase, kv.rank)), "w") as f:
        json.dump(report, f)


# -- the tests ----------------------------------------------------------------------------

def _run(folder, phase):
    """Run ``phase``'s job; ([per rank its parameters by 'stepS/I'], [per rank its
    report]). The launcher ends the job's processes; any it left behind (found by
    ``folder``, a fresh directory on every process's command line) are killed by pid."""
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout",
           str(JOB_TIMEOUT_S), "--env", "MXNET_KVSTORE_BIGARRAY_BOUND:%d" % BIGARRAY_BOUND,
           sys.executable, HERE, phase, str(folder)]
    # (imported here: this file is also the job's script, run without tests/ on its path)
    from proc_helpers import run_bounded_job
    rc, out = run_bounded_job(cmd, folder, JOB_TIMEOUT_S, cwd=ROOT)
    assert rc == 0, "phase %s failed:\n%s" % (phase, out[-4000:])
    arrays = [dict(np.load(os.path.join(folder, "%s.%d.npz" % (phase, r)))) for r in (0, 1)]
    reports = []
    for r in (0, 1):
        with open(os.path.join(folder, "%s.%d.json" % (phase, r))) as f:
            reports.append(json.load(f))
    return arrays, reports


def _same(got, want, steps, exact=True):
    for key in want:
        if int(key.split("/")[0][4:]) in steps:
            if exact:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
            else:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           err_msg=key)


WINDOW = 4      # elements of the in-process tests' mailbox and load windows


def _server(optimizer):
    """A kvstore.server.ServerState (this process's, not a server's) running
    ``optimizer`` on 'update' keys 5 (6 elements) and 7 (3) of server 0 and 9 (2) of
    server 1, with server 0's mailbox key 20 and load key 21 (windows of WINDOW
    elements); and {key: its stored array}."""
    import mxnet as mx
    from mxhylo.kvstore.server import RouteOptimizer, ServerState
    from mxhylo.kvstore.wire import ChunkLayout
    sizes = {5: 6, 7: 3, 9: 2, 20: WINDOW, 21: 1 + WINDOW}
    server = ServerState()
    server.layouts = {k: ("w%d" % k, ChunkLayout("update", 0, n, n, server=int(k == 9)))
                      for k, n in sizes.items() if k < 20}
    server.layouts[20] = ("mailbox", ChunkLayout("mailbox", 0, WINDOW, WINDOW))
    server.layouts[21] = ("load", ChunkLayout("load", 0, 1 + WINDOW, 1 + WINDOW))
    server.set_route(RouteOptimizer(optimizer, {5: (1.0, 1.0), 7: (1.0, 1.0),
                                                9: (1.0, 1.0)}))
    return server, {k: mx.nd.zeros((n,)) for k, n in sizes.items()}


def _read(server, stored, total):
    """Server 0's state stream, read a mailbox window at a time as a worker does, one
    window past its ``total`` elements."""
    got = []
    for offset in range(0, total + WINDOW, WINDOW):
        server.fill_mailbox(20, offset)
        got.append(stored[20].asnumpy())
    return np.concatenate(got)


def test_state_stream_windows_cover_every_element_once():
    """kvstore.server.stream_window, on random streams and windows: the windows of a
    stream place each of its elements once, where state_stream says it is."""
    from mxhylo.kvstore.server import state_stream, stream_window
    rng = np.random.RandomState(0)
    for _ in range(50):
        keys = sorted(rng.choice(100, rng.randint(1, 5), replace=False))
        entries = [(int(k), int(rng.randint(1, 9)), int(rng.randint(0, 3))) for k in keys]
        parts = state_stream(entries)
        total = parts[-1].start + parts[-1].size
        assert total == sum(1 + n * m for _, n, m in entries)
        window = int(rng.randint(1, 12))
        seen = np.zeros(total, int)
        for lo in range(0, total, window):
            for part, src, dst, n in stream_window(parts, lo, lo + window):
                assert src >= 0 and src + n <= part.size and dst >= 0 and dst + n <= window
                assert lo + dst == part.start + src
                seen[lo + dst:lo + dst + n] += 1
        assert (seen == 1).all()


def test_server_state_is_read_and_loaded_a_window_at_a_time(monkeypatch):
    """The server's side (kvstore.server) in this process, with Adam (two state
    arrays): the updates are bitwise those of MXNet's own Adam on the whole weights;
    read through a mailbox of 4 values, server 0's stream is [count, mean, var] of key
    5, then of key 7 (key 9 is server 1's), zeros past its end; loaded in windows of 4,
    before the state exists or over one, the steps go on bitwise from the loaded state
    and counts."""
    import mxnet as mx
    monkeypatch.setenv("DMLC_NUM_WORKER", "2")
    rng = np.random.RandomState(3)
    w0 = {k: rng.normal(size=n).astype(np.float32) for k, n in ((5, 6), (7, 3), (9, 2))}
    grads = [{k: rng.normal(size=w.size).astype(np.float32) for k, w in w0.items()}
             for _ in range(5)]

    def adam():
        return mx.optimizer.Adam(learning_rate=0.01, wd=1e-3)

    reference = adam()
    weights = {k: mx.nd.array(w) for k, w in w0.items()}
    states = {k: reference.create_state(k, w) for k, w in weights.items()}
    want = []       # after each step: (weights, server 0's stream)
    for t, g in enumerate(grads):
        for k in (5, 7, 9):
            reference.update(k, weights[k], mx.nd.array(g[k]), states[k])
        stream = np.concatenate([np.concatenate([[t + 1.0], states[k][0].asnumpy(),
                                                 states[k][1].asnumpy()]) for k in (5, 7)])
        want.append(({k: w.asnumpy() for k, w in weights.items()}, stream))
    total = want[0][1].size             # 1 + 2 * 6, then 1 + 2 * 3

    server, stored = _server(adam())
    for k in (5, 7, 9):
        stored[k][:] = w0[k]
    server.aggregate_into(20, stored[20], mx.nd.zeros((WINDOW,)))     # the register
    assert not _read(server, stored, total).any()   # no update yet: counts 0, state 0
    for t in range(5):
        for k in (5, 7, 9):
            server.aggregate_into(k, stored[k], mx.nd.array(grads[t][k]))
            np.testing.assert_array_equal(stored[k].asnumpy(), want[t][0][k])
        got = _read(server, stored, total)
        np.testing.assert_array_equal(got[:total], want[t][1])
        assert not got[total:].any()

    # loaded after step 2 (rank 0's values, each count + 1; the other worker's zeros
    # add nothing), before the state exists, then over an existing state
    loaded = want[1][1].copy()
    loaded[[0, 13]] += 1
    for existing in (False, True):
        server, stored = _server(adam())
        if existing:
            for k in (5, 7, 9):
                stored[k][:] = rng.normal(size=stored[k].size).astype(np.float32)
                server.aggregate_into(k, stored[k], mx.nd.array(grads[0][k]))
        for k in (5, 7, 9):
            stored[k][:] = want[1][0][k]        # (the weights come with the parameters)
        for r, offset in enumerate(range(0, total, WINDOW)):
            push = np.zeros(1 + WINDOW, np.float32)
            push[0] = 2 * (r + 1)               # both workers' round + 1, summed
            part = loaded[offset:offset + WINDOW]
            push[1:1 + part.size] = part
            server.aggregate_into(21, stored[21], mx.nd.array(push))
        counts = {5: 2, 7: 2, 9: 1} if existing else {5: 2, 7: 2}
        assert server.optimizer._index_update_count == counts
        for t in (2, 3, 4):
            for k in (5, 7):
                server.aggregate_into(k, stored[k], mx.nd.array(grads[t][k]))
                np.testing.assert_array_equal(stored[k].asnumpy(), want[t][0][k])


# default run: save_states on either route in the user scripts' launches
# (test_user_scripts.py), the state stream's windows above
@pytest.mark.slow
def test_states_saved_by_rank0_on_the_servers_resume_training_bitwise(tmp_path):
    import mxnet as mx
    # phase 1: steps 1-5 on the servers, rank 0 alone saves after step 3
    first, reports = _run(tmp_path, "servers")
    for report in reports:
        assert report["update_on_kvstore"]
        assert report["route"]["route"] == "servers"
        assert report["route"]["reason"] == "server_update=True"
        # the 1280-element weight in two pieces, one per server; the rest whole
        assert sorted(len(p) for p in report["servers"]) == [1, 1, 1, 2]
        assert sorted(max(report["servers"], key=len)) == [0, 1]
    _same(first[1], first[0], range(1, 6))          # the workers agree
    # the file is Gluon's: (states by parameter index, the optimizer with the servers'
    # update counts), the momentum of every parameter of its shape, and not zero
    with open(tmp_path / "s3.states", "rb") as f:
        states, optimizer = pickle.load(f)
    shapes = [tuple(s) for s in reports[0]["shapes"]]     # by the Trainer's index
    assert sorted(shapes) == sorted([(64, FEATURES), (64,), (10, 64), (10,)])
    assert sorted(states) == [0, 1, 2, 3]
    for i, shape in enumerate(shapes):
        assert isinstance(states[i], mx.nd.NDArray) and states[i].shape == shape
        assert np.abs(states[i].asnumpy()).max() > 0
    assert type(optimizer).__name__ == "SGD" and optimizer.momentum == 0.9
    assert optimizer._index_update_count == {0: 3, 1: 3, 2: 3, 3: 3}
    assert optimizer.num_update == 3

    # files that do not fit this Trainer: another model's, and no states file at all
    with open(tmp_path / "other_model.states", "wb") as f:
        pickle.dump(({0: mx.nd.zeros((3, 3))}, mx.optimizer.SGD(momentum=0.9)), f)
    with open(tmp_path / "not_states.states", "wb") as f:
        f.write(b"a file of something else\n")

    # phase 2: every worker loads the checkpoint on the servers: steps 4-5 bitwise
    resumed, reports = _run(tmp_path, "servers_resumed")
    for report in reports:
        errors = report["errors"]
        assert "does not match parameter" in errors["other_model.states"]
        assert str(shapes[0]) in errors["other_model.states"]
        assert "(3, 3)" in errors["other_model.states"]
        assert "is not a Trainer's optimizer states file" in errors["not_states.states"]
        assert report["optimizer_after_load"] == "SGD"
    for r in (0, 1):
        _same(resumed[r], first[0], range(4, 6))

    # phase 3: Gluon's own load_states (the optimizer on the workers) takes the servers'
    # file: the same steps (the update then runs on each worker: equal within rounding)
    workers, reports = _run(tmp_path, "workers_resumed")
    for report in reports:
        assert not report["update_on_kvstore"]
        assert report["route"]["route"] == "workers"
    for r in (0, 1):
        _same(workers[r], first[0], range(4, 6), exact=False)

    # phase 4: and the servers take the workers' file (saved by Gluon after step 4)
    back, _ = _run(tmp_path, "servers_from_workers")
    for r in (0, 1):
        _same(back[r], workers[0], range(5, 6), exact=False)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
