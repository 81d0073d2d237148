"""The dist_sync_fp16 peer's store (mxhylo.bench.modes.DistSyncFP16Store): MXNet's
dist_sync moving float16 gradients, everything else float32.

Its job test runs 2 workers and 1 server (``python -m mxhylo.launch``, a free port, a
timeout on the job) with this file as the workers' script:

    python tests/bench/test_bench_fp16.py DIR

Each worker broadcasts keys from its own values, exchanges seeded gradients through
the store (as bench comm calls it, and in place as Gluon calls it), then trains a small
net with gluon.Trainer over the store; it writes DIR/RANK.npz and DIR/RANK.json.
"""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.abspath(__file__)
JOB_TIMEOUT_S = 90      # the launcher's bound on the job
SHAPES = [(3, 4), (1000,), (300, 500)]
FIRST_KEY = 100
GRAD_STEPS = 2
TRAIN_STEPS = 3
BATCH, FEATURES, CLASSES = 8, 12, 5


# -- the workers' script ------------------------------------------------------------------

def _values(rank, step, shape):
    """Worker ``rank``'s float32 values of ``shape`` at ``step`` (step -1: its initial
    parameter values): gradient-sized, a few of them large."""
    rng = np.random.RandomState(7919 * (step + 2) + 31 * rank + len(shape))
    a = rng.normal(0.0, 0.01, size=shape).astype(np.float32)
    a.reshape(-1)[:3] = (50.0, -3.0e-3, 1.0e-5)
    return a


def _batch(rank, step):
    rng = np.random.RandomState(100 * step + rank)
    return (rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
            rng.randint(0, CLASSES, size=BATCH).astype(np.float32))


def _worker(folder):
    import mxnet as mx          # a server or the scheduler serves inside this import
    from mxnet import autograd, gluon

    from mxhylo.bench.modes import DistSyncFP16Store

    kv = DistSyncFP16Store()
    rank = kv.rank
    arrays, report = {}, {"rank": rank, "num_workers": kv.num_workers, "type": kv.type}
    keys = [FIRST_KEY + i for i in range(len(SHAPES))]   # (the Trainer's are 0, 1, ...)
    # broadcast of the keys at once (bench comm's init is the same native init), each
    # worker from its own values
    sent = [mx.nd.array(_values(rank, -1, s)) for s in SHAPES]
    got = [mx.nd.zeros(s) for s in SHAPES]
    kv.broadcast(keys, sent, out=got)
    for i in range(len(SHAPES)):
        arrays["got%d" % i] = got[i].asnumpy()
    # gradients: per key with an output (as bench comm), then in place (as Gluon)
    for step in range(GRAD_STEPS):
        grads = [mx.nd.array(_values(rank, step, s)) for s in SHAPES]
        outs = [mx.nd.zeros(s) for s in SHAPES]
        for k, g, o in zip(keys, grads, outs):
            kv.pushpull(k, g, out=o, priority=-k)
        for i in range(len(SHAPES)):
            arrays["sum%d_%d" % (step, i)] = outs[i].asnumpy()
            arrays["grad%d_%d" % (step, i)] = grads[i].asnumpy()   # untouched
        for k, g in zip(keys, grads):
            kv.pushpull(k, [g], priority=-k)
        for i in range(len(SHAPES)):
            arrays["inplace%d_%d" % (step, i)] = grads[i].asnumpy()
    try:
        kv.pushpull(99, mx.nd.zeros((2,)))
    except KeyError as err:
        report["unknown_key"] = str(err)

    # gluon.Trainer over the store; every worker starts from its own weights
    mx.random.seed(10 + rank)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, FEATURES)))
    params = net.collect_params()
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    names = [n for n in params.keys() if params[n].grad_req != "null"]
    for step in range(TRAIN_STEPS):
        x, y = _batch(rank, step)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        for i, n in enumerate(names):
            arrays["local%d_%d" % (step, i)] = params[n].grad().asnumpy()
        trainer.step(BATCH * kv.num_workers)
        for i, n in enumerate(names):
            arrays["summed%d_%d" % (step, i)] = params[n].grad().asnumpy()
    for i, n in enumerate(names):
        arrays["param%d" % i] = params[n].data().asnumpy()
    report["update_on_kvstore"] = trainer._update_on_kvstore
    report["param_dtypes"] = sorted(set(np.dtype(params[n].data().dtype).name
                                        for n in names))
    report["grad_dtypes"] = sorted(set(np.dtype(params[n].grad().dtype).name
                                       for n in names))
    report["num_params"] = len(names)
    np.savez(os.path.join(folder, "%d.npz" % rank), **arrays)
    with open(os.path.join(folder, "%d.json" % rank), "w") as f:
        json.dump(report, f)


# -- the tests ----------------------------------------------------------------------------

