"""mxhylo.sync_batchnorm: the BatchNorm that normalizes over every worker's batch.

With one worker it must be MXNet's BatchNorm (outputs, gradients, running statistics,
evaluation), hybridized or not; its moments keep their precision where the mean is
large against the spread; the Reducer sums over workers by key, in rank order, and a
missing worker ends in an error that names it, not a hang. (W workers against one
process: tests/distributed/test_sync_batchnorm_dist.py.)
"""
import socket
import threading

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from mxhylo import reducer, sync_batchnorm


@pytest.fixture
def one_worker():
    undo = sync_batchnorm.install(sync_batchnorm.Reducer(0, 1, None))
    yield
    undo()


LAYERS = {
    "conv (N, C, H, W)": (dict(in_channels=5), (6, 5, 4, 3)),
    "dense (N, C)": (dict(in_channels=5), (7, 5)),
    "scale=False": (dict(in_channels=5, scale=False), (6, 5, 3, 3)),
    "center=False": (dict(in_channels=5, center=False), (6, 5, 3, 3)),
    "channels last, axis=-1": (dict(in_channels=5, axis=-1), (4, 3, 3, 5)),
}


def _train_twice_then_evaluate(layer_kwargs, x, w, hybridize):
    """Two training forwards and backwards of a BatchNorm layer, then an evaluation
    forward: [train output, dx, dgamma, dbeta, running mean, running var, eval output]."""
    bn = gluon.nn.BatchNorm(momentum=0.8, epsilon=1e-3,
                            gamma_initializer=mx.init.Constant(1.5),
                            beta_initializer=mx.init.Constant(-0.25), **layer_kwargs)
    bn.initialize()
    if hybridize:
        bn.hybridize()
    x = x.copy()
    x.attach_grad()
    for _ in range(2):
        with autograd.record():
            y = bn(x)
            loss = (y * w).sum()
        loss.backward()
    grads = [p.grad().asnumpy() if p.grad_req != "null" else np.zeros(1)
             for p in (bn.gamma, bn.beta)]
    return [y.asnumpy(), x.grad.asnumpy()] + grads + \
        [bn.running_mean.data().asnumpy(), bn.running_var.data().asnumpy(),
         bn(x).asnumpy()]


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_one_worker_is_mxnets_batchnorm(layer, hybridize):
    kwargs, shape = LAYERS[layer]
    rng = np.random.RandomState(3)
    x = mx.nd.array(rng.normal(2.0, 3.0, shape))
    w = mx.nd.array(rng.normal(0.0, 1.0, shape))
    mxnet_bn = _train_twice_then_evaluate(kwargs, x, w, hybridize)
    undo = sync_batchnorm.install(sync_batchnorm.Reducer(0, 1, None))
    try:
        synced = _train_twice_then_evaluate(kwargs, x, w, hybridize)
    finally:
        undo()
    names = ["output", "dx", "dgamma", "dbeta", "running mean", "running var", "eval"]
    for name, a, b in zip(names, mxnet_bn, synced):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("shape,axis", [((3, 4, 5, 7), 1), ((2, 3, 33), 1), ((9, 6), 1),
                                        ((2, 5, 16), -1), ((1, 1, 1, 1), 1)])
