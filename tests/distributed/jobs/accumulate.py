"""Accumulate k micro-batches per update under a distributed store, and check the
result against one process stepping on the whole batch: a user's script with
mxhylo.schedules.

    python -m mxhylo.launch -n 2 -s 1 python accumulate.py --kvstore dist_sync --out r-{rank}.json
    python -m mxhylo.launch -n 2 -s 1 python accumulate.py --kvstore dist_sync_hylo --out ...
    horovodrun -np 2 -H localhost:2 --gloo python accumulate.py --kvstore horovod --out ...

Each worker w trains a net without BatchNorm on its own micro-batches (numpy
RandomState(w)) with a Trainer given the store (or Horovod's DistributedTrainer),
momentum SGD with weight decay,
and ``schedules.attach(trainer, batch=StepBatch([2], base=2))``: 2 micro-batches an
update for the first 2 epochs (2 updates of 2 micro-batches an epoch), then 4 (2 updates), the lr doubled with k.
The reference, in the same process: a Trainer without a kvstore stepping once per
update on every worker's micro-batches of that update, concatenated, with the lr set
by hand. The report ('{rank}' in --out): the largest relative difference of any
parameter, the update count, the route a hylo store took.
"""
import argparse
import json
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--kvstore", default="dist_sync_hylo")
parser.add_argument("--out", required=True)
args = parser.parse_args()

sys.modules.setdefault("sklearn", None)
sys.modules.setdefault("scipy.stats", None)
import mxhylo  # noqa: E402,F401  (registers the hylo kvstore types; a server serves here)
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mxhylo import schedules  # noqa: E402

IN, OUT, MICRO, ITERS_PER_EPOCH = 12, 3, 4, 2
LR, OPTS = 0.05, {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}
KS = [2, 2, 4, 4]                         # micro-batches of each update
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def net():
    mx.random.seed(7)
    n = gluon.nn.HybridSequential(prefix="net_")
    with n.name_scope():
        n.add(gluon.nn.Dense(16, activation="tanh", in_units=IN),
              gluon.nn.Dense(OUT, in_units=16))
    n.initialize(mx.init.Xavier())
    n.hybridize()
    return n


def micro_batches(worker):
    rng = np.random.RandomState(worker)
    return [(rng.normal(size=(MICRO, IN)).astype(np.float32),
             rng.randint(0, OUT, size=MICRO).astype(np.float32)) for _ in range(sum(KS))]


def step(n, trainer, x, y, batch_size):
    with autograd.record():
        loss = LOSS(n(mx.nd.array(x)), mx.nd.array(y))
    loss.backward()
    trainer.step(batch_size)


acc = net()
if args.kvstore == "horovod":
    import horovod.mxnet as hvd
    hvd.init()
    kv, rank, workers = None, hvd.rank(), hvd.size()
    hvd.broadcast_parameters(acc.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(acc.collect_params(), "sgd", dict(OPTS))
    averaged = workers            # Horovod averages the workers' gradients
else:
    if "hylo" in args.kvstore:
        kv = mxhylo.create(args.kvstore, policy={".*": "none"})    # compression off
    else:
        kv = mx.kv.create(args.kvstore)
    rank, workers, averaged = kv.rank, kv.num_workers, 1
    trainer = gluon.Trainer(acc.collect_params(), "sgd", dict(OPTS), kvstore=kv)
sched = schedules.attach(trainer, iters_per_epoch=ITERS_PER_EPOCH,
                         batch=schedules.StepBatch([2], base=2))
for x, y in micro_batches(rank):
    step(acc, trainer, x, y, MICRO)

ref = net()
ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(OPTS), kvstore=None)
data = [micro_batches(w) for w in range(workers)]
first = 0
for k in KS:
    ref_trainer.set_learning_rate(LR * k / KS[0])
    xs = [data[w][i][0] for w in range(workers) for i in range(first, first + k)]
    ys = [data[w][i][1] for w in range(workers) for i in range(first, first + k)]
    # the store sums the workers' gradients, each the mean over its own k micro-batches
    # (Horovod averages them: the mean over all)
    step(ref, ref_trainer, np.concatenate(xs), np.concatenate(ys), k * MICRO * averaged)
    first += k

worst = 0.0
for (name, a), b in zip(acc.collect_params().items(), ref.collect_params().values()):
    a, b = a.data().asnumpy(), b.data().asnumpy()
    worst = max(worst, float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))))
route = kv.plan().route if kv is not None and hasattr(kv, "plan") else None
with open(args.out.format(rank=rank), "w") as f:
    json.dump({"rank": rank, "workers": workers, "max_rel_diff": worst,
               "updates": sched.updates, "k": sched.k,
               "num_update": trainer._optimizer.num_update, "route": route}, f)
