"""A user-shaped script: a BatchNorm conv net on the digits (8x8), a Gluon Trainer made
without a kvstore, trained STEPS steps, then evaluated over the whole validation set.

Run alone it is one process with batch W*b; under
``python -m mxhylo.launch -n W -s 1 python -m mxhylo.run [--sync-batchnorm] SCRIPT``
each worker takes its b samples of every step's W*b (the job's size from the store
mx.kv.create returns under mxhylo.run), so the W workers together see exactly one
process's batches, and mxhylo.run gives the Trainer the job's store.

Writes one JSON report, {"rank", "workers", "losses" (this process's mean loss at each
step), "accuracy" (over the whole validation set, with the running statistics)}, to
REPORT_DIR/rank<R>.json (a file per worker: launchers that merge the workers' stdout
may interleave their lines). Options: --batch B (the whole step's batch, W*b; default
32), --steps N (default 12), --hybridize, --report-dir REPORT_DIR (required).
"""
import argparse
import json
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def digits():
    """The digits as (N, 1, 8, 8) float32 in [0, 1] and labels; a fixed 1437/360 split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.float32)
    order = np.random.RandomState(0).permutation(len(y))
    x, y = x[order], y[order]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=1),
            gluon.nn.BatchNorm(in_channels=16), gluon.nn.Activation("relu"),
            gluon.nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=16),
            gluon.nn.BatchNorm(in_channels=16), gluon.nn.Activation("relu"),
            gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
            gluon.nn.Dense(32, in_units=256), gluon.nn.BatchNorm(in_channels=32),
            gluon.nn.Activation("relu"), gluon.nn.Dense(10, in_units=32))
    return net


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hybridize", action="store_true")
    p.add_argument("--report-dir", required=True)
    args = p.parse_args()

    rank, workers = 0, 1
    if os.environ.get("DMLC_ROLE") == "worker" or "HOROVOD_RANK" in os.environ:
        kv = mx.kv.create("dist_sync")          # the job's store, under mxhylo.run
        rank, workers = kv.rank, kv.num_workers
    if args.batch % workers:
        raise SystemExit("--batch %d does not split over %d workers" % (args.batch, workers))
    b = args.batch // workers

    mx.random.seed(1)
    net = make_net()
    net.initialize(mx.init.Xavier())
    if args.hybridize:
        net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    (x, y), (vx, vy) = digits()
    losses = []
    for step in range(args.steps):
        lo = (step * args.batch) % (len(y) - args.batch) + rank * b
        data, label = mx.nd.array(x[lo:lo + b]), mx.nd.array(y[lo:lo + b])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(b)
        losses.append(float(loss.mean().asscalar()))
    predicted = net(mx.nd.array(vx)).argmax(axis=1).asnumpy()
    report = {"rank": rank, "workers": workers, "losses": losses,
              "accuracy": float((predicted == vy).mean())}
    with open(os.path.join(args.report_dir, "rank%d.json" % rank), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
