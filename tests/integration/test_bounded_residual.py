"""The stabilizer around every codec (kvstore.stages.BoundedResidual): after each
encode, every row of a layer's residual holds at most the norm of the same row of the
step's input, so what error feedback delivers late is never more than one step of it."""
import numpy as np
import pytest

import mxnet as mx

import mxhylo
from mxhylo import ops
from mxhylo.kvstore import stages


def _row_norms(a):
    return np.sqrt((a.reshape(a.shape[0], -1).astype(np.float64) ** 2).sum(1))


@pytest.mark.parametrize("shape", [(7,), (5, 9), (6, 3, 3, 3), (1, 1)])
def test_bound_rows_scales_only_rows_over_the_bound_and_keeps_their_direction(shape):
    rng = np.random.RandomState(sum(shape))
    for bound in (0.5, 1.0, 3.0):
        residual = (rng.standard_normal(shape) * rng.choice([0.1, 1, 10], shape[:1] + (1,) *
                                                             (len(shape) - 1))).astype(np.float32)
        grad = rng.standard_normal(shape).astype(np.float32)
        if len(shape) > 1:
            residual[0] = 0.0               # an empty row stays empty
            grad[-1] = 0.0                  # a row with no input is emptied
        r = mx.nd.array(residual)
        cut = ops.bound_rows(r, mx.nd.array(grad), bound)
        got = r.asnumpy()
        rows = 1 if len(shape) == 1 else shape[0]
        before = _row_norms(residual.reshape(rows, -1))
        allowed = bound * _row_norms(grad.reshape(rows, -1))
        after = _row_norms(got.reshape(rows, -1))
        for i in range(rows):
            old, new = residual.reshape(rows, -1)[i], got.reshape(rows, -1)[i]
            if before[i] <= allowed[i]:
                np.testing.assert_array_equal(new, old)     # within the bound: untouched
            else:
                assert after[i] == pytest.approx(allowed[i], rel=1e-5, abs=1e-30)
                if allowed[i] > 0:      # scaled, not turned: the same direction
                    cos = np.dot(new, old) / (after[i] * before[i])
                    assert cos == pytest.approx(1.0, abs=1e-6)
        assert (after <= allowed * (1 + 1e-5) + 1e-30).all()
        assert int(cut.asscalar()) == int((before > allowed).sum())
        if len(shape) > 1:
            assert not got[0].any() and not got[-1].any()


def _starved_filters(steps):
    """A conv layer of 4 filters sending 1 a step, whose filter 0's gradient grows every
    step (so it is always the one sent) and whose other filters' gradients stay 0.01:
    the norms of filters 1-3's residual rows after ``steps`` exchanges, and of their
    gradient rows."""
    kv = mxhylo.create(size_threshold=1, conv_rate=0.25, warmup_steps=0, cost_model=False)
    shape = (4, 2, 3, 3)
    for t in range(1, steps + 1):
        g = np.full(shape, 0.01, np.float32)
        g[0] = float(t)
        kv.pushpull("conv", mx.nd.array(g))
    assert kv.stats()["layers"]["conv"]["policy"] == "conv_topk"
    assert kv.stats()["layers"]["conv"]["k"] == 1
    residual = kv.memory.residual("conv", mx.nd.zeros(shape)).asnumpy()
    return _row_norms(residual)[1:], _row_norms(g)[1:]


