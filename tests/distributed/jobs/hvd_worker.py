"""One Horovod worker of tests/distributed/test_horovod.py, started by horovodrun --gloo.

    horovodrun -np 2 -H localhost:2 --gloo python tests/distributed/jobs/hvd_worker.py MODE OUT_DIR

MODE:
  hylo  a small conv net (one conv_topk layer, one fc_2bit layer, small 'none' layers)
        trained a few Gluon Trainer steps with the hylo store over Horovod (transport
        'auto': horovodrun's environment picks 'horovod'), momentum SGD, two warm-up
        steps (dense) then compressed ones. Writes OUT_DIR/hylo-<rank>.npz (the
        parameters) and OUT_DIR/hylo-<rank>.json (kv.stats()).
  lars  the hylo mode's net and store under mxhylo.LARSTrainer (dynamic loss scaling:
        the store sums scaled gradients, the trainer unscales): writes
        OUT_DIR/lars-<rank>.npz and OUT_DIR/lars-<rank>.json (kv.stats(), loss scale).
  run   (under python -m mxhylo.run) a Trainer created without a kvstore: writes
        OUT_DIR/run-<rank>.npz and .json (the job store's type and transport).
  cost  the hylo mode's net and training with every default, the cost model on (as
        'auto' has it over Horovod): OUT_DIR/cost-<rank>.npz and .json (kv.stats()).
  none  the same net twice from the same initial values: once with hylo and
        policy {'.*': 'none'} (step(W*b): the store sums), once with
        hvd.DistributedTrainer (which averages); writes OUT_DIR/none-<rank>.npz with
        both nets' parameters ('hylo/NAME', 'horovod/NAME').
Every worker starts from its own random initial values (seeded by rank), so equal
results also prove the broadcast of rank 0's values, and feeds its own data.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mxhylo

BATCH = 4
STEPS = 5


def build_net(seed):
    """Conv 3->16 (432 elements: 'none'), conv 16->64 3x3 (9216: conv_topk with a fixed
    conv_rate; the rule alone would send it 2-bit), dense
    64->160 (10240: fc_2bit), dense 160->10 (1600: 'none'); kvstore.policy's default
    size threshold is 8192 elements."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, in_channels=3, activation="relu"),
            gluon.nn.Conv2D(64, 3, in_channels=16, activation="relu"),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Flatten(),
            gluon.nn.Dense(160, in_units=64, activation="relu"),
            gluon.nn.Dense(10, in_units=160))
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    return net


def batches(rank):
    rng = np.random.RandomState(100 + rank)
    for _ in range(STEPS):
        yield (mx.nd.array(rng.randn(BATCH, 3, 10, 10).astype(np.float32)),
               mx.nd.array(rng.randint(0, 10, BATCH).astype(np.float32)))


def broadcast_now(trainer):
    """Broadcast rank 0's initial values before the first backward. Gluon does it in
    the first step(), after the first backward: rank 1's first gradient would be of
    its own initial values (as with any kvstore; hvd.broadcast_parameters is the
    DistributedTrainer's way)."""
    trainer._init_kvstore()
    trainer._init_params()


def train(net, trainer, rank, batch_scale):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    scale = getattr(trainer, "scale_loss", lambda loss: loss)     # LARSTrainer's
    for x, y in batches(rank):
        with autograd.record():
            loss = scale(loss_fn(net(x), y))
        loss.backward()
        trainer.step(BATCH * batch_scale)
    mx.nd.waitall()


def params_of(net, prefix=""):
    """{prefix + position: values}: positions, as the two nets' names differ."""
    return {"%s%d" % (prefix, i): p.data().asnumpy()
            for i, p in enumerate(net.collect_params().values())}


def main(mode, out_dir):
    import horovod.mxnet as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    opt = {"learning_rate": 0.1, "momentum": 0.9}
    if mode == "hylo":
        net = build_net(seed=rank)
        # a forward outside autograd.record(), as before an evaluation: oneDNN leaves
        # the conv weights in its own layout, which Horovod's ops cannot read (the
        # transport broadcasts copies)
        net(mx.nd.ones((1, 3, 10, 10))).wait_to_read()
        kv = mxhylo.create(warmup_steps=2, conv_rate=0.1)   # conv: top-k
        assert type(kv.transport).__name__ == "HorovodTransport", kv.transport
        assert (kv.rank, kv.num_workers) == (rank, size)
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv)
        broadcast_now(trainer)
        train(net, trainer, rank, size)         # the store sums: divide by W * b
        np.savez(os.path.join(out_dir, "hylo-%d.npz" % rank), **params_of(net))
        stats = kv.stats()
        stats["shared"] = kv.transport.share_from_rank0(np.arange(3) + 10 * rank).tolist()
        with open(os.path.join(out_dir, "hylo-%d.json" % rank), "w") as f:
            json.dump(stats, f)
    elif mode == "cost":
        net = build_net(seed=rank)
        net(mx.nd.ones((1, 3, 10, 10))).wait_to_read()
        kv = mxhylo.create(warmup_steps=2)      # every default: the cost model decides
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv)
        broadcast_now(trainer)
        train(net, trainer, rank, size)
        np.savez(os.path.join(out_dir, "cost-%d.npz" % rank), **params_of(net))
        with open(os.path.join(out_dir, "cost-%d.json" % rank), "w") as f:
            json.dump(kv.stats(), f)
    elif mode == "lars":
        from mxhylo.lars import LARSTrainer
        net = build_net(seed=rank)
        kv = mxhylo.create(warmup_steps=2, conv_rate=0.1)   # conv: top-k
        trainer = LARSTrainer(net.collect_params(), learning_rate=0.1, kvstore=kv,
                              schedule="constant")
        broadcast_now(trainer)
        train(net, trainer, rank, size)
        np.savez(os.path.join(out_dir, "lars-%d.npz" % rank), **params_of(net))
        stats = kv.stats()
        stats["loss_scale"] = trainer.loss_scale
        with open(os.path.join(out_dir, "lars-%d.json" % rank), "w") as f:
            json.dump(stats, f)
    elif mode == "none":
        net = build_net(seed=rank)
        ref = build_net(seed=rank)
        for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
            q.set_data(p.data())
        kv = mxhylo.create(policy={".*": "none"})
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv)
        broadcast_now(trainer)
        initial = params_of(net, "init/")      # rank 0's, broadcast
        train(net, trainer, rank, size)
        params = ref.collect_params()
        hvd.broadcast_parameters(params, root_rank=0)
        hvd_trainer = hvd.DistributedTrainer(params, "sgd", opt)    # averages
        train(ref, hvd_trainer, rank, 1)
        out = params_of(net, "hylo/")
        out.update(params_of(ref, "horovod/"), **initial)
        np.savez(os.path.join(out_dir, "none-%d.npz" % rank), **out)
    elif mode == "run":
        # run as the script of python -m mxhylo.run: a Trainer without a kvstore gets
        # the job's store (hylo over Horovod) and divides by W * b itself
        net = build_net(seed=0)
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt)
        train(net, trainer, rank, 1)
        transport = type(trainer._kvstore.transport).__name__   # made at the first step
        np.savez(os.path.join(out_dir, "run-%d.npz" % rank), **params_of(net))
        with open(os.path.join(out_dir, "run-%d.json" % rank), "w") as f:
            json.dump({"transport": transport, "type": trainer._kvstore.type}, f)
    else:
        raise SystemExit("unknown mode %r" % mode)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
