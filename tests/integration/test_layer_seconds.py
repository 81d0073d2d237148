"""What each layer's exchange cost the worker (stats()['layers'][name]['last_seconds']):
its encode plus its pull's wait and decode, measured by every transport."""
import mxnet as mx
import numpy as np

import mxhylo


def test_every_layer_reports_what_its_exchange_cost():
    kv = mxhylo.create("hylo", warmup_steps=0, policy={"^conv$": "conv_topk"})
    shapes = {"conv": (256, 128, 3, 3), "fc": (256, 512), "bias": (64,)}
    rng = np.random.RandomState(0)
    for step in range(2):
        for name, shape in shapes.items():
            grad = [mx.nd.array(rng.normal(0, 0.01, shape).astype(np.float32))
                    for _ in range(2)]
            kv.pushpull(name, grad)
    layers = kv.stats()["layers"]
    assert set(layers) == set(shapes)
    for name, entry in layers.items():
        assert entry["last_seconds"] is not None and entry["last_seconds"] > 0, name
        # summed over the two steps: at least the last one
        assert entry["seconds"] >= entry["last_seconds"], name
    assert {layers[n]["policy"] for n in layers} == {"conv_topk", "fc_2bit", "none"}


def test_traffic_pull_seconds_add_up():
    from mxhylo.kvstore.transport import Traffic
    t = Traffic()
    assert t.pull_s == 0.0
    t.pull_s += 0.25
    t.count(0, pushed=8, pulled=4, messages=1)
    assert (t.pushed, t.pulled, t.per_server, t.messages, t.pull_s) == (8, 4, {0: 12}, 1, 0.25)
