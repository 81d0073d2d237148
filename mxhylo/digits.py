"""A complete Gluon training run on the built-in digits, with any kvstore.

Used by examples/train_digits.py, the tests and the accuracy benchmarks, so that all
of them train exactly the same way. Runs in one process (several contexts) or as one
worker of a parameter-server job (it then trains on its shard of the data).
"""
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from .data import load_digits, shard
from .models import NETS


def evaluate(net, x, y, ctx):
    """Top-1 accuracy of ``net`` on arrays x (N, C, H, W), y (N,)."""
    correct = 0
    for lo in range(0, len(y), 256):
        out = net(mx.nd.array(x[lo:lo + 256], ctx=ctx))
        correct += int((out.argmax(axis=1).asnumpy() == y[lo:lo + 256]).sum())
    return correct / len(y)


LR_SCHEDULES = ("constant", "cosine")


def lr_scheduler(schedule, lr, total_steps, warmup_steps):
    """The learning-rate scheduler of ``schedule`` (None for 'constant', the fixed
    ``lr``): 'cosine' is gluoncv's ``--lr-mode cosine``, a linear ramp from 0 over
    ``warmup_steps`` updates, then a cosine from ``lr`` down to 0 at ``total_steps``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError("lr_schedule must be one of %s, got %r"
                         % (", ".join(LR_SCHEDULES), schedule))
    if warmup_steps < 0 or (schedule == "cosine" and warmup_steps >= total_steps):
        raise ValueError("warm-up of %d steps does not fit a run of %d steps"
                         % (warmup_steps, total_steps))
    if schedule == "constant":
        return None
    return mx.lr_scheduler.CosineScheduler(max_update=total_steps, base_lr=lr, final_lr=0.0,
                                           warmup_steps=warmup_steps, warmup_begin_lr=0.0)


def train(kvstore="device", contexts=None, epochs=10, batch_size=64, lr=0.05, momentum=0.9,
          wd=1e-4, seed=0, log=None, net="digits_net", test_fraction=0.25, eval_every=None,
          lr_schedule="constant", warmup_epochs=0.0):
    """Train a digits net with SGD; returns a dict (accuracy, history: test accuracy after
    every epoch, curve: [(step, test accuracy)] every ``eval_every`` steps (default: each
    epoch), seconds, params: name -> numpy array of every trainable parameter, stats:
    kv.stats() or None).

    net: a name of mxhylo.models.NETS (digits_net at 8x8, conv_net at 16x16, resnet20 at
    16x16 in 3 channels); test_fraction: of the 1797 images held out.

    lr_schedule: 'constant' (``lr`` throughout) or 'cosine' (see :func:`lr_scheduler`,
    ``warmup_epochs`` of linear ramp first, then down to 0 at the last step).

    kvstore: a name or a KVStoreBase (None: no kvstore); contexts: list of mx.Context
    (default [cpu(0), cpu(1)]: two devices in one process). batch_size is per worker and
    is split over the contexts. With a distributed kvstore each worker trains on its
    shard, and gradients are averaged over all workers' samples.
    """
    contexts = contexts or [mx.cpu(0), mx.cpu(1)]
    mx.random.seed(seed)
    np.random.seed(seed)
    if net not in NETS:
        raise ValueError("net must be one of %s, got %r" % (", ".join(NETS), net))
    make_net, size, channels = NETS[net]
    x_train, y_train, x_test, y_test = load_digits(test_fraction, seed=0, size=size,
                                                   channels=channels)

    net = make_net()
    net.initialize(mx.init.Xavier(), ctx=contexts)
    net.hybridize()
    kv = mx.kv.create(kvstore) if isinstance(kvstore, str) else kvstore
    workers, rank = (kv.num_workers, kv.rank) if kv is not None else (1, 0)
    x_mine, y_mine = shard(x_train, y_train, workers, rank)
    steps_per_epoch = len(y_mine) // batch_size
    sgd = {"learning_rate": lr, "momentum": momentum, "wd": wd}
    scheduler = lr_scheduler(lr_schedule, lr, epochs * steps_per_epoch,
                             int(round(warmup_epochs * steps_per_epoch)))
    if scheduler is not None:
        sgd["lr_scheduler"] = scheduler
    trainer = gluon.Trainer(net.collect_params(), "sgd", sgd,
                            kvstore=kv, update_on_kvstore=False if kv is not None else None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(seed + 1000 * rank)
    start = time.time()
    history, curve, done = [], [], 0
    for epoch in range(epochs):
        order = rng.permutation(len(y_mine))
        for step in range(steps_per_epoch):
            idx = order[step * batch_size:(step + 1) * batch_size]
            xs = gluon.utils.split_and_load(x_mine[idx], contexts)
            ys = gluon.utils.split_and_load(y_mine[idx], contexts)
            with autograd.record():
                losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(batch_size * workers)
            done += 1
            if eval_every and done % eval_every == 0:
                curve.append((done, evaluate(net, x_test, y_test, contexts[0])))
        acc = evaluate(net, x_test, y_test, contexts[0])
        history.append(acc)
        if not curve or curve[-1][0] != done:
            curve.append((done, acc))
        if log:
            log("epoch %d  test accuracy %.4f" % (epoch + 1, acc))
    mx.nd.waitall()
    # trainable parameters only: BatchNorm's running statistics are each worker's own
    params = {name: p.data(contexts[0]).asnumpy()
              for name, p in net.collect_params().items() if p.grad_req != "null"}
    stats = kv.stats() if hasattr(kv, "stats") else None
    return {"accuracy": history[-1], "history": history, "curve": curve,
            "seconds": time.time() - start, "steps_per_epoch": steps_per_epoch,
            "params": params, "stats": stats, "workers": workers, "rank": rank}