def test_cpp_halves_equal_the_broadcast_reference(shape, axis):
    from mxhylo import ops
    if ops.backend() != "cpp":
        pytest.skip("mxhylo's C++ operators are not built here")
    rng = np.random.RandomState(sum(shape))
    x = rng.normal(1.0, 2.0, shape).astype(np.float32)
    c = shape[axis]
    stat = [1] * len(shape)
    stat[axis] = c
    gamma, beta = rng.normal(size=c).astype(np.float32), rng.normal(size=c).astype(np.float32)
    heads = [rng.normal(size=shape).astype(np.float32), rng.normal(size=stat), rng.normal(size=stat)]
    kw = {"axis": axis, "eps": 1e-3, "fix_gamma": False}
    results = []
    for cpp in (True, False):
        xs = [mx.nd.array(a) for a in (x, gamma, beta)]
        for a in xs:
            a.attach_grad()
        with autograd.record():
            m, q = sync_batchnorm._moments(mx.nd, xs[0], axis, cpp)
            var = q / (x.size // c)
            y = sync_batchnorm._normalize(mx.nd, xs[0], m, var, xs[1], xs[2], kw, cpp)
        autograd.backward([y, m, q], [mx.nd.array(h) for h in heads])
        results.append([a.asnumpy() for a in (m, q, y)] + [a.grad.asnumpy() for a in xs])
    reduced = tuple(a for a in range(len(shape)) if a != axis % len(shape))
    np.testing.assert_allclose(results[0][0].ravel(), x.astype(np.float64).mean(reduced),
                               rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["mean", "centred", "y", "dx", "dgamma", "dbeta"], *results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_variance_keeps_its_precision_with_a_large_mean(one_worker):
    # sum(x^2)/n - mean^2 in float32 would lose every digit here (mean^2/var = 1e8)
    rng = np.random.RandomState(0)
    x = (1e4 + rng.normal(0.0, 1.0, (64, 3, 5, 5))).astype(np.float32)
    bn = gluon.nn.BatchNorm(in_channels=3, momentum=0.0)   # running = the batch's
    bn.initialize()
    with autograd.record():
        bn(mx.nd.array(x))
    var = x.astype(np.float64).var(axis=(0, 2, 3))
    np.testing.assert_allclose(bn.running_var.data().asnumpy(), var, rtol=1e-3)


def _reducers(num_workers, timeout=30.0):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    address = listener.getsockname()
    return [reducer.Reducer(r, num_workers, address, timeout,
                                   listener if r == 0 else None)
            for r in range(num_workers)]


def _in_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except Exception as exc:            # noqa: BLE001 (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_reducer_sums_by_key_in_rank_order_whatever_the_call_order():
    # each worker starts its keys from its own threads in its own order, as the
    # operators of independent branches of a net do
    reducers = _reducers(3)
    rng = np.random.RandomState(1)
    values = {k: rng.normal(size=(3, 17)) * 10.0 ** rng.randint(-8, 8, (3, 17))
              for k in ("a", "b", "c")}
    orders = [("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a")]
    calls = [lambda r=r, k=k: (r, k, reducers[r].sum(k, values[k][r]))
             for r in range(3) for k in orders[r]]
    results, errors = _in_threads(calls)
    assert not errors, errors
    for r, k, total in results:
        expected = (values[k][0] + values[k][1]) + values[k][2]         # rank order
        assert total.tobytes() == expected.tobytes(), (k, r)


def test_reducer_rounds_of_one_key_do_not_mix():
    reducers = _reducers(2)

    def worker(r):
        return [reducers[r].sum("k", np.full(4, 10.0 * step + r)) for step in range(20)]
    results, errors = _in_threads([lambda r=r: worker(r) for r in range(2)])
    assert not errors, errors
    for step in range(20):
        for r in range(2):
            np.testing.assert_array_equal(results[r][step], np.full(4, 20.0 * step + 1))


def test_a_missing_worker_is_an_error_naming_it_not_a_hang():
    reducers = _reducers(3, timeout=1.0)
    results, errors = _in_threads([lambda r=r: reducers[r].sum("layer7:forward", np.ones(3))
                                   for r in (0, 1)])
    assert len(errors) == 2
    assert all("layer7:forward" in str(e) and "[2]" in str(e) for e in errors), errors


PARENT = r"""
import socket, sys, threading
import numpy as np
from mxhylo import reducer
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(8)
service = reducer.spawn_service(listener, 2, timeout=10)
address = listener.getsockname()
listener.close()
sums = {}
def call(rank):
    sums[rank] = reducer.Reducer(rank, 2, address, 10).sum("k", np.arange(3.0) + rank)
threads = [threading.Thread(target=call, args=(r,)) for r in (0, 1)]
[t.start() for t in threads]
[t.join(30) for t in threads]
print(service.pid, sums[0].tolist(), sums[1].tolist(), flush=True)
"""


def test_the_service_process_sums_and_leaves_with_its_parent():
    import os
    import subprocess
    import sys
    import time
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = out.stdout.split()[0]
    assert "[1.0, 3.0, 5.0] [1.0, 3.0, 5.0]" in out.stdout, out.stdout
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(int(pid), 9)
    pytest.fail("the sum service (pid %s) outlived its parent" % pid)
