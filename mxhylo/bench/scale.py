"""Past one rack: pull bytes and accuracy at W = 16 or 64 workers, by arithmetic and by
simulation (kvstore.simulate), where this machine cannot run as many processes.

``python -m mxhylo.bench scale [--part bytes,accuracy] [--workers 4,16,64]
[--models resnet50_v1b,vgg16] [--nets conv_net,digits_net --sim-workers 16 --seeds 5]
--json F``

* bytes: per model and W, the bytes one worker pushes and pulls per step for the
  layers the default policy compresses (at its size threshold), from the wire's own
  layouts (kvstore.wire: pull_rows rows of float32 plus int64 row ids, 2 servers):
  today's codecs with the 'gather' pull, and every such layer as shared_2bit with the
  'sum' pull; each as a fraction of the same layers' dense float32 bytes.
* accuracy: the accuracy study's nets on the digits, one net trained by W simulated
  workers (each its shard of the training set, its own batches, residuals and
  encodes; momentum SGD 0.9, wd 1e-4, the cosine schedule with a 1-epoch ramp; the
  store's defaults: its dense warm-up steps, momentum correction, bounded residuals).
  --codecs: 'dense' (float32 sums), 'gather' (the default codecs: fc_2bit, or
  conv_topk for conv layers given conv_rate) and 'shared' (the same layers as shared_2bit). Same seed, same data and
  initialisation in every mode: the report gives paired differences. BatchNorm's
  running statistics are one net's, updated by every worker's batch in turn.
* merge: per W, the time a parameter server of MXNet 1.9.1 spends merging the W
  workers' pushes of one 'slots' key (the first chunk of a --merge-elements 2-bit
  layer, 1 server; each push one worker's slot rows) as its sync row_sparse handler
  does: the first push copied, each
  later one added to the merged rows into a new array, which is copied back
  (src/kvstore/kvstore_dist_server.h, DataHandleRowSparse). The same MXNet operators,
  in this process, on one thread; best of --repeats. The union grows with every push,
  so a key costs about W^2 / 2 slot copies: the servers' share of both the gathered
  and the summed pull grows with W even where the bytes on the wire do not.
"""
import time

import numpy as np

from . import report

log = report.logger("scale")
CODECS = ("dense", "gather", "shared")      # of the simulated store


def add_arguments(p):
    p.add_argument("--part", default="bytes,accuracy",
                   help="of bytes, accuracy and merge (default bytes,accuracy)")
    p.add_argument("--workers", default="4,16,64", help="W of the bytes part (4,16,64)")
    p.add_argument("--models", default="resnet50_v1b,vgg16", help="gluoncv models (bytes)")
    p.add_argument("--servers", type=int, default=2, help="servers of the bytes part (2)")
    p.add_argument("--nets", default="conv_net,digits_net", help="nets of the accuracy part")
    p.add_argument("--sim-workers", type=int, default=16, help="simulated workers (16)")
    p.add_argument("--seeds", type=int, default=5, help="seeds (5)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (20)")
    p.add_argument("--batch-size", type=int, default=8, help="per simulated worker (8)")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (0.05)")
    p.add_argument("--codecs", default=",".join(CODECS),
                   help="the simulated store's codecs, of %s" % ", ".join(CODECS))
    p.add_argument("--merge-elements", type=int, default=2 ** 20,
                   help="elements of the 2-bit chunk of the merge part (1M)")
    p.add_argument("--repeats", type=int, default=5, help="merge part: timed merges (5)")


def run(args):
    out = report.new("scale", report.options(args))
    parts = args.part.split(",")
    if "bytes" in parts:
        out["bytes"] = pull_bytes([m for m in args.models.split(",") if m],
                                  [int(w) for w in args.workers.split(",")], args.servers)
    if "accuracy" in parts:
        out["accuracy"] = accuracy(args)
    if "merge" in parts:
        out["merge"] = server_merge([int(w) for w in args.workers.split(",")],
                                    args.merge_elements, args.repeats)
    return out


# -- the servers' merge -------------------------------------------------------------------

def merge_as_server(pushes):
    """row_sparse NDArrays of one key, in arrival order -> their sum, merged as MXNet
    1.9.1's sync server merges them: push 1 copied, then per push a new array of the
    union (elemwise_add) copied back into the merge buffer."""
    import mxnet as mx
    merged = pushes[0].copy()
    for push in pushes[1:]:
        merged = mx.nd.sparse.elemwise_add(push, merged).copy()
    return merged


