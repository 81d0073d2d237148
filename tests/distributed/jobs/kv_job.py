"""Workers of a short job for test_security.py: an mxhylo store exchanges three layers
once (conv_topk, fc_2bit and uncompressed, so that the servers decode 'rows', 'slots'
and dense keys), then each worker writes DIR/ready-RANK and waits until DIR/release
exists (at most HOLD_S seconds): the test reads the job's sockets meanwhile.

    python tests/distributed/jobs/kv_job.py DIR      (under mxhylo.launch)

The scheduler and the servers run this file too and never get past the imports
(they serve inside them).
"""
import os
import sys
import time

import mxnet as mx
import numpy as np

import mxhylo

HOLD_S = 30
# layer name -> shape; the policy below gives each layer its codec by name
LAYERS = {"conv0_weight": (16, 8, 3, 3), "fc0_weight": (32, 64), "fc0_bias": (10,)}
POLICY = {"conv": "conv_topk", "fc0_weight": "fc_2bit", "bias": "none"}


def main(folder):
    kv = mxhylo.create("dist_sync_hylo", policy=POLICY, warmup_steps=0)
    rng = np.random.RandomState(kv.rank)
    for name, shape in LAYERS.items():
        kv.broadcast(name, mx.nd.zeros(shape), out=mx.nd.zeros(shape))
    for name, shape in LAYERS.items():
        grad = mx.nd.array(rng.normal(size=shape).astype(np.float32))
        kv.pushpull(name, grad)
        assert np.isfinite(grad.asnumpy()).all()
    # what the servers decoded: each layer's codec and its keys' kinds and pulls
    keys = kv.transport.keys
    for name in LAYERS:
        print("layer %s codec %s keys %s" % (
            name, kv.stats()["layers"][name]["policy"],
            ",".join("%s/%s" % (c.layout.kind, c.layout.pull) for c in keys.chunks[name])),
            flush=True)
    with open(os.path.join(folder, "ready-%d" % kv.rank), "w") as f:
        f.write("%d\n" % os.getpid())
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1])
