"""Train on scikit-learn's digits with a growing batch and a one-cycle momentum.

The training loop is a plain Gluon loop (one trainer.step per micro-batch); only the
``mxhylo.schedules.attach`` line is added. From epoch --grow-at on, each update takes 2
micro-batches, and 4 from the next, so the job exchanges gradients half and then a
quarter as often; the lr follows k (linear scaling) and the momentum cycles against it.

    python examples/train_schedules.py                          # one process, no kvstore
    python -m mxhylo.launch -n 2 -s 1 python examples/train_schedules.py --kvstore dist_sync_hylo
    python -m mxhylo.launch -n 2 -s 1 python examples/train_schedules.py --kvstore dist_sync

Each epoch it prints the test accuracy, k, the momentum and the lr of the last update,
and the exchanges (updates) so far; --json writes them per epoch ('{rank}' filled in).
"""
import argparse
import json

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mxhylo
from mxhylo import schedules
from mxhylo.data import load_digits, shard


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvstore", default=None,
                        help="dist_sync_hylo, dist_sync, ... (default: none, one process)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per micro-batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--grow-at", default="4,8",
                        help="epochs at which k, the micro-batches per update, doubles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-epoch log here ('{rank}' filled in)")
    args = parser.parse_args()

    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    kv = mxhylo.create(args.kvstore) if args.kvstore and "hylo" in args.kvstore \
        else (mx.kv.create(args.kvstore) if args.kvstore else None)
    rank, workers = (kv.rank, kv.num_workers) if kv is not None else (0, 1)
    x_train, y_train, x_test, y_test = load_digits()
    x_train, y_train = shard(x_train, y_train, workers, rank)
    train_data = gluon.data.DataLoader(gluon.data.ArrayDataset(x_train, y_train),
                                       batch_size=args.batch_size, shuffle=True,
                                       last_batch="discard")

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(),
            gluon.nn.Flatten(), gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": args.lr, "momentum": 0.9, "wd": 1e-4},
                            kvstore=kv if kv is not None else "device")
    grow_at = [float(e) for e in args.grow_at.split(",") if e.strip()]
    schedules.attach(trainer, iters_per_epoch=len(train_data),
                     batch=schedules.StepBatch(grow_at),
                     momentum=schedules.OneCycleMomentum(args.epochs, high=0.95, low=0.85))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    log = []
    for epoch in range(args.epochs):
        for x, y in train_data:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
        pred = net(mx.nd.array(x_test)).argmax(axis=1).asnumpy()
        s = trainer.schedules
        entry = {"epoch": epoch + 1, "accuracy": float((pred == y_test).mean()), "k": s.k,
                 "momentum": trainer.optimizer.momentum, "lr": trainer.learning_rate,
                 "updates": s.updates}
        log.append(entry)
        print("worker %d epoch %2d: test accuracy %.4f, k %d, momentum %.3f, lr %.4f, "
              "%d exchanges so far" % (rank, epoch + 1, entry["accuracy"], entry["k"],
                                       entry["momentum"], entry["lr"], entry["updates"]),
              flush=True)
    if args.json:
        with open(args.json.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "workers": workers, "kvstore": args.kvstore,
                       "log": log}, f, indent=1)


if __name__ == "__main__":
    main()
