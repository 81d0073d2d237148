"""Train a conv+dense net on scikit-learn's digits with the hylo kvstore (the README demo).

In one process it trains on two contexts (cpu(0), cpu(1)) whose gradients are reduced
and then go through Hylo's residual -> compress -> decode path; launched as a worker of
a parameter-server job (python -m mxhylo.launch -n 2 -s 1 python examples/train_digits.py)
each worker trains on its shard and gradients cross MXNet's parameter server.
It prints test accuracy per epoch and, at the end, the bytes hylo sent against dense.

    python examples/train_digits.py [--kvstore dist_sync_hylo] [--epochs 10] [--compare]

Seeded (--seed, default 0: Python's random, numpy and MXNet): a run prints the same
accuracy every time on one machine. MXNet's float kernels differ between CPUs
(oneDNN and OpenBLAS pick AVX-512 or AVX2 code), so another CPU may print another
number.
"""
import argparse
import json
import logging
import os
import random

import mxnet as mx
import numpy as np

import mxhylo
from mxhylo.digits import train


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvstore", default="dist_sync_hylo",
                        help="kvstore type: dist_sync_hylo, hylo, device, dist_sync, ...")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="in one process: also train uncompressed and print both")
    parser.add_argument("--policy", type=json.loads, default=None,
                        help='hylo layer policy override, JSON, e.g. \'{".*": "none"}\'')
    parser.add_argument("--compress-pull", choices=("gather", "off"), default=None,
                        help="hylo: how the servers return aggregates: gather (the "
                             "workers' payloads, exact) or off (the dense aggregate) "
                             "(default: the library's, gather over the servers)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="hylo: exchanges each compressed layer travels dense first "
                             "(default: the library's, 30)")
    parser.add_argument("--cost-model", choices=("auto", "on", "off"), default="auto",
                        help="hylo: whether measured costs may leave layers dense on a "
                             "fast network (default: the library's, 'auto')")
    parser.add_argument("--json", help="write accuracy and traffic to this file")
    parser.add_argument("--save-params", metavar="PATTERN",
                        help="save the final parameters to PATTERN.format(rank=kv.rank) (.npz)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("train_digits").info

    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)
    distributed = os.environ.get("DMLC_ROLE") == "worker"
    contexts = [mx.cpu(0)] if distributed else [mx.cpu(0), mx.cpu(1)]
    options = {} if args.compress_pull is None else {
        "compress_pull": "gather" if args.compress_pull == "gather" else False}
    if args.warmup_steps is not None:
        options["warmup_steps"] = args.warmup_steps
    if args.cost_model != "auto":
        options["cost_model"] = args.cost_model == "on"
    kv = mxhylo.create(args.kvstore, policy=args.policy, **options) \
        if "hylo" in args.kvstore else args.kvstore
    result = train(kvstore=kv, contexts=contexts, epochs=args.epochs,
                   batch_size=args.batch_size, lr=args.lr, seed=args.seed, log=log)
    report = {"kvstore": args.kvstore, "accuracy": result["accuracy"],
              "workers": result["workers"], "rank": result["rank"]}
    stats = result["stats"]
    if stats:
        report.update(bytes_pushed=stats["bytes_pushed"], bytes_pulled=stats["bytes_pulled"],
                      dense_bytes=stats["dense_bytes"],
                      ratio=stats["ratio"], compressed_layers_ratio=stats["compressed_layers_ratio"],
                      messages_per_step=stats["messages_per_step"],
                      bytes_per_server=stats["bytes_per_server"],
                      cost_model=stats.get("cost_model"),
                      plans={name: layer["policy"] for name, layer in stats["layers"].items()})
        log("worker %d: test accuracy %.4f; pushed %.2f MB and pulled %.2f MB where dense "
            "float32 moves %.2f MB each way (push %s less; compressed layers %s)" % (
                result["rank"], result["accuracy"], stats["bytes_pushed"] / 1e6,
                stats["bytes_pulled"] / 1e6, stats["dense_bytes"] / 1e6,
                _times(stats["ratio"]), _times(stats["compressed_layers_ratio"])))
        for name, layer in sorted(stats["layers"].items()):
            log("  %-40s %-9s %8d -> %7d bytes/step, %.1f messages/step" % (
                name, layer["policy"], layer["dense_bytes"] // layer["steps"],
                layer["last_bytes"], layer["messages"] / layer["steps"]))
    if args.compare and not distributed:
        dense = train(kvstore="device", contexts=contexts, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed)
        report["uncompressed_accuracy"] = dense["accuracy"]
        log("uncompressed ('device' kvstore): test accuracy %.4f" % dense["accuracy"])
    if args.save_params:
        np.savez(args.save_params.format(rank=result["rank"]), **result["params"])
    if args.json:
        with open(args.json.format(rank=result["rank"]), "w") as f:
            json.dump(report, f, indent=2)


def _times(ratio):
    """'12.3x', or '-' where nothing was pushed or no layer compressed (None)."""
    return "-" if ratio is None else "%.1fx" % ratio


if __name__ == "__main__":
    main()