def test_store_in_one_process_casts_and_keeps_float32():
    """The adapter over a local store (one worker: the sum is its own gradient): the
    output is the float16-rounded gradient in float32; a Trainer updates on the worker."""
    import mxnet as mx
    from mxnet import autograd, gluon

    from mxhylo.bench.modes import DistSyncFP16Store
    kv = DistSyncFP16Store("local")
    with pytest.raises(ValueError):
        DistSyncFP16Store.half_key(DistSyncFP16Store.HALF_KEY_OFFSET)
    g = _values(0, 0, (50, 40))
    w = mx.nd.array(_values(0, -1, (50, 40)))
    out = mx.nd.zeros((50, 40))
    kv.broadcast(5, w, out=[out])
    np.testing.assert_array_equal(out.asnumpy(), w.asnumpy())
    kv.pushpull(5, mx.nd.array(g), out=out)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.asnumpy(), g.astype(np.float16).astype(np.float32))
    assert (out.asnumpy() != g).any()               # it did travel as float16
    with pytest.raises(KeyError, match="never initialised"):
        kv.pushpull(6, mx.nd.array(g))

    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5},
                            kvstore=DistSyncFP16Store("local"))
    before = net.weight.data().asnumpy()
    with autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    grad = net.weight.grad().asnumpy()
    trainer.step(1)
    assert trainer._update_on_kvstore is False
    assert net.weight.data().dtype == np.float32 and net.weight.grad().dtype == np.float32
    np.testing.assert_allclose(net.weight.data().asnumpy(),
                               before - 0.5 * grad.astype(np.float16).astype(np.float32),
                               rtol=1e-6)


def _run_job(folder):
    """The 2-worker, 1-server job over this file; its output. The launcher ends the
    job's processes; any left behind (found by ``folder``, on every process's command
    line) are killed by pid."""
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
           str(JOB_TIMEOUT_S), sys.executable, HERE, str(folder)]
    # (imported here: this file is also the job's script, run without tests/ on its path)
    from proc_helpers import run_bounded_job
    rc, out = run_bounded_job(cmd, folder, JOB_TIMEOUT_S, cwd=ROOT)
    assert rc == 0, out[-4000:]
    return out


def _fp16_sum(a, b):
    """What the servers return for two workers' float32 values: each rounded to float16,
    added in float16."""
    return (a.astype(np.float16) + b.astype(np.float16)).astype(np.float32)


# default run: the store in one process (above), and over the servers under
# gluon.Trainer in test_bench_train.py's run (its bytes, identical workers)
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_every_worker_gets_the_sum_in_float16_and_stays_float32(tmp_path):
    _run_job(tmp_path)
    got = [dict(np.load(str(tmp_path / ("%d.npz" % r)))) for r in (0, 1)]
    reports = [json.load(open(str(tmp_path / ("%d.json" % r)))) for r in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["num_workers"] == 2 and r["type"] == "dist_sync" for r in reports)
    # the broadcast: rank 0's float32 values, bitwise, on every worker
    for k, shape in enumerate(SHAPES):
        for r in (0, 1):
            assert got[r]["got%d" % k].dtype == np.float32
            np.testing.assert_array_equal(got[r]["got%d" % k], _values(0, -1, shape))
    # the exchange: the workers' sum within float16 rounding, in float32, the inputs
    # untouched where an output was given, written in place otherwise
    for step in range(GRAD_STEPS):
        for k, shape in enumerate(SHAPES):
            a, b = _values(0, step, shape), _values(1, step, shape)
            for r in (0, 1):
                np.testing.assert_array_equal(got[r]["grad%d_%d" % (step, k)],
                                              _values(r, step, shape))
                for name in ("sum%d_%d" % (step, k), "inplace%d_%d" % (step, k)):
                    s = got[r][name]
                    assert s.dtype == np.float32, name
                    # float16 rounding: each addend once (cast), the sum once; half
                    # a unit in the last place is 2**-11 relative (2**-25 absolute
                    # for subnormals)
                    bound = 2.0 ** -11 * (abs(a) + abs(b) + abs(a + b)) + 3 * 2.0 ** -25
                    assert (abs(s - (a + b)) <= bound).all(), name
                    np.testing.assert_array_equal(s, _fp16_sum(a, b), err_msg=name)
    assert all("never initialised" in r["unknown_key"] for r in reports)
    # gluon.Trainer over the store: the update on the workers, everything float32, the
    # summed gradients as above, and both workers end bitwise identical (started from
    # rank 0's weights, though each initialised its own)
    for r in reports:
        assert r["update_on_kvstore"] is False
        assert r["param_dtypes"] == ["float32"] and r["grad_dtypes"] == ["float32"]
    n = reports[0]["num_params"]
    for step in range(TRAIN_STEPS):
        for i in range(n):
            local = [got[r]["local%d_%d" % (step, i)] for r in (0, 1)]
            want = _fp16_sum(*local)
            for r in (0, 1):
                np.testing.assert_array_equal(got[r]["summed%d_%d" % (step, i)], want)
    for i in range(n):
        np.testing.assert_array_equal(got[0]["param%d" % i], got[1]["param%d" % i])


if __name__ == "__main__":
    _worker(sys.argv[1])
