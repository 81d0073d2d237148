"""Train a small conv net on scikit-learn's digits with a Gluon Trainer, evaluate it,
save the Trainer's states: the kind of script a user runs distributed.

    python -m mxhylo.launch -n 2 -s 1 python train_eval.py --out res-{rank}.json
    python -m mxhylo.launch -n 2 -s 1 python -m mxhylo.run --kvstore dist_sync \\
        train_eval.py --kvstore dist_sync --out res-{rank}.json
    horovodrun -np 2 -H localhost:2 --gloo python train_eval.py --out res-{rank}.json

Each worker trains on every W-th training image (W workers), steps with the Trainer
for --steps batches, evaluates on the held-out images, saves the Trainer's states,
and writes a JSON report ('{rank}' in --out): accuracy, a checksum of the trained
parameters, and whether save_states worked (or what it raised).

mxhylo is imported only for a hylo kvstore: a dist_sync run is plain MXNet.
"""
import argparse
import hashlib
import json
import os

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--kvstore", default="dist_sync_hylo",
                    help="dist_sync_hylo (mxhylo's) or dist_sync (MXNet's)")
parser.add_argument("--store", choices=("string", "object"), default="object",
                    help="give the Trainer the kvstore's name, or a store made here")
parser.add_argument("--hylo-options", type=json.loads, default={},
                    help="JSON options for mxhylo.create (with --store object)")
parser.add_argument("--update-on-kvstore", choices=("unset", "false", "true"),
                    default="unset")
parser.add_argument("--hybridize", action="store_true")
parser.add_argument("--batchnorm", action="store_true")
parser.add_argument("--deferred-init", action="store_true",
                    help="give the Trainer the net before any forward (shapes unknown)")
parser.add_argument("--two-trainers", action="store_true",
                    help="two Trainers on one store, each with half of the parameters")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--out", required=True, help="JSON report, '{rank}' filled in")
args = parser.parse_args()

if "hylo" in args.kvstore:
    import mxhylo          # registers the hylo kvstore types (a server serves from here)
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def make_store():
    if args.store == "string":
        return args.kvstore
    if "hylo" in args.kvstore:
        return mxhylo.create(args.kvstore, **args.hylo_options)
    return mx.kv.create(args.kvstore)


def job_rank(store):
    """(rank, number of workers): the store's, or the launcher's for a kvstore name
    (Gluon creates that store only at the first step)."""
    if not isinstance(store, str):
        return store.rank, store.num_workers
    if "HOROVOD_RANK" in os.environ and "DMLC_ROLE" not in os.environ:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    return int(os.environ["DMLC_TASK_ID"]), int(os.environ["DMLC_NUM_WORKER"])


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1))
    if args.batchnorm:
        net.add(gluon.nn.BatchNorm())
    net.add(gluon.nn.Activation("relu"), gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
            gluon.nn.Dense(16))
    if args.batchnorm:
        net.add(gluon.nn.BatchNorm())
    net.add(gluon.nn.Activation("relu"), gluon.nn.Dense(10))
    return net


def load_data(rank, workers):
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]    # (N, 1, 8, 8)
    y = digits.target.astype(np.float32)
    n_val = len(y) // 5
    return x[n_val:][rank::workers], y[n_val:][rank::workers], x[:n_val], y[:n_val]


def checksum(net):
    """A float64 sum and a sha256 of the trained parameters (BatchNorm's running
    statistics are each worker's own and left out)."""
    total, digest = 0.0, hashlib.sha256()
    for name, param in sorted(net.collect_params().items()):
        if param.grad_req == "null":
            continue
        value = param.data().asnumpy()
        total += float(np.sum(value, dtype=np.float64))
        digest.update(name.encode() + value.tobytes())
    return total, digest.hexdigest()


def main():
    mx.random.seed(42)
    store = make_store()
    rank, workers = job_rank(store)
    x, y, x_val, y_val = load_data(rank, workers)

    net = make_net()
    net.initialize(mx.init.Xavier())
    if args.hybridize:
        net.hybridize()
    if not args.deferred_init:
        net(mx.nd.zeros((1, 1, 8, 8)))

    options = {}
    if args.update_on_kvstore != "unset":
        options["update_on_kvstore"] = args.update_on_kvstore == "true"
    sgd = {"learning_rate": 0.1, "momentum": 0.9}
    params = net.collect_params()
    if args.two_trainers:
        names = sorted(params.keys())
        halves = [names[:len(names) // 2], names[len(names) // 2:]]
        trainers = [gluon.Trainer({n: params[n] for n in half}, "sgd", sgd, kvstore=store,
                                  **options) for half in halves]
    else:
        trainers = [gluon.Trainer(params, "sgd", sgd, kvstore=store, **options)]

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = args.batch_size
    for step in range(args.steps):
        lo = step * batch % (len(y) - batch)
        data, label = mx.nd.array(x[lo:lo + batch]), mx.nd.array(y[lo:lo + batch])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        for trainer in trainers:
            trainer.step(batch * workers)

    predicted = net(mx.nd.array(x_val)).argmax(axis=1).asnumpy()
    accuracy = float((predicted == y_val).mean())

    saved = []
    for i, trainer in enumerate(trainers):
        path = args.out.format(rank=rank) + ".states%d" % i
        try:
            trainer.save_states(path)
            saved.append({"ok": os.path.exists(path)})
        except Exception as exc:       # noqa: BLE001  (reported, the test judges it)
            saved.append({"ok": False, "type": type(exc).__name__, "message": str(exc)})

    total, digest = checksum(net)
    report = {"rank": rank, "workers": workers, "accuracy": accuracy,
              "checksum": total, "sha256": digest, "save_states": saved,
              "stores": [type(t._kvstore).__name__ for t in trainers],
              "update_on_kvstore": [bool(t._update_on_kvstore) for t in trainers]}
    kv = trainers[0]._kvstore
    if hasattr(kv, "plans"):            # a hylo store on the workers' route
        report["route"] = kv.stats()["route"]
        report["policies"] = {name: plan.strategy for name, plan in kv.plans().items()}
    with open(args.out.format(rank=rank), "w") as f:
        json.dump(report, f)
    print("worker %d of %d: accuracy %.3f, save_states %s" % (
        rank, workers, accuracy, [s["ok"] for s in saved]), flush=True)


if __name__ == "__main__":
    main()
