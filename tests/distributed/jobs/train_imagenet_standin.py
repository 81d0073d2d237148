"""A stand-in for gluoncv's scripts/classification/imagenet/train_imagenet.py (--use-rec).

Like that script it knows nothing of distributed training: no kvstore option, a
Trainer created as gluon.Trainer(net.collect_params(), optimizer, optimizer_params),
an mx.io.ImageRecordIter without num_parts/part_index, trainer.step(batch_size), and
(--lr-mode cosine) an lr schedule sized from --num-training-samples // batch_size, as
that script sizes it. ``python -m mxhylo.run`` is what makes it train across workers.
It writes the final parameters to --save-dir/params-<pid>.npz (it cannot know a worker
rank), and prints each epoch's training loss summed over its samples, the final lr
and, with --rec-val, how many validation samples it evaluated and their accuracy.
"""
import argparse
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def parse_args():
    parser = argparse.ArgumentParser(description="Train a model on a .rec file.")
    parser.add_argument("--rec-train", type=str, required=True)
    parser.add_argument("--rec-train-idx", type=str, default="")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--optimizer", type=str, default="nag")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=0.0001)
    parser.add_argument("--save-dir", type=str, required=True)
    parser.add_argument("--rec-val", type=str, default="")
    parser.add_argument("--shuffle", action="store_true",
                        help="shuffle the training reader (as gluoncv's does)")
    parser.add_argument("--lr-mode", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--num-training-samples", type=int, default=0)
    parser.add_argument("--batchnorm", action="store_true",
                        help="a BatchNorm layer after the hidden layer")
    return parser.parse_args()


def get_data_rec(rec_train, rec_train_idx, batch_size, shuffle):
    return mx.io.ImageRecordIter(
        path_imgrec=rec_train, path_imgidx=rec_train_idx, data_shape=(1, 8, 8),
        batch_size=batch_size,
        shuffle=shuffle, preprocess_threads=1, scale=1.0 / 255)


def get_val_rec(rec_val, batch_size):
    return mx.io.ImageRecordIter(
        path_imgrec=rec_val, data_shape=(1, 8, 8), batch_size=batch_size,
        shuffle=False, preprocess_threads=1, scale=1.0 / 255)


def cosine_schedule(opt):
    """gluoncv's cosine LRScheduler, sized from the sample count as its script does."""
    from gluoncv.utils import LRScheduler
    num_batches = opt.num_training_samples // opt.batch_size
    return LRScheduler("cosine", base_lr=opt.lr, target_lr=0, nepochs=opt.num_epochs,
                       iters_per_epoch=num_batches)


def main():
    opt = parse_args()
    ctx = [mx.cpu()]
    mx.random.seed(0)
    np.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32))
    if opt.batchnorm:
        net.add(gluon.nn.BatchNorm())
    net.add(gluon.nn.Activation("relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    optimizer_params = {"learning_rate": opt.lr, "wd": opt.wd}
    if opt.lr_mode == "cosine":
        optimizer_params["lr_scheduler"] = cosine_schedule(opt)
    if opt.optimizer in ("nag", "sgd") and opt.momentum:
        optimizer_params["momentum"] = opt.momentum
    trainer = gluon.Trainer(net.collect_params(), opt.optimizer, optimizer_params)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    train_data = get_data_rec(opt.rec_train, opt.rec_train_idx, opt.batch_size, opt.shuffle)
    val_data = get_val_rec(opt.rec_val, opt.batch_size) if opt.rec_val else None
    for epoch in range(opt.num_epochs):
        train_data.reset()
        total = 0.0
        for i, batch in enumerate(train_data):
            # As gluoncv: the iterator's arrays live in pinned memory; load them per context.
            data = gluon.utils.split_and_load(batch.data[0], ctx_list=ctx, batch_axis=0)
            label = gluon.utils.split_and_load(batch.label[0], ctx_list=ctx, batch_axis=0)
            with autograd.record():
                losses = [loss_fn(net(X), y) for X, y in zip(data, label)]
            for loss in losses:
                loss.backward()
            trainer.step(opt.batch_size)
            total += sum(l.sum().asscalar() for l in losses)
        print("epoch %d: %d batches, last loss %.4f, loss summed %.6f"
              % (epoch, i + 1, loss.mean().asscalar(), total), flush=True)
    print("final lr %.6g after %d updates" % (trainer.learning_rate,
                                               trainer.optimizer.num_update), flush=True)
    if val_data is not None:
        metric, seen = mx.metric.Accuracy(), 0
        for batch in val_data:
            n = batch.data[0].shape[0] - batch.pad
            data = batch.data[0][:n].as_in_context(ctx[0])
            metric.update([batch.label[0][:n]], [net(data)])
            seen += n
        print("validation: %d samples, accuracy %.4f" % (seen, metric.get()[1]), flush=True)
    params = {k: v.data().asnumpy() for k, v in net.collect_params().items()}
    np.savez(os.path.join(opt.save_dir, "params-%d.npz" % os.getpid()), **params)


if __name__ == "__main__":
    main()