def server_merge(workers, elements, repeats):
    """Per W: seconds to merge one 'slots' key's W pushes as MXNet's server does (see
    the module docstring), in all and per worker's slot."""
    import mxnet as mx
    from ..kvstore.wire import plan_chunks
    rows = []
    for w in workers:
        layout = plan_chunks("shared_2bit", (elements,), w, 1, pull="gather")[0]
        slot = np.ones((layout.slot_rows, layout.cols), np.float32)
        pushes = [mx.nd.sparse.row_sparse_array(
            (slot, np.arange(r * layout.slot_rows, (r + 1) * layout.slot_rows)),
            shape=layout.key_shape) for r in range(w)]
        mx.nd.waitall()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            merge_as_server(pushes).wait_to_read()
            times.append(time.perf_counter() - start)
        best = min(times)
        rows.append({"workers": w, "slot_bytes": int(slot.nbytes), "key_s": round(best, 6),
                     "per_slot_s": round(best / w, 6)})
        log("merge W=%-3d one key of %d slots of %.0f KB: %.1f ms, %.2f ms a slot"
            % (w, w, slot.nbytes / 1e3, 1e3 * best, 1e3 * best / w))
    return rows


# -- bytes --------------------------------------------------------------------------------

def layer_bytes(strategy, plan, workers, servers):
    """(pushed, pulled) bytes per worker per step of one layer under ``strategy``, as
    kvstore.transport_ps counts them (values and row ids)."""
    from ..kvstore.wire import ROW_ID_BYTES, plan_chunks
    chunks = plan_chunks(strategy, plan.shape, workers, servers, pull="gather",
                         pull_rate=plan.rate, push_k=plan.k)
    pushed = sum(c.push_rows * (4 * c.cols + ROW_ID_BYTES) for c in chunks)
    pulled = sum(c.pull_rows * (4 * c.cols + ROW_ID_BYTES) for c in chunks)
    return pushed, pulled


def pull_bytes(models, workers, servers):
    from ..kvstore.policy import LayerPolicy
    from .comm import shapes_in_subprocess
    shapes = shapes_in_subprocess(models, 224)
    policy = LayerPolicy()
    out = {}
    for model in models:
        plans = [policy.plan(p["name"], p["shape"]) for p in shapes[model]]
        plans = [p for p in plans if p.strategy != "none"]
        dense = sum(4 * p.size for p in plans)
        rows = []
        for w in workers:
            today = np.sum([layer_bytes(p.strategy, p, w, servers) for p in plans], axis=0)
            shared = np.sum([layer_bytes("shared_2bit", policy.plan_as(p.name, p.shape,
                                                                       "shared_2bit"),
                                         w, servers) for p in plans], axis=0)
            rows.append({"workers": w, "dense_bytes": dense,
                         "gather_push": int(today[0]), "gather_pull": int(today[1]),
                         "sum_push": int(shared[0]), "sum_pull": int(shared[1]),
                         "gather_pull_fraction": round(today[1] / dense, 4),
                         "sum_pull_fraction": round(shared[1] / dense, 4)})
            log("%-14s W=%-3d compressed layers %6.1f MB dense | gather pull %.3f | "
                "sum pull %.3f of dense" % (model, w, dense / 1e6, today[1] / dense,
                                            shared[1] / dense))
        out[model] = {"compressed_layers": len(plans), "rows": rows}
    return out


# -- accuracy -----------------------------------------------------------------------------

def accuracy(args):
    modes = [m for m in args.codecs.split(",") if m]
    runs = []
    for net in [n for n in args.nets.split(",") if n]:
        for seed in range(args.seeds):
            for mode in modes:
                r = simulated_run(net, mode, args.sim_workers, seed, args.epochs,
                                  args.batch_size, args.lr)
                log("%-10s %-7s W=%d seed %d: accuracy %.4f (%.0f s)"
                    % (net, mode, args.sim_workers, seed, r["accuracy"], r["seconds"]))
                runs.append(r)
    return {"runs": runs, "paired": paired(runs, modes)}


def paired(runs, modes):
    """Per net, each mode's mean accuracy and its mean paired difference (points) to
    the others', seed by seed."""
    out = {}
    for net in sorted({r["net"] for r in runs}):
        acc = {m: {r["seed"]: r["accuracy"] for r in runs if r["net"] == net
                   and r["mode"] == m} for m in modes}
        cell = {m: {"mean": float(np.mean(list(a.values()))),
                    "min": float(np.min(list(a.values())))} for m, a in acc.items() if a}
        for a in modes:
            for b in modes:
                seeds = sorted(set(acc[a]) & set(acc[b]))
                if a < b and seeds:
                    d = [100 * (acc[a][s] - acc[b][s]) for s in seeds]
                    cell["%s-%s" % (a, b)] = {"mean_points": float(np.mean(d)),
                                              "sd_points": float(np.std(d)),
                                              "per_seed": d}
        out[net] = cell
    return out


