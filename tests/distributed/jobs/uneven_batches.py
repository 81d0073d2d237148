"""A worker whose part of the data is one sample larger than the other's: its last batch
of every epoch is larger, so with the optimizer on the workers it scales the summed
gradient by another batch size than the other worker.

    python -m mxhylo.launch -n 2 -s 1 python uneven_batches.py

Trains a small dense net on the digits, batch 32, 2 epochs (16 steps each), with
server_update=False, and prints 'trained' at the end if nothing stopped it.
"""
import mxnet as mx
from mxnet import autograd, gluon

import mxhylo
from mxhylo.data import load_digits

kv = mxhylo.create("dist_sync_hylo", server_update=False, cost_model=False)
x, y, _, _ = load_digits()
mine = slice(0, 500) if kv.rank == 0 else slice(500, 1001)        # 500 and 501 samples
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
batches = gluon.data.DataLoader(gluon.data.ArrayDataset(x[mine], y[mine]), batch_size=32)
for epoch in range(2):
    for data, label in batches:
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(data.shape[0])
print("trained", flush=True)
