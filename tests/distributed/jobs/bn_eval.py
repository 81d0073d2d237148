"""A user-shaped worker: a BatchNorm conv net trained with a Gluon Trainer over a
parameter-server store, evaluated between training steps.

An evaluation forward (not recording) lets oneDNN reorder the conv weights into its
own layout, in the parameter's array itself; the next step's exchange then writes the
parameter. Every store must take that: the test is tests/distributed/test_param_arrays.py.

Run under ``python -m mxhylo.launch -n 2 -s 1``. The store comes from the environment:
  BN_EVAL_STORE=servers    mxhylo.create('dist_sync_hylo', server_update=True)
                           (the servers' route)
  BN_EVAL_STORE=workers    mxhylo.create('dist_sync_hylo', server_update=False)
                           (the workers' route)
  BN_EVAL_STORE=dist_sync  mx.kv.create('dist_sync')
  BN_EVAL_OPTIONS          optional JSON of more mxhylo.create options, e.g.
                           {"policy": {".*": "none"}, "cost_model": false}
Options:
  --out PATTERN   where each worker writes its JSON report ('{rank}' filled in):
                  accuracies at both evaluations and a sha256 of its trained parameters
  --steps N       training steps before the first evaluation (default 10)
  --hybridize     hybridize the net (default: imperative, as most user scripts are)
  --hold SIZE     after the first evaluation, hold each batch back behind a SIZE x SIZE
                  matrix product (see held_back): oneDNN switches a weight back to
                  MXNet's layout only when a training forward runs, so the steps' pulls
                  then reach weights still in oneDNN's layout (without it, whether they
                  do depends on how far Python runs ahead of MXNet's engine)
"""
import argparse
import hashlib
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mxhylo

BATCH = 32          # samples per worker per step


def make_store(kind, options):
    """The kvstore BN_EVAL_STORE names (see the module's docstring); ``options``: more
    options of a hylo store (dict)."""
    if kind == "dist_sync":
        return mx.kv.create("dist_sync")
    if kind not in ("servers", "workers"):
        raise ValueError("BN_EVAL_STORE must be servers, workers or dist_sync: %r" % kind)
    return mxhylo.create("dist_sync_hylo", server_update=kind == "servers", **options)


def make_net():
    """[Conv(16, 3x3) - BatchNorm - relu] x 2, 2x2 max pool, Dense(32) - BatchNorm -
    relu, Dense(10): input (N, 1, 8, 8), output (N, 10) logits."""
    net = gluon.nn.HybridSequential()
    for _ in range(2):
        net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False),
                gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
    net.add(gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
            gluon.nn.Dense(32), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
            gluon.nn.Dense(10))
    return net


def load_data(num_workers, rank):
    """(x_train, y_train) of this worker (every num_workers-th sample from ``rank``)
    and the whole (x_val, y_val): x float32 (N, 1, 8, 8) in [0, 1], y float32 (N,)."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.float32)
    n_val = len(y) // 4
    x_train, y_train = x[n_val:][rank::num_workers], y[n_val:][rank::num_workers]
    return x_train, y_train, x[:n_val], y[:n_val]


def held_back(data, size):
    """``data`` unchanged, but ready only once a ``size`` x ``size`` float32 matrix
    product has run in MXNet's engine (about size**3 * 2 flops): the Python thread
    then queues a whole training step, pulls included, before its first layer runs."""
    square = mx.nd.ones((size, size))
    return data + 0 * mx.nd.dot(square, square).sum()


def train_steps(net, trainer, x, y, first, count, hold=0):
    """``count`` training steps on batches of BATCH samples, from batch ``first``
    (hold > 0: each batch held_back by a product of that size)."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(first, first + count):
        lo = (step * BATCH) % (len(y) - BATCH)
        data, label = mx.nd.array(x[lo:lo + BATCH]), mx.nd.array(y[lo:lo + BATCH])
        if hold:
            data = held_back(data, hold)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(BATCH)


def accuracy(net, x, y):
    """Fraction of ``x`` classified as ``y`` by an inference forward (the one in which
    oneDNN reorders weights)."""
    predicted = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float((predicted == y).mean())


def params_sha256(net):
    """sha256 of the parameters the store synchronises (BatchNorm's running statistics
    are each worker's own), in name order, as float32 bytes."""
    digest = hashlib.sha256()
    for name, p in sorted(net.collect_params().items()):
        if p.grad_req != "null":
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(p.data().asnumpy()).tobytes())
    return digest.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hybridize", action="store_true")
    ap.add_argument("--hold", type=int, default=0, metavar="SIZE",
                    help="hold each batch back behind a SIZE x SIZE matrix product")
    args = ap.parse_args()
    kind = os.environ.get("BN_EVAL_STORE", "servers")
    options = json.loads(os.environ.get("BN_EVAL_OPTIONS") or "{}")

    kv = make_store(kind, options)
    mx.random.seed(0)
    net = make_net()
    net.initialize(mx.init.Xavier())
    if args.hybridize:
        net.hybridize()
    # (left unset on the other stores: Gluon asks the store, as a user's script does)
    trainer_options = {"update_on_kvstore": False} if kind == "workers" else {}
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9, "wd": 5e-4},
                            kvstore=kv, **trainer_options)
    x, y, x_val, y_val = load_data(kv.num_workers, kv.rank)
    train_steps(net, trainer, x, y, 0, args.steps)
    first = accuracy(net, x_val, y_val)
    train_steps(net, trainer, x, y, args.steps, 2, args.hold)
    second = accuracy(net, x_val, y_val)
    report = {"store": kind, "rank": kv.rank, "accuracy": [first, second],
              "params_sha256": params_sha256(net)}
    with open(args.out.format(rank=kv.rank), "w") as f:
        json.dump(report, f)
    print("rank %d: accuracy %.4f then %.4f" % (kv.rank, first, second), flush=True)


if __name__ == "__main__":
    sys.exit(main())
