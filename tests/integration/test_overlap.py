"""The exchange overlapped with backward, in one process: kvstore.readiness (the engine
says when each gradient is written) and the store taking layers in that order.

The distributed side (2 workers + 2 servers: bitwise the serial exchange's parameters,
and a push that leaves while backward still runs) is in tests/distributed/test_dist.py."""
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import mxhylo
from mxhylo import ops
from mxhylo.kvstore import hylo as hylo_store, readiness

needs_cpp = pytest.mark.skipif(ops.backend() != "cpp",
                               reason="readiness needs mxhylo's operator library")


class _Sleep(mx.operator.CustomOp):
    """Identity whose forward (or backward) first sleeps: a gradient written late.
    MXNet runs a custom operator in a thread of its own, so the engine's other work
    goes on meanwhile."""

    def __init__(self, forward_s, backward_s, fail):
        super().__init__()
        self.forward_s, self.backward_s, self.fail = forward_s, backward_s, fail

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(self.forward_s)
        if self.fail:
            raise RuntimeError("this operator fails on purpose")
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        time.sleep(self.backward_s)
        SLEEP_ENDS.append(time.perf_counter())
        self.assign(in_grad[0], req[0], out_grad[0])


SLEEP_ENDS = []     # perf_counter at the end of each _Sleep backward


@mx.operator.register("mxhylo_test_sleep")
class _SleepProp(mx.operator.CustomOpProp):
    def __init__(self, forward_s="0", backward_s="0", fail="0"):
        super().__init__(need_top_grad=True)
        self.args = float(forward_s), float(backward_s), fail == "1"

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _Sleep(*self.args)


def sleep_then(x, forward_s=0.0, backward_s=0.0, fail=False):
    return mx.nd.Custom(x, forward_s=str(forward_s), backward_s=str(backward_s),
                        fail="1" if fail else "0", op_type="mxhylo_test_sleep")


@needs_cpp
def test_layers_come_in_the_order_their_arrays_are_written():
    ready = mx.nd.ones((3,))
    late = sleep_then(mx.nd.ones((4,)), forward_s=0.6)
    soon = sleep_then(mx.nd.ones((5,)), forward_s=0.2)
    both = [sleep_then(mx.nd.ones((2,)), forward_s=0.4), ready]    # ready when both are
    clock = time.perf_counter()
    seen = []
    for index in readiness.ReadyOrder([[late], [soon], both, [ready]],
                                      ["late", "soon", "both", "ready"], timeout=30):
        seen.append((index, time.perf_counter() - clock))
    assert [i for i, _ in seen] == [3, 1, 2, 0], seen
    assert seen[0][1] < 0.15 and seen[-1][1] >= 0.55, seen      # not polled, not early


@needs_cpp
def test_a_gradient_never_written_is_an_error_naming_its_layer():
    late = sleep_then(mx.nd.ones((4,)), forward_s=2.0)
    order = iter(readiness.ReadyOrder([[mx.nd.ones((2,))], [late]], ["fast", "conv9"],
                                      timeout=0.3))
    assert next(order) == 0
    with pytest.raises(TimeoutError, match=r"1 layer\(s\).*conv9"):
        next(order)
    late.wait_to_read()
    # the late record of that finished order is dropped; a new order starts clean
    again = readiness.ReadyOrder([[late]], ["conv9"], timeout=5)
    assert list(again) == [0]


@needs_cpp
def test_a_failed_producer_still_notifies_and_reading_raises():
    """kNoSkip: the engine runs the notification even when the array's producer
    failed, so the store meets MXNet's error instead of waiting out the bound."""
    broken = sleep_then(mx.nd.ones((4,)), fail=True)
    clock = time.perf_counter()
    assert list(readiness.ReadyOrder([[broken]], ["conv0"], timeout=20)) == [0]
    assert time.perf_counter() - clock < 10
    with pytest.raises(mx.base.MXNetError, match="CustomOp"):
        broken.asnumpy()


