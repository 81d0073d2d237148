"""Workers whose gradients come in crossed orders: two buckets and a 2-bit layer.

Worker 0's gradients of bucket A (a0_bias, a1_bias) exist at once and bucket B's
(b0_bias, b1_bias) LATE_S later; worker 1's the other way round. The 2-bit layer's
(fc_weight) comes between them on both (FC_S). So each worker pushes its early bucket, then
encodes fc_weight, then waits for its late bucket: its early bucket's aggregate needs
the other worker's late push. Nothing the worker queues before its last push may wait
for a pull (kvstore.transport_ps, PULL_READERS_LAST), or both workers wait for each
other in fc_weight's encode.

    python tests/distributed/jobs/crossed_buckets.py      (under mxhylo.launch -n 2)

Prints "step N ok" once each step's bucket sums are checked and its layers were pushed
in the crossed order (the store's last_push_s). The scheduler and the
servers run this file too and never get past the imports (they serve inside them).
"""
import time

import mxnet as mx
import numpy as np

import mxhylo

STEPS = 3
FC_S, LATE_S = 0.3, 1.0       # seconds after the step's start its gradient exists
EARLY, LATE = ("a0_bias", "a1_bias"), ("b0_bias", "b1_bias")
# the 2-bit layer outgrows a bucket's span (kvstore.ps_keys.bucket_groups): A and B are
# two buckets, in the call's order A, fc_weight, B
LAYERS = {"a0_bias": (100,), "a1_bias": (100,), "fc_weight": (800, 800),
          "b0_bias": (100,), "b1_bias": (100,)}
POLICY = {"bias": "none", "fc_weight": "fc_2bit"}


class Delay(mx.operator.CustomOp):
    """Its input, ``seconds`` later: a gradient that backward writes late."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(self.seconds)
        self.assign(out_data[0], req[0], in_data[0])


@mx.operator.register("crossed_buckets_delay")
class DelayProp(mx.operator.CustomOpProp):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = float(seconds)

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, in_shape, []

    def create_operator(self, ctx, shapes, dtypes):
        return Delay(self.seconds)


def main():
    kv = mxhylo.create("dist_sync_hylo", policy=POLICY, warmup_steps=0, stall_timeout=30)
    names = list(LAYERS)
    for name in names:
        kv.broadcast(name, mx.nd.zeros(LAYERS[name]), out=mx.nd.zeros(LAYERS[name]))
    late = LATE if kv.rank == 0 else EARLY
    for step in range(STEPS):
        values = {}
        for name in names:
            # worker r's bucket gradients are r + 1 + step: their sum is known
            fill = float(kv.rank + 1 + step) if name != "fc_weight" else 0.0
            value = mx.nd.full(LAYERS[name], fill)
            if name == "fc_weight":
                value = mx.nd.array(np.random.RandomState(step).normal(
                    size=LAYERS[name]).astype(np.float32))
            seconds = FC_S if name == "fc_weight" else LATE_S if name in late else 0.0
            if seconds:
                value = mx.nd.Custom(value, op_type="crossed_buckets_delay",
                                     seconds=str(seconds))
            values[name] = value
        grads = [values[n] for n in names]
        kv.pushpull(names, grads)
        want = float(sum(r + 1 + step for r in range(kv.num_workers)))
        for name, grad in zip(names, grads):
            got = grad.asnumpy()
            if name == "fc_weight":
                assert np.isfinite(got).all(), name
            else:
                np.testing.assert_array_equal(got, np.full(LAYERS[name], want),
                                              err_msg=name)
        pushed = {n: kv.stats()["layers"][n]["last_push_s"] for n in names}
        early = [n for n in names if n not in late and n != "fc_weight"]
        assert max(pushed[n] for n in early) < pushed["fc_weight"] < min(
            pushed[n] for n in late), pushed
        print("step %d ok" % step, flush=True)


if __name__ == "__main__":
    main()
