"""A Gluon script that evaluates its freshly initialised net before it trains.

    python eval_then_train.py STORE OUT     (a worker of a parameter-server job)

STORE: 'dist_sync' (MXNet's own store; mxhylo imported unless NO_MXHYLO=1 is set) or
'hylo' (mxhylo.create(), server_update=False). The net is evaluated once (an inference
forward, which leaves its convolution weights in oneDNN's own layout), then the Trainer
(update_on_kvstore=False) checkpoints its state before the first step, which sends the
parameters to the servers, then trains 3 steps. Writes OUT.<rank>.npz: every parameter.
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
kv = mx.kv.create("dist_sync") if store == "dist_sync" else mxhylo.create(server_update=False)
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                        kvstore=kv, update_on_kvstore=False)
trainer.save_states(out + ".%d.states" % kv.rank)   # a checkpoint before training
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for _ in range(3):
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(8 * kv.num_workers)
np.savez(out + ".%d.npz" % kv.rank,
         **{name: p.data().asnumpy() for name, p in net.collect_params().items()})
