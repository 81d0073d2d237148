"""Accuracy study: dense dist_sync vs MXNet's built-in 2-bit vs hylo (dense pull and
compressed pull), 4 workers, 3 seeds.

``python -m mxhylo.bench accuracy [--modes dense,2bit,hylo,hylo_pull --epochs 20 --seeds 3
--workers 4 --servers 2] --json F``

What runs: for every mode and seed, one parameter-server job (``python -m
mxhylo.launch -n W -s S``) whose workers each call :func:`mxhylo.digits.train`, the
project's one digits recipe (momentum SGD, per-worker batch, each worker on its
contiguous shard of the training set, test accuracy after every epoch). Only the
kvstore differs between modes:

- ``dense``: MXNet's ``dist_sync``, float32 gradients pushed whole (Gluon's pushpull).
- ``2bit``: ``dist_sync`` with ``set_gradient_compression({'type': '2bit',
  'threshold': T})``. In MXNet 1.9.1 ``pushpull`` with compression aborts, and Gluon's
  Trainer only calls pushpull, so :class:`PushThenPull` adapts the store: push the
  gradients (MXNet quantizes them to {-T, 0, +T} with its own residual), pull the
  servers' sum of the dequantized pushes back into the gradients, and the Trainer
  updates locally with the same SGD as the other modes. (Setting the optimizer on the
  servers instead, push gradients / pull weights, also works in 1.9.1; it was not used
  so that every mode runs the identical worker-side update.)
- ``hylo``: ``mxhylo.create('dist_sync_hylo', compress_pull=False)``, Hylo as
  published: compressed push, the servers return the dense float32 aggregate. The
  option is spelled out so that this mode stays what it is if the library's default
  changes.
- ``hylo_pull``: ``mxhylo.create('dist_sync_hylo', compress_pull=True)``, compressed
  pull: the servers encode each compressed layer's aggregate with the codec of the
  layer's own family (conv_topk layers' as top-k filters at the layer's rate, fc_2bit
  layers' as 2-bit) and keep what they do not send in residuals of their own (error
  feedback on the server, as the workers do on the push); every worker pulls the same
  encoded bytes. Layers pushed uncompressed are pulled dense.
- ``hylo_pull2bit``: ``compress_pull='2bit'``, every compressed layer's aggregate
  returned as 2-bit (see kvstore.policy.compress_pull_mode).

Every hylo mode uses the store's default policy. The default ``--modes`` is
``dense,2bit,hylo,hylo_pull``; ``hylo_pull2bit`` is opt-in.

The 2-bit threshold applies to the summed gradient of a worker's batch (Gluon's loss
is per sample; the 1/batch scaling happens in the optimizer). MXNet sends at most
+-threshold per element per step and keeps the rest as residual, so a threshold far
below the gradients' size throttles learning. Swept once (seed 0, 20 epochs, final
test accuracy): 0.02: 67.0%, 0.1: 54.3%, 0.5: 95.6%, 1: 97.1%, 2: 98.7%, 4: 97.8%;
the default is 2.

Data: scikit-learn's digits as numpy arrays (:func:`mxhylo.data.load_digits`: 1347
training / 450 test images, the same split ``python -m mxhylo.im2rec --digits`` packs),
not the .rec: the study is about the gradient exchange, and JPEG decoding would only
add noise to a 2-core machine's timings.

Model: :func:`mxhylo.models.digits_net`, not a gluoncv net. Measured here (one process,
batch 16, 8x8 input): digits_net 9 ms/step, gluoncv's cifar_resnet20_v1 19 ms at
8x8 and 34 ms at 16x16; and a CIFAR ResNet has no large fully connected layer, so
hylo's fc_2bit path would not run, and with the default 8192-element threshold its
many small layers (9% of its gradient) travel uncompressed and make up 57% of what
hylo would push: about 6.7x less than dense (estimated from the policy), under the
8x this study checks. digits_net exercises all three policies (none, conv_topk,
fc_2bit), and is the net every other digits result of the project uses.

Reported accuracy is rank 0's (every rank's is in the JSON). Each worker also
reports a checksum of its trainable parameters, which synchronous workers must share;
``diverged_runs`` lists the seeds where they did not. Seen here: 3 of 24 checksummed
native runs (dense seed 0 and 2bit seed 2 of one study, on a loaded machine, and dense
seed 0 of the next) ended with workers holding different parameters and lower accuracy
(96.9%, 95.8%, 96.0%); two
earlier dense runs, before the checksum, ended as low (96.0%, 66.6%), probably the
same way. No hylo run diverged (its servers hand every worker the same decoded
aggregate; with compressed pull, the same encoded one; the checks require identical
workers of ``hylo_pull``). The cause, somewhere in MXNet's native dist_sync path, was
not found; rerun a study that lists any.

Bytes pushed and pulled per step, per worker: hylo modes count what their transport
really moved (``kv.stats()``'s bytes_pushed and bytes_pulled over its steps; ``hylo``'s
dense pull comes out 0.2% above dense's, as its compressed layers' keys are row_sparse
and their pulls carry int64 row ids); dense is 4 bytes per gradient element each way;
2-bit pulls dense (4 bytes per element: MXNet 1.9.1 compresses only the push), and its
push is computed from MXNet's packing: every float32 dense key is compressed whatever
its size (no threshold in KVStoreDist::Push_), to ceil(n / 16) float32 words (16 two-bit
codes per word), i.e. 4 * ceil(n / 16) bytes. Keys of 1e6 elements or more
(MXNET_KVSTORE_BIGARRAY_BOUND) are split over the servers with the same total.
Payload only: ps-lite's message headers and key lists are not counted in any mode.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MODES = ("dense", "2bit", "hylo", "hylo_pull", "hylo_pull2bit")
DEFAULT_MODES = ("dense", "2bit", "hylo", "hylo_pull")     # hylo_pull2bit is opt-in
COLORS = {"dense": "tab:blue", "2bit": "tab:orange", "hylo": "tab:green",
          "hylo_pull": "tab:red", "hylo_pull2bit": "tab:brown"}
# the hylo modes: compress_pull option of mxhylo.create (kvstore.policy.compress_pull_mode)
HYLO_PULL = {"hylo": False, "hylo_pull": True, "hylo_pull2bit": "2bit"}


# ----------------------------------------------------------------------------- bench side

def add_arguments(parser):
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated subset of %s (default %s)"
                             % (",".join(MODES), ",".join(DEFAULT_MODES)))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode (3)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs per run (20)")
    parser.add_argument("--workers", type=int, default=4, help="workers per job (4)")
    parser.add_argument("--servers", type=int, default=2, help="servers per job (2)")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (32)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (0.02)")
    parser.add_argument("--threshold", type=float, default=2.0,
                        help="2bit mode: MXNet's quantization threshold (2.0, the best of "
                             "0.02..4 on one seed; see the module docstring)")
    parser.add_argument("--plots-dir", default="docs",
                        help="folder for the PNG plots, relative to the current "
                             "directory ('' : no plots) (default docs)")
    parser.add_argument("--job-timeout", type=float, default=300,
                        help="seconds before one training job is stopped (300)")


def run(args):
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise SystemExit("accuracy: --modes must be a subset of %s, got %r"
                         % (",".join(MODES), args.modes))
    if args.seeds < 1 or args.epochs < 1 or args.workers < 1 or args.servers < 1:
        raise SystemExit("accuracy: --seeds, --epochs, --workers and --servers must be >= 1")
    start = time.time()
    runs = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="mxhylo-accuracy-") as tmp:
        for seed in range(args.seeds):
            for mode in modes:   # modes interleaved: machine load drifts over a study
                runs[mode].append(launch_job(args, mode, seed, tmp))
                r = runs[mode][-1]
                print("accuracy: %-13s seed %d: test accuracy %.4f, %.0f bytes pushed "
                      "/ %.0f pulled per step, %.0f s"
                      % (mode, seed, r["accuracy"], r["bytes_per_step"],
                         r["bytes_pulled_per_step"], r["job_seconds"]),
                      file=sys.stderr, flush=True)
    report = summarize(args, runs)
    report["study_seconds"] = time.time() - start
    if args.plots_dir:
        report["plots"] = make_plots(report, args.plots_dir)
    return report


def launch_job(args, mode, seed, tmp):
    """One parameter-server job; returns rank 0's result (plus every rank's accuracy)."""
    out = os.path.join(tmp, "%s-%d-{rank}.json" % (mode, seed))
    worker = [sys.executable, "-m", "mxhylo.bench.accuracy", "--mode", mode,
              "--seed", str(seed), "--epochs", str(args.epochs),
              "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--threshold", str(args.threshold), "--out", out]
    # One OpenMP thread per process: W workers and S servers share the machine's cores.
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", str(args.workers),
           "-s", str(args.servers), "--timeout", str(args.job_timeout),
           "--env", "OMP_NUM_THREADS:1"] + worker
    t0 = time.time()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise RuntimeError("accuracy: %s seed %d failed (exit %d):\n%s"
                           % (mode, seed, res.returncode, res.stdout[-4000:]))
    ranks = []
    for r in range(args.workers):
        with open(out.format(rank=r)) as f:
            ranks.append(json.load(f))
    result = ranks[0]
    result["rank_accuracies"] = [r["accuracy"] for r in ranks]
    result["rank_checksums"] = [r["param_checksum"] for r in ranks]
    result["job_seconds"] = time.time() - t0
    return result


def _spread(values):
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "median": float(np.median(v)),
            "min": float(v.min()), "max": float(v.max()), "values": [float(x) for x in v]}


def summarize(args, runs):
    modes = {}
    for mode, rs in runs.items():
        curves = np.asarray([r["history"] for r in rs], dtype=float)
        modes[mode] = {
            "final_accuracy": _spread([r["accuracy"] for r in rs]),
            "curve_mean": curves.mean(axis=0).tolist(),
            "curve_min": curves.min(axis=0).tolist(),
            "curve_max": curves.max(axis=0).tolist(),
            "bytes_pushed_per_step": float(np.mean([r["bytes_per_step"] for r in rs])),
            "bytes_pulled_per_step": float(np.mean([r["bytes_pulled_per_step"]
                                                    for r in rs])),
            "job_seconds": _spread([r["job_seconds"] for r in rs]),
            "layers": rs[0]["layers"],
            # per run: rank 0's curve (the reported one) and every rank's final accuracy
            # (trainable parameters are identical; BatchNorm statistics are each worker's)
            "runs": [{"seed": r["seed"], "history": r["history"],
                      "rank_accuracies": r["rank_accuracies"],
                      "rank_checksums": r["rank_checksums"],
                      "workers_identical": len(set(r["rank_checksums"])) == 1}
                     for r in rs],
        }
        if mode in HYLO_PULL:
            # dense bytes over bytes pushed, as kv.stats() reports it
            modes[mode]["hylo_ratio"] = float(np.mean([r["stats"]["ratio"] for r in rs]))
    report = {"config": {k: getattr(args, k) for k in (
        "modes", "seeds", "epochs", "workers", "servers", "batch_size", "lr", "threshold")},
        "model": "mxhylo.models.digits_net",
        "data": "scikit-learn digits, numpy (1347 train / 450 test)",
        "modes": modes}
    # seeds whose workers ended with different parameters (a synchronous job must not)
    report["diverged_runs"] = {m: [r["seed"] for r in v["runs"] if not r["workers_identical"]]
                               for m, v in modes.items()}
    if "dense" in modes:
        dense = modes["dense"]
        for mode in modes:
            modes[mode]["accuracy_gap_points"] = 100.0 * (
                modes[mode]["final_accuracy"]["mean"] - dense["final_accuracy"]["mean"])
            modes[mode]["bytes_vs_dense"] = (modes[mode]["bytes_pushed_per_step"]
                                             / dense["bytes_pushed_per_step"])
            modes[mode]["pulled_bytes_vs_dense"] = (modes[mode]["bytes_pulled_per_step"]
                                                    / dense["bytes_pulled_per_step"])
        checks = {}
        if "hylo" in modes:
            h = modes["hylo"]
            # only a loss counts against hylo: doing better than dense passes
            checks["hylo_within_0.5_points_of_dense"] = h["accuracy_gap_points"] >= -0.5
            checks["hylo_bytes_at_most_1/8_of_dense"] = h["bytes_vs_dense"] <= 1.0 / 8.0
        if "hylo_pull" in modes:
            h = modes["hylo_pull"]
            checks.update({
                "hylo_pull_within_0.5_points_of_dense": h["accuracy_gap_points"] >= -0.5,
                "hylo_pull_pushed_bytes_at_most_1/8_of_dense": h["bytes_vs_dense"] <= 1 / 8,
                "hylo_pull_pulled_bytes_at_most_1/8_of_dense":
                    h["pulled_bytes_vs_dense"] <= 1 / 8,
                # the servers send every worker the same encoded aggregate
                "hylo_pull_workers_identical": not report["diverged_runs"]["hylo_pull"],
            })
        if checks:
            report["checks"] = checks
    return report


def make_plots(report, folder):
    """docs/accuracy_curves.png (per-mode test accuracy per epoch, mean and min-max band,
    and bytes per step) and docs/hylo_bytes_per_layer.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")   # no display on a build machine
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = {}
    # the study's order (a report read back from JSON has its keys sorted)
    modes = {m: report["modes"][m] for m in MODES if m in report["modes"]}
    cfg = report["config"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.5, 4.6),
                                 gridspec_kw={"width_ratios": [2, 1.3]})
    for mode, m in modes.items():
        x = np.arange(1, len(m["curve_mean"]) + 1)
        ax.plot(x, 100 * np.asarray(m["curve_mean"]), color=COLORS[mode],
                label="%s: %.2f%% (sd %.2f)" % (mode, 100 * m["final_accuracy"]["mean"],
                                                100 * m["final_accuracy"]["std"]))
        ax.fill_between(x, 100 * np.asarray(m["curve_min"]), 100 * np.asarray(m["curve_max"]),
                        color=COLORS[mode], alpha=0.15, linewidth=0)
    low = min(min(m["curve_mean"][len(m["curve_mean"]) // 4:]) for m in modes.values())
    ax.set_ylim(max(0.0, 100 * low - 2), 100.5)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits_net on the digits, %d workers, %d seeds (mean, min-max band)"
                 % (cfg["workers"], cfg["seeds"]), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    # push (solid) and pull (hatched) side by side per mode
    names = list(modes)
    x = np.arange(len(names))
    width = 0.4
    colors = [COLORS[n] for n in names]
    pushed = [modes[n]["bytes_pushed_per_step"] / 1e3 for n in names]
    # a report written before pulls were counted has none: drawn as 0
    pulled = [modes[n].get("bytes_pulled_per_step", 0.0) / 1e3 for n in names]
    bars = list(bx.bar(x - width / 2, pushed, width, color=colors, edgecolor=colors))
    bars += list(bx.bar(x + width / 2, pulled, width, color="white", edgecolor=colors,
                        hatch="///"))
    for rect, v in zip(bars, pushed + pulled):
        bx.annotate("%.0f" % v if v >= 10 else "%.1f" % v,
                    (rect.get_x() + rect.get_width() / 2, v),
                    ha="center", va="bottom", fontsize=7)
    bx.bar([0], [0], color="grey", label="push")            # legend entries only
    bx.bar([0], [0], color="white", edgecolor="grey", hatch="///", label="pull")
    bx.set_xticks(x)
    bx.set_xticklabels(names, fontsize=8, rotation=20)
    bx.set_ylabel("bytes per step per worker (kB)")
    bx.set_title("gradient payload per step: push and pull", fontsize=10)
    bx.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    paths["accuracy_curves"] = os.path.join(folder, "accuracy_curves.png")
    fig.savefig(paths["accuracy_curves"], dpi=110)
    plt.close(fig)

    if "hylo" in modes:
        layers = modes["hylo"]["layers"]
        names = sorted(layers, key=lambda n: -layers[n]["dense_bytes_per_step"])
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
        y = np.arange(len(names))
        dense = [layers[n]["dense_bytes_per_step"] for n in names]
        sent = [layers[n]["bytes_per_step"] for n in names]
        ax.barh(y + 0.2, dense, height=0.4, color="lightgrey", label="dense float32")
        policy_colors = {"none": "tab:gray", "conv_topk": "tab:purple", "fc_2bit": "tab:red"}
        ax.barh(y - 0.2, sent, height=0.4,
                color=[policy_colors[layers[n]["policy"]] for n in names])
        for policy, color in policy_colors.items():   # legend entries only
            ax.barh([0], [0], color=color, label="hylo: " + policy)
        for yi, n in zip(y, names):
            ax.annotate(" %s, %.1fx" % (layers[n]["policy"], layers[n]["ratio"]),
                        (layers[n]["bytes_per_step"], yi - 0.2), va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("bytes pushed per step per worker (log)")
        ax.set_title("hylo per layer of digits_net: policy and compression ratio; "
                     "grey = dense", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        paths["hylo_bytes_per_layer"] = os.path.join(folder, "hylo_bytes_per_layer.png")
        fig.savefig(paths["hylo_bytes_per_layer"], dpi=110)
        plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- byte counts

def dense_bytes(n):
    """Bytes a float32 gradient of n elements pushes uncompressed."""
    return 4 * int(n)


def twobit_bytes(n):
    """Bytes MXNet 1.9's 2-bit compression pushes for a float32 key of n elements:
    16 codes per float32 word, ceil(n / 16) words (GradientCompression::GetCompressedSize)."""
    return 4 * ((int(n) + 15) // 16)


# ----------------------------------------------------------------------------- worker side

def _kvstore_base():
    from mxnet.kvstore import KVStoreBase

    return KVStoreBase


class PushThenPull(_kvstore_base()):
    """A native dist kvstore with MXNet's 2-bit compression, usable by gluon.Trainer.

    Gluon calls ``pushpull``, which aborts in MXNet 1.9.1 once gradient compression is
    on; this adapter turns it into ``push`` (compressed by MXNet, with its residual)
    then ``pull`` of the servers' sum into the same arrays. The pull is ordered after
    the push by MXNet's engine (both touch the key's communication buffer), and a
    dist_sync server acknowledges a push only once every worker's push is merged, so
    the pull returns this step's sum. The Trainer then updates on the worker.
    """

    def __init__(self, threshold, kvstore_type="dist_sync"):
        import mxnet as mx

        self._kv = mx.kv.create(kvstore_type)
        # before any key is initialised, as MXNet requires
        self._kv.set_gradient_compression({"type": "2bit", "threshold": float(threshold)})

    def broadcast(self, key, value, out, priority=0):
        self._kv.broadcast(key, value, out, priority=priority)   # init (uncompressed) + pull

    def pushpull(self, key, value, out=None, priority=0):
        self._kv.push(key, value, priority=priority)
        self._kv.pull(key, out=value if out is None else out, priority=priority)

    @staticmethod
    def is_capable(capability):
        return False   # the update runs on the workers, as in the other modes

    def set_optimizer(self, optimizer):
        raise NotImplementedError("PushThenPull updates on the workers")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError

    def load_optimizer_states(self, fname):
        raise NotImplementedError

    @property
    def type(self):
        return self._kv.type

    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers


def _worker_parser():
    p = argparse.ArgumentParser(prog="python -m mxhylo.bench.accuracy",
                                description="one worker of the accuracy study (started by "
                                            "python -m mxhylo.bench accuracy)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--threshold", type=float, default=2.0)
    p.add_argument("--out", required=True, help="result JSON; {rank} is the worker rank")
    return p


def worker_main(argv=None):
    args = _worker_parser().parse_args(argv)
    import mxnet as mx

    import mxhylo
    from mxhylo import digits

    if args.mode == "dense":
        kv = mx.kv.create("dist_sync")
    elif args.mode == "2bit":
        kv = PushThenPull(args.threshold)
    else:
        # compress_pull spelled out, so that "hylo" stays dense pull whatever the default
        kv = mxhylo.create("dist_sync_hylo", compress_pull=HYLO_PULL[args.mode])
    result = digits.train(kvstore=kv, contexts=[mx.cpu(0)], epochs=args.epochs,
                          batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    sizes = {name: int(a.size) for name, a in result["params"].items()}
    shapes = {name: list(a.shape) for name, a in result["params"].items()}
    stats = result["stats"]
    if args.mode in HYLO_PULL:
        # bytes_per_step and ratio: the push (dense bytes over bytes pushed)
        layers = {name: {"policy": e["policy"], "shape": e["shape"], "k": e["k"],
                         "rate": e["rate"], "bytes_per_step": e["bytes_pushed"] / e["steps"],
                         "bytes_pulled_per_step": e["bytes_pulled"] / e["steps"],
                         "dense_bytes_per_step": e["dense_bytes"] / e["steps"],
                         "ratio": e["ratio"]}
                  for name, e in stats["layers"].items()}
        per_step = stats["bytes_pushed"] / stats["steps"]
        pulled_per_step = stats["bytes_pulled"] / stats["steps"]
    else:
        # both native modes pull the dense float32 sum; 2bit compresses only the push
        count = dense_bytes if args.mode == "dense" else twobit_bytes
        layers = {name: {"policy": args.mode, "shape": shapes[name],
                         "bytes_per_step": count(n), "bytes_pulled_per_step": dense_bytes(n),
                         "dense_bytes_per_step": dense_bytes(n),
                         "ratio": dense_bytes(n) / count(n)} for name, n in sizes.items()}
        per_step = float(sum(count(n) for n in sizes.values()))
        pulled_per_step = float(sum(dense_bytes(n) for n in sizes.values()))
    # Synchronous workers must end with identical trainable parameters: a checksum per
    # rank lets the study see a worker that drifted.
    checksum = float(sum(np.abs(a.astype(np.float64)).sum() for a in result["params"].values()))
    report = {"mode": args.mode, "seed": args.seed, "rank": result["rank"],
              "param_checksum": checksum,
              "workers": result["workers"], "accuracy": result["accuracy"],
              "history": result["history"], "seconds": result["seconds"],
              "bytes_per_step": per_step, "bytes_pulled_per_step": pulled_per_step,
              "layers": layers,
              "stats": {k: v for k, v in (stats or {}).items() if k != "layers"}}
    with open(args.out.format(rank=result["rank"]), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
