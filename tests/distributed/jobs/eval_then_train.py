"""A Gluon script that evaluates its freshly initialised net before it trains.

    python eval_then_train.py STORE OUT     (a worker of a parameter-server job)

STORE: 'dist_sync' (MXNet's own store; mxhylo imported unless NO_MXHYLO=1 is set),
'hylo' (mxhylo.create(server_update=False): the optimizer on the workers) or
'hylo_servers' (server_update=True: on the servers). The net is evaluated once (an
inference forward, which leaves its convolution weights in oneDNN's own layout), then
the Trainer sends the parameters to the servers before its first step (a checkpoint
of its state where the optimizer runs on the workers, else its first step), then
trains 3 steps. The first step's input waits behind a large matrix product, so that
Python queues the whole step, the parameters' initial push included, before its
forward runs (the forward is what would queue oneDNN's layout change back). Writes
OUT.<rank>.npz: every parameter.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

if os.environ.get("NO_MXHYLO") != "1":
    import mxhylo

store, out = sys.argv[1], sys.argv[2]
mx.random.seed(0)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
        gluon.nn.Conv2D(32, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(2),
        gluon.nn.Flatten(), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
x = mx.nd.random.uniform(shape=(8, 1, 8, 8))
y = mx.nd.array(np.arange(8) % 10)
net(x).argmax(axis=1).asnumpy()            # accuracy before training
if store == "dist_sync":
    kv = mx.kv.create("dist_sync")
else:
    kv = mxhylo.create(server_update=store == "hylo_servers")
on_workers = store != "hylo_servers"
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv,
                        update_on_kvstore=False if on_workers else None)
if on_workers:
    trainer.save_states(out + ".%d.states" % kv.rank)   # a checkpoint before training
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
big = mx.nd.ones((1024, 1024))
hold = mx.nd.dot(mx.nd.dot(big, big), big).sum() * 0       # about 0.1-0.5 s of work
for step in range(3):
    with autograd.record():
        loss = loss_fn(net(x + hold if step == 0 else x), y)
    loss.backward()
    trainer.step(8 * kv.num_workers)
# Wait for the engine before reading the weights. The first training forward after an
# inference forward queues a change of each convolution weight's layout back to MXNet's
# own *while it runs*, behind every operation already queued; this script queues all of
# its training before that forward runs (the large product above), so a read here would
# wait for the last update only and could read the weight while the engine changes its
# layout (a segmentation fault in NDArray::Reorder2Default). That race is MXNet's: plain
# MXNet with no kvstore shows it too. waitall() also waits for the operations queued
# while others ran.
mx.nd.waitall()
np.savez(out + ".%d.npz" % kv.rank,
         **{name: p.data().asnumpy() for name, p in net.collect_params().items()})