def _net():
    """conv (conv_topk) -> late backward -> fc (fc_2bit) -> fc (small)."""
    class Net(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.conv = gluon.nn.Conv2D(64, 3, in_channels=16)
            self.fc = gluon.nn.Dense(256, in_units=64 * 36)
            self.out = gluon.nn.Dense(10, in_units=256)

        def hybrid_forward(self, F, x):
            x = F.Custom(self.conv(x), forward_s="0", backward_s="0.8", fail="0",
                         op_type="mxhylo_test_sleep")
            return self.out(F.relu(self.fc(x)))
    net = Net()
    net.initialize(mx.init.Xavier(), force_reinit=True)
    net.hybridize(static_alloc=True, static_shape=True)
    return net


def _train(monkeypatch, overlap, steps=3, **options):
    mx.random.seed(7)
    np.random.seed(7)
    net = _net()
    monkeypatch.setattr(hylo_store, "OVERLAP", overlap)      # read when a store is made
    kv = mxhylo.create("hylo", warmup_steps=0, size_threshold=1024, conv_rate=0.1,
                       **options)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.05, "momentum": 0.9}, kvstore=kv)
    # structural names (conv.weight, ...): the same in every run of the test
    short = {p.name: n for n, p in net._collect_params_with_prefix().items()}
    rng = np.random.RandomState(3)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    timing = []
    for _ in range(steps):
        x = mx.nd.array(rng.normal(size=(4, 16, 8, 8)))
        y = mx.nd.array(rng.randint(0, 10, size=4))
        with autograd.record():
            loss = loss_fn(net(x), y)
        del SLEEP_ENDS[:]
        loss.backward()
        called = time.perf_counter()
        trainer.step(4)
        layers = kv.stats()["layers"]
        timing.append({"backward_end": SLEEP_ENDS[0],
                       "push": {short[name]: called + e["last_push_s"]
                                for name, e in layers.items()}})
    params = {short[p.name]: p.data().asnumpy() for p in net.collect_params().values()}
    policies = {short[n]: e["policy"] for n, e in kv.stats()["layers"].items()}
    return params, timing, policies, kv


LATER = ("fc.weight", "fc.bias", "out.weight", "out.bias")   # after the late one


@needs_cpp
def test_overlapped_step_pushes_during_backward_and_equals_the_serial_one(monkeypatch):
    """The layers whose gradients backward writes before the late one go while it
    still sleeps (uncompressed: every one of them; compressed: the exchange has begun,
    an encode may wait on MXNet's temp space); the
    serial exchange (hylo.OVERLAP = False) starts after backward. Bitwise the same
    weights."""
    for options in ({"policy": {".*": "none"}}, {}):
        params_on, timing_on, policies, kv = _train(monkeypatch, True, **options)
        assert kv.stats()["options"]["overlap"] is True
        params_off, timing_off, _, _ = _train(monkeypatch, False, **options)
        for name, value in params_on.items():
            np.testing.assert_array_equal(params_off[name], value, err_msg=name)
        # (from the second step: in the first, the late operator's recorded end does
        # not bound the gradients' writes, in every mode; 50 ms: the custom operator's
        # thread stamps its end before it hands the gradient on)
        for t in timing_on[1:]:
            early = [n for n in LATER if t["push"][n] < t["backward_end"] - 0.3]
            if options:
                assert early == list(LATER), (options, t)
            else:
                assert early, t
            # the conv layer, whose gradient comes after the late one, only then
            assert t["push"]["conv.weight"] > t["backward_end"] - 0.05, t
        for t in timing_off[1:]:
            assert min(t["push"].values()) > t["backward_end"] - 0.05, t
    assert policies["conv.weight"] == "conv_topk" and policies["fc.weight"] == "fc_2bit"


def test_overlap_switch_is_read_when_a_store_is_made(monkeypatch):
    """hylo.OVERLAP = False: the serial order ('after': once every gradient is
    written); on, the order backward writes the gradients where mxhylo's operator
    library is loaded, else the order given. A store keeps the order it was made with;
    overlap is no option of the store."""
    monkeypatch.setattr(hylo_store, "OVERLAP", False)
    kv = mxhylo.create("hylo")
    assert kv.overlap is False and kv.pipeline.order == "after"
    assert kv.stats()["options"]["overlap"] is False
    monkeypatch.setattr(hylo_store, "OVERLAP", True)
    assert kv.pipeline.order == "after"                     # made with it off
    monkeypatch.setattr(readiness, "available", lambda: True)
    on = mxhylo.create("hylo")
    assert on.overlap is True and on.pipeline.order == "written"
    monkeypatch.setattr(readiness, "available", lambda: False)
    kv = mxhylo.create("hylo")
    assert kv.overlap is False and kv.pipeline.order == "given"
    with pytest.raises(TypeError, match="overlap"):
        mxhylo.create("hylo", overlap=True)