def test_a_residual_that_grows_without_bound_unbounded_stays_within_one_wait(monkeypatch):
    """Filters never sent: without the bound their residual is the sum of all their
    gradients (it grows with every step); with it, at most one mean wait's worth (4
    steps: 1 of 4 filters is sent a step)."""
    monkeypatch.setattr(stages, "ROW_BOUND", 1e30)     # off: (times a wait) above any row
    unbounded, grad = _starved_filters(50)
    np.testing.assert_allclose(unbounded, 50 * grad, rtol=1e-4)
    monkeypatch.setattr(stages, "ROW_BOUND", 1.0)
    bounded, grad = _starved_filters(50)
    np.testing.assert_allclose(bounded, 4 * grad, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bound_rows_operator_equals_its_reference_bitwise(dtype):
    """mxhylo.ops.bound_rows (C++ where built) and ops.reference: the same bits, on
    random rows of every scale, a zero input row, a NaN row, and one long row."""
    rng = np.random.RandomState(5)
    for shape in [(9, 4, 3, 3), (3, 1000), (2, 2503), (1, 1), (17,)]:
        residual = (rng.standard_normal(shape) * 10.0 ** rng.randint(-3, 3)).astype(np.float32)
        grad = rng.standard_normal(shape).astype(dtype)
        if len(shape) > 1 and shape[0] > 2:
            grad[1] = 0
            residual[2, 0] = np.nan
        a, b = mx.nd.array(residual), mx.nd.array(residual)
        g = mx.nd.array(grad, dtype=dtype)
        cut_a = ops.bound_rows(a, g, 0.7)
        cut_b = ops.reference.bound_rows(b, g, 0.7)
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
        assert cut_a.asscalar() == cut_b.asscalar()
        if len(shape) > 1 and shape[0] > 2:
            assert not a.asnumpy()[1].any()                 # zero input: emptied
            np.testing.assert_array_equal(a.asnumpy()[2], residual[2])  # NaN row: as it was
    with pytest.raises(ValueError, match="bound"):
        ops.bound_rows(mx.nd.zeros((2, 2)), mx.nd.zeros((2, 2)), -1.0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "lars"])
def test_every_compressed_layer_is_bounded_every_step_under_each_optimizer(monkeypatch,
                                                                           optimizer):
    """A user's loop (a Trainer given the store, update_on_kvstore unset): after every
    step, every compressed layer's residual rows are within the rows of what was
    encoded: the velocity under SGD's momentum (momentum correction), the gradient
    under Adam and LARS (no momentum correction)."""
    from mxnet import autograd, gluon

    seen = []
    real_bound, real_encode = ops.bound_rows, ops.encode_2bit

    def bound_rows(residual, grad, bound):
        cut = real_bound(residual, grad, bound)
        seen.append((grad.shape, _row_norms(residual.asnumpy()), _row_norms(grad.asnumpy())))
        return cut

    def encode_2bit(grad, residual, threshold, bound=None, **kw):     # the bound fused
        out = real_encode(grad, residual, threshold, bound=bound, **kw)
        if bound is not None:
            encoded = grad if out[2] is None else out[2]
            seen.append((grad.shape, _row_norms(residual.asnumpy()),
                         _row_norms(encoded.asnumpy())))
        return out
    monkeypatch.setattr(ops, "bound_rows", bound_rows)
    monkeypatch.setattr(ops, "encode_2bit", encode_2bit)

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, in_channels=4), gluon.nn.Flatten(), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=[mx.cpu(0), mx.cpu(1)])
    kv = mxhylo.create(size_threshold=100, warmup_steps=0)
    params = net.collect_params()
    if optimizer == "lars":
        trainer = mxhylo.LARSTrainer(params, learning_rate=0.1, momentum=0.9, kvstore=kv,
                                      total_steps=10, loss_scale=None)
    else:
        opts = {"learning_rate": 0.01}
        if optimizer == "sgd":
            opts["momentum"] = 0.9
        trainer = gluon.Trainer(params, optimizer, opts, kvstore=kv)
    rng = np.random.RandomState(0)
    steps = 10
    for t in range(steps):
        # inputs that shrink step by step, so the gradients do: what a residual holds
        # from earlier steps then outgrows the step's input unless it is bounded
        xs = [mx.nd.array(rng.standard_normal((4, 4, 6, 6)) * 0.7 ** t, ctx=c)
              for c in (mx.cpu(0), mx.cpu(1))]
        with autograd.record():
            losses = [(net(x) ** 2).mean() for x in xs]
        autograd.backward(losses)
        trainer.step(8)
    compressed = {n for n, s in kv.stats()["layers"].items() if s["policy"] != "none"}
    assert len(compressed) == 2                         # the conv and the dense weights
    assert len(seen) == steps * len(compressed)
    waits = {s["shape"] and tuple(s["shape"]): 1.0 if s["policy"] == "fc_2bit"
             else s["shape"][0] / float(s["k"]) for n, s in kv.stats()["layers"].items()
             if n in compressed}
    for shape, residual, encoded in seen:
        assert (residual <= waits[tuple(shape)] * encoded * (1 + 1e-5)).all()
    assert net(xs[0]).asnumpy().shape == (4, 10)        # the net still evaluates
