"""A dist_sync worker for the launcher tests: trains mxhylo's digits net on this worker's shard.

Run under ``python -m mxhylo.launch``; as a server or scheduler the process never gets
past ``import mxnet`` (ps-lite's loop runs inside it). Options:
  --kvstore NAME   the store to create (default dist_sync)
  --steps N        training steps (0: train until killed)
  --out-dir DIR    write params-rank<R>.npz at the end and progress-rank<R> after step 2
  --fail-rank R    the worker of rank R raises at step 3 (a failing script)
  --mismatch       rank 1 builds a wider net than the others (workers with different models)
"""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from mxhylo.data import load_digits, shard
from mxhylo.models import digits_net


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvstore", default="dist_sync")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--mismatch", action="store_true")
    args = ap.parse_args()

    kv = mx.kv.create(args.kvstore)
    print("rank %d of %d workers, kvstore %s" % (kv.rank, kv.num_workers, kv.type), flush=True)
    x, y, _, _ = load_digits()
    x, y = shard(x, y, kv.num_workers, kv.rank)

    mx.random.seed(0)
    net = digits_net(width=24 if args.mismatch and kv.rank == 1 else 16, hidden=64)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    b = args.batch_size
    step = 0
    while args.steps == 0 or step < args.steps:
        lo = (step * b) % (len(y) - b)
        data, label = mx.nd.array(x[lo:lo + b]), mx.nd.array(y[lo:lo + b])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(b)
        step += 1
        if step == 3 and kv.rank == args.fail_rank:
            raise RuntimeError("injected failure on rank %d" % kv.rank)
        if step == 2:
            open(os.path.join(args.out_dir, "progress-rank%d" % kv.rank), "w").close()
        if args.steps == 0:
            time.sleep(0.05)    # an endless job: do not hog the shared cores
    mx.nd.waitall()
    # Only what the kvstore synchronises: BatchNorm running statistics (grad_req null)
    # stay local to each worker and legitimately differ.
    params = {k: v.data().asnumpy() for k, v in net.collect_params().items()
              if v.grad_req != "null"}
    np.savez(os.path.join(args.out_dir, "params-rank%d.npz" % kv.rank), **params)
    print("done: %d steps, loss %.4f" % (step, loss.mean().asscalar()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