def simulated_run(net_name, mode, workers, seed, epochs, batch_size, lr):
    """One net trained by ``workers`` simulated workers (see the module docstring)."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from ..data import load_digits, shard
    from ..digits import evaluate, lr_scheduler
    from ..models import NETS
    from ..kvstore import momentum as momentum_correction
    from ..kvstore.options import DEFAULT_WARMUP_STEPS
    from ..kvstore.policy import LayerPolicy
    from ..kvstore.simulate import SimulatedWorkers

    mx.random.seed(seed)
    np.random.seed(seed)
    make_net, size, channels = NETS[net_name]
    x_train, y_train, x_test, y_test = load_digits(0.25, seed=0, size=size,
                                                   channels=channels)
    net = make_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    shards = [shard(x_train, y_train, workers, w) for w in range(workers)]
    steps_per_epoch = min(len(y) for _, y in shards) // batch_size
    total = epochs * steps_per_epoch
    sgd = {"learning_rate": lr, "momentum": 0.9, "wd": 1e-4,
           "lr_scheduler": lr_scheduler("cosine", lr, total, steps_per_epoch)}
    trainer = gluon.Trainer(net.collect_params(), "sgd", sgd, kvstore=None)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    policy = LayerPolicy()
    plans = {}
    sim = SimulatedWorkers(workers, warmup_steps=0 if mode == "dense"
                           else DEFAULT_WARMUP_STEPS)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rngs = [np.random.RandomState(seed + 1000 * w) for w in range(workers)]
    start = time.time()
    for epoch in range(epochs):
        orders = [r.permutation(len(y)) for r, (_, y) in zip(rngs, shards)]
        for step in range(steps_per_epoch):
            grads = [[] for _ in params]
            for w, (x, y) in enumerate(shards):
                idx = orders[w][step * batch_size:(step + 1) * batch_size]
                with autograd.record():
                    loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
                loss.backward()
                for i, p in enumerate(params):
                    grads[i].append(p.grad().copy())
            # the rescale Trainer.step sets, which the momentum correction reads first
            trainer._optimizer.rescale_grad = trainer._scale / (batch_size * workers)
            ctx = momentum_correction.from_optimizer(trainer._optimizer)
            for i, p in enumerate(params):
                if p.name not in plans:
                    plan = policy.plan(p.name, p.shape)
                    if mode == "dense" or plan.strategy == "none":
                        plan = policy.plan_as(p.name, p.shape, "none")
                    elif mode == "shared":
                        plan = policy.plan_as(p.name, p.shape, "shared_2bit")
                    plans[p.name] = plan
                p.grad()[:] = sim.exchange(plans[p.name], grads[i], ctx)
            trainer.step(batch_size * workers)
    accuracy_ = evaluate(net, x_test, y_test, mx.cpu())
    return {"net": net_name, "mode": mode, "workers": workers, "seed": seed,
            "epochs": epochs, "batch_size": batch_size, "lr": lr, "accuracy": accuracy_,
            "steps": total, "seconds": time.time() - start,
            "strategies": {n: p.strategy for n, p in plans.items()}}


def plot(out, path):
    """Pull bytes against W (gather and sum pulls) and the simulated workers' accuracy."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for model, got in out.get("bytes", {}).items():
        ws = [r["workers"] for r in got["rows"]]
        for key, style in (("gather_pull_fraction", "o--"), ("sum_pull_fraction", "s-")):
            axes[0].plot(ws, [r[key] for r in got["rows"]], style,
                         label="%s, %s" % (model, key.split("_")[0]))
        axes[0].set(xscale="log", xticks=ws, xticklabels=ws, xlabel="workers",
                    ylabel="pull per worker / dense bytes")
        axes[0].minorticks_off()
    axes[0].legend(fontsize=7)
    merge = out.get("merge", [])
    if merge:       # beside the bytes on a second scale, else alone
        ax = axes[0].twinx() if out.get("bytes") else axes[0]
        ws = [r["workers"] for r in merge]
        ax.plot(ws, [1e3 * r["per_slot_s"] for r in merge], "^:k",
                label="servers' merge, ms a slot")
        ax.set(xscale="log", xticks=ws, xticklabels=ws, xlabel="workers",
               ylabel="servers' merge, ms per worker's slot (%d KB)"
               % round(merge[0]["slot_bytes"] / 1e3))
        ax.minorticks_off()
        ax.legend(fontsize=7, loc="lower right")
    if "accuracy" not in out:
        axes[1].set_visible(False)
    # what a user asks: how far each compressed pull ends from dense, seed by seed
    paired = out.get("accuracy", {}).get("paired", {})
    for i, (net, cell) in enumerate(paired.items()):
        for j, (label, key) in enumerate((("gather", "dense-gather"),
                                          ("sum (shared_2bit)", "dense-shared"))):
            if key in cell:     # 'a-b' holds a - b: the pull's difference is its negative
                axes[1].bar(i + (j - 0.5) * 0.35, -cell[key]["mean_points"], 0.35,
                            yerr=cell[key]["sd_points"], capsize=3,
                            label=label if i == 0 else None, color="C%d" % (j + 1))
    for bound in (-0.5, 0.5):
        axes[1].axhline(bound, color="grey", linestyle=":", linewidth=1)
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[1].set_xticks(range(len(paired)))
    axes[1].set_xticklabels(list(paired))
    axes[1].set(ylabel="test accuracy minus dense's, points\n(paired mean over seeds, +-sd)")
    if paired:
        axes[1].legend(fontsize=7)
    report.save(fig, path, report.caption(out, "scale: %s servers; %s simulated workers" % (
        out["config"]["servers"], out["config"]["sim_workers"])))
