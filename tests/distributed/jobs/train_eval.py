"""Train a small conv net on a synthetic 10-class image set with a Gluon Trainer,
evaluate it, save the Trainer's states: the kind of script a user runs distributed.

    python -m mxhylo.launch -n 2 -s 1 python train_eval.py --out res-{rank}.json
    python -m mxhylo.launch -n 2 -s 1 python -m mxhylo.run --kvstore dist_sync \\
        train_eval.py --kvstore dist_sync --out res-{rank}.json
    horovodrun -np 2 -H localhost:2 --gloo python train_eval.py --out res-{rank}.json

The data: 256 training and 64 held-out 1x8x8 images, each one of 10 fixed random
patterns plus noise (numpy RandomState(0): the same on every worker and every run).
Each worker trains on every W-th training image (W workers), steps with the Trainer
for --steps batches, evaluates on the held-out images, saves the Trainer's states,
and writes a JSON report ('{rank}' in --out): accuracy, a checksum of the trained
parameters, whether save_states worked (or what it raised), for a hylo store where
the Trainer's optimizer ran, why, and whether the cost model was used, and the
seconds each phase took (imports, the store, the first step, the others, evaluation
and save_states).

mxhylo is imported only for a hylo kvstore: a dist_sync run is plain MXNet.
"""
import time

STARTED = time.monotonic()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

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
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--out", required=True, help="JSON report, '{rank}' filled in")
args = parser.parse_args()

# Two optional imports of MXNet's (each tried, and done without on ImportError) serve
# APIs this script does not use: scikit-learn for the base class of the old
# FeedForward API (mxnet.model), scipy.stats for int8 quantization's calibration
# (mxnet.contrib.quantization). Kept out, they save every process that runs this
# script (scheduler and servers too) about 0.4 s of CPU at start-up.
sys.modules.setdefault("sklearn", None)
sys.modules.setdefault("scipy.stats", None)

if "hylo" in args.kvstore:
    import mxhylo          # registers the hylo kvstore types (a server serves from here)
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

CLASSES, TRAIN, HELD_OUT = 10, 256, 64
IMPORTED = time.monotonic()


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
    net.add(gluon.nn.Activation("relu"), gluon.nn.Dense(CLASSES))
    return net


def load_data(rank, workers):
    """This worker's training images and labels, and all held-out ones."""
    rs = np.random.RandomState(0)
    patterns = rs.rand(CLASSES, 1, 8, 8)
    y = rs.randint(0, CLASSES, size=TRAIN + HELD_OUT)
    x = (patterns[y] + 0.3 * rs.randn(len(y), 1, 8, 8)).astype(np.float32)
    y = y.astype(np.float32)
    return x[:TRAIN][rank::workers], y[:TRAIN][rank::workers], x[TRAIN:], y[TRAIN:]


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


def hylo_store(trainer, store):
    """The hylo store behind ``trainer``, or None for MXNet's stores. On the servers'
    route the Trainer holds that route's store; the hylo store is the one made here
    or, for a kvstore name, the one Gluon made (mxhylo records it as active)."""
    if "hylo" not in args.kvstore:
        return None
    if hasattr(trainer._kvstore, "plans"):
        return trainer._kvstore
    if not isinstance(store, str):
        return store
    from mxhylo.kvstore.active import active
    return active()


def main():
    mx.random.seed(42)
    seconds = {"imports": IMPORTED - STARTED}
    clock = time.monotonic()
    store = make_store()
    seconds["store"] = time.monotonic() - clock
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
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9}, kvstore=store,
                            **options)

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = args.batch_size
    clock = time.monotonic()
    for step in range(args.steps):
        rows = np.arange(step * batch, (step + 1) * batch) % len(y)
        data, label = mx.nd.array(x[rows]), mx.nd.array(y[rows])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(batch * workers)
        if step == 0:
            seconds["first_step"] = time.monotonic() - clock
            clock = time.monotonic()
    seconds["steps"] = time.monotonic() - clock
    clock = time.monotonic()

    predicted = net(mx.nd.array(x_val)).argmax(axis=1).asnumpy()
    accuracy = float((predicted == y_val).mean())

    path = args.out.format(rank=rank) + ".states"
    try:
        trainer.save_states(path)
        saved = {"ok": os.path.exists(path)}
    except Exception as exc:       # noqa: BLE001  (reported, the test judges it)
        saved = {"ok": False, "type": type(exc).__name__, "message": str(exc)}

    seconds["evaluate_save"] = time.monotonic() - clock
    total, digest = checksum(net)
    report = {"rank": rank, "workers": workers, "accuracy": accuracy,
              "checksum": total, "sha256": digest, "save_states": saved,
              "store": type(trainer._kvstore).__name__,
              "update_on_kvstore": bool(trainer._update_on_kvstore),
              "seconds": seconds}
    hylo = hylo_store(trainer, store)
    if hylo is not None:
        stats = hylo.stats()
        report["route"] = stats["route"]
        report["cost_model"] = stats["options"]["cost_model"]
    if hasattr(trainer._kvstore, "plans"):      # a hylo store on the workers' route
        report["policies"] = {name: plan.strategy
                              for name, plan in trainer._kvstore.plans().items()}
    with open(args.out.format(rank=rank), "w") as f:
        json.dump(report, f)
    print("worker %d of %d: accuracy %.3f, save_states %s" % (
        rank, workers, accuracy, saved["ok"]), flush=True)


if __name__ == "__main__":
    main()
