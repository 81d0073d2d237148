"""``python -m mxhylo.bench train``: real Gluon training steps over MXNet's parameter
server, each process in its own network namespace behind a shaped link.

W workers, S servers and a scheduler run in the namespaces of ``bench comm``
(mxhylo.bench.netns: a star through a bridge, every link shaped with tc tbf at --rate
in both directions). The processes are started and stopped by mxhylo.launch's Job
(each in its own process group, SIGKILLed if this harness dies, SIGTERM then SIGKILL
at the end of a job, a time limit per job). One parameter-server job per model and
mode; only the kvstore differs between modes (see ``--modes``).

Speed (the default): every worker trains gluoncv model ``--models`` on one fixed
synthetic batch of ``--batch-size`` images of ``--image-size`` (ResNets: 64 by default,
their parameter shapes do not depend on the input size; vgg/alexnet: 224, which their
classifier needs) with gluon.Trainer, SGD with momentum. See mxhylo.bench.train_worker
for what is timed. Per model and mode the report gives, each as the median over the
timed rounds of the slowest worker's time (workers meet at a file barrier before each
step), with min and max:

* ``step``: forward, backward, trainer.step, waitall: what a training step costs;
* ``fwd_bwd``: forward and backward alone (no exchange running);
* ``exchange``: trainer.step alone on gradients already computed, and waitall;
* ``overlap_s`` = fwd_bwd + exchange - step: how much of the exchange hides behind
  the computation (0: none; the exchange's time: all of it);
* ``stream``: seconds per step of back-to-back steps with no wait between them;
* bytes on the wire per exchange from the interface counters (push = workers' tx,
  pull = workers' rx), hylo's own kv.stats() counts and per-phase timing;
* ``speedup_vs_dist_sync``: dist_sync's step time over the mode's, same run;
* ``speedup_vs_best_peer``: the best peer's step time over the mode's, same run: the
  fastest mode not named hylo* (dist_sync, dist_sync_fp16, horovod_dense, ...: what a
  user would run instead of mxhylo), named in ``best_peer``;
* whether the workers end with bitwise identical trainable parameters (SHA-256).

Time to accuracy (``--tta``): every mode and seed trains ``--tta-model`` (default
gluoncv resnet18_v1b, 10 classes, whose 3x3 conv layers, compressed by hylo as
conv_topk, hold almost all of its bytes) on scikit-learn's digits packed as .rec at
``--tta-size`` pixels (mxhylo.io.RecordLoader, each worker its part), for
``--tta-epochs`` epochs with a cosine learning rate; rank 0 evaluates the validation
set after every epoch. Reported per mode and seed: training seconds (evaluation
excluded; wall seconds with it too), epochs and steps to the first evaluation at or
above ``--target``, the final accuracy, the accuracy curve against time (PNG), and
whether the workers end bitwise identical; time-to-target speedups over dist_sync and
over the best peer (the fastest non-hylo mode to the target).

The float16 peers move half of dist_sync's bytes while forward, backward, weights and
the update stay float32: dist_sync_fp16 (MXNet's dist_sync with each gradient cast to
float16 around the store's pushpull, mxhylo.bench.fp16.DistSyncFP16Store, update on the
workers) and horovod_fp16 (hvd.DistributedTrainer with hvd.Compression.fp16).

Needs root (namespaces); says so and exits non-zero otherwise. Everything created
(processes, namespaces, temporary files) is removed at the end, on error and on
SIGINT/SIGTERM/SIGHUP. Scheduler ports: each job uses its own (9091 upwards) inside
namespaces that only this run uses, so they are free by construction.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import netns, plot_path, sweep
from .comm import (ShapedRun, best_peer, hylo_available, hylo_summary, is_peer,
                   machine_info, model_summary, parse_hylo_options, parse_list, role_names,
                   shapes_in_subprocess, wire_summary)
from .horovod_jobs import HOROVOD_MODES, horovod_available
from .jobs import JobError, run_job
from .train_worker import MODES
from .. import launch

WORKER = "mxhylo.bench.train_worker"

DEFAULT_MODES = ("dist_sync", "dist_sync_fp16", "hylo_densepull", "hylo")
HYLO_MODES = ("hylo_densepull", "hylo", "hylo_nooverlap", "hylo_workers", "hylo_dynamic",
              "hylo_shared")
BASELINE = "dist_sync"
PS_PORT = 9091
FULL_SIZE_MODELS = ("vgg", "alexnet")     # classifier shapes depend on the input size
STORE_WARMUP_ALLOWANCE = 40               # steps a store's dense warm-up may take
_CPU_BYTES_PER_S = 50e6                   # codec/copy CPU bound used in job time limits


def add_arguments(parser):
    parser.add_argument("-n", "--workers", type=int, default=4, help="workers (default 4)")
    parser.add_argument("-s", "--servers", type=int, default=2, help="servers (default 2)")
    parser.add_argument("--rate", default="1gbit",
                        help="tc tbf rate of every link, each direction (default 1gbit; "
                             "'none': unshaped). A comma-separated list runs a bandwidth "
                             "sweep: every model and mode at each rate, and each mode's "
                             "speedup over dist_sync against bandwidth (JSON and PNG)")
    parser.add_argument("--delay", default=None,
                        help="one-way delay between nodes via netem, e.g. 1ms (default none)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated modes of %s (default %s): dist_sync = MXNet's "
                             "dense store with gluon.Trainer's defaults; "
                             "dist_sync_workerupdate = the same with update_on_kvstore="
                             "False; dist_sync_fp16 = the same moving float16 gradients "
                             "(cast around the store's pushpull; compute, weights and "
                             "update float32 on the workers); hylo_densepull = "
                             "mxhylo.create('dist_sync_hylo', compress_pull=False); "
                             "hylo = mxhylo.create('dist_sync_hylo'); "
                             "hylo_nooverlap = the same, the exchange after backward "
                             "(mxhylo.kvstore.hylo.OVERLAP = False); "
                             "hylo_workers = the same with server_update=False (hylo's "
                             "exchange even where the servers' route would be chosen); "
                             "horovod_dense = hvd.DistributedTrainer (Horovod's dense ring "
                             "allreduce); horovod_fp16 = the same with compression="
                             "hvd.Compression.fp16; hylo_horovod = "
                             "mxhylo.create('dist_sync_hylo', transport='horovod'). The "
                             "Horovod modes run W processes, one per worker namespace, "
                             "and no servers"
                             % (", ".join(MODES), ",".join(DEFAULT_MODES)))
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON dict of extra options for mxhylo.create in the hylo "
                             "modes (default {})")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9)")
    parser.add_argument("--wd", type=float, default=1e-4, help="weight decay (1e-4)")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of each worker (default 1: W workers share "
                             "the machine's cores; 0 leaves it to MXNet). Servers run one "
                             "OpenMP thread, as mxhylo.launch starts them")
    parser.add_argument("--no-hybridize", dest="hybridize", action="store_false",
                        help="run the models imperatively (default: hybridized, "
                             "static_alloc)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and data (0)")
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the links (1500)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per job before it is stopped (default: from the "
                             "model's size, the rate and the number of steps)")
    parser.add_argument("--plot", default=None,
                        help="PNG (default: beside --json, same name with .png)")
    parser.add_argument("--keep-tmp", action="store_true",
                        help="keep the job directories (configs, logs, worker results)")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="first delete namespaces left by killed runs of bench comm or "
                             "train (mxhcomm<pid>-* whose pid is gone)")
    g = parser.add_argument_group("speed (default)")
    g.add_argument("--models", default="resnet50_v1b",
                   help="comma-separated gluoncv model names (default resnet50_v1b)")
    g.add_argument("--image-size", type=int, default=None,
                   help="input side in pixels (default: 224 for vgg*/alexnet, whose "
                        "classifier needs it; 64 otherwise: ResNet shapes do not depend "
                        "on it)")
    g.add_argument("--batch-size", type=int, default=8, help="images per worker (8)")
    g.add_argument("--classes", type=int, default=1000, help="model output classes (1000)")
    g.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (0.01)")
    g.add_argument("--steps", type=int, default=5,
                   help="timed rounds (one full step and one split step each; default 5)")
    g.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    g.add_argument("--stream-steps", type=int, default=4,
                   help="back-to-back steps with no wait between them, timed together "
                        "(default 4; 0: none)")
    g = parser.add_argument_group("time to accuracy (--tta)")
    g.add_argument("--tta", action="store_true",
                   help="measure time to accuracy on the digits instead of step times")
    g.add_argument("--tta-model", default="resnet18_v1b",
                   help="gluoncv model, 10 classes (default resnet18_v1b)")
    g.add_argument("--tta-size", type=int, default=16,
                   help="digits image side in pixels (default 16)")
    g.add_argument("--tta-batch-size", type=int, default=32, help="per worker (32)")
    g.add_argument("--tta-lr", type=float, default=0.03,
                   help="peak SGD learning rate, cosine decay to 0 (default 0.03)")
    g.add_argument("--tta-epochs", type=int, default=15, help="epochs per run (15)")
    g.add_argument("--tta-batch-schedule", default="5,10", metavar="E1,E2,...",
                   help="the *_dynamic modes: k micro-batches per update, 1 doubled at "
                        "each epoch listed (default 5,10)")
    g.add_argument("--tta-batch-lr", choices=("linear", "none"), default="linear",
                   help="the *_dynamic modes: the lr times k (linear, the default) or "
                        "the cosine schedule's own (none)")
    g.add_argument("--target", type=float, default=0.95,
                   help="target validation accuracy (default 0.95)")
    g.add_argument("--seeds", type=int, default=3, help="seeds per mode (default 3)")
    g.add_argument("--tta-data", default=None,
                   help="folder with digits_{train,val}.{rec,idx} (default: written to a "
                        "temporary folder by mxhylo.im2rec's digits sample)")


# ----------------------------------------------------------------------------- checks

def image_size_for(model, image_size=None):
    """The input side for ``model``: 224 for vgg*/alexnet (and only 224 is accepted:
    their first fully connected layer's shape follows the input), else ``image_size``
    or 64."""
    full = model.lower().startswith(FULL_SIZE_MODELS)
    if image_size is None:
        return 224 if full else 64
    if full and image_size != 224:
        raise ValueError("%s needs --image-size 224 (its classifier's shape depends on the "
                         "input size), got %d" % (model, image_size))
    if image_size < 16:
        raise ValueError("--image-size must be at least 16, got %d" % image_size)
    return image_size


def check_args(args):
    """Validate the options; returns a dict of parsed values (rate_bps, delay_s, modes,
    models, image_sizes, hylo_options) or raises ValueError with a clear message."""
    out = {}
    if args.workers < 1 or args.servers < 1:
        raise ValueError("need at least one worker and one server (-n %d, -s %d)"
                         % (args.workers, args.servers))
    out["rates"] = parse_list(args.rate, what="rate")
    for rate in out["rates"]:
        netns.parse_rate(rate)
    if len(out["rates"]) > 1 and args.tta:
        raise ValueError("--tta runs at one --rate, got %s" % args.rate)
    out["rate_bps"] = netns.parse_rate(out["rates"][0])
    out["delay_s"] = netns.parse_time(args.delay) if args.delay else 0.0
    out["modes"] = parse_list(args.modes, tuple(MODES), what="mode")
    if len(set(out["modes"])) != len(out["modes"]):
        raise ValueError("--modes lists a mode twice: %s" % args.modes)
    out["hylo_options"] = parse_hylo_options(args.hylo_options)
    if args.worker_threads < 0:
        raise ValueError("--worker-threads must be >= 0")
    if args.tta:
        if not 0.0 < args.target <= 1.0:
            raise ValueError("--target is an accuracy in (0, 1], got %g" % args.target)
        if args.seeds < 1 or args.tta_epochs < 1 or args.tta_batch_size < 1:
            raise ValueError("--seeds, --tta-epochs and --tta-batch-size must be >= 1")
        try:
            out["batch_schedule"] = [float(e) for e in args.tta_batch_schedule.split(",")
                                     if e.strip()]
        except ValueError:
            raise ValueError("--tta-batch-schedule: epochs separated by commas, got %r"
                             % args.tta_batch_schedule) from None
        if any(b <= a for a, b in zip(out["batch_schedule"], out["batch_schedule"][1:])):
            raise ValueError("--tta-batch-schedule: epochs must increase, got %r"
                             % args.tta_batch_schedule)
        if args.tta_size < 8:
            raise ValueError("--tta-size must be >= 8 (the digits are 8x8), got %d"
                             % args.tta_size)
        out["models"] = [args.tta_model]
    else:
        if args.steps < 1 or args.warmup < 0 or args.stream_steps < 0:
            raise ValueError("--steps must be >= 1, --warmup and --stream-steps >= 0")
        if args.batch_size < 1 or args.classes < 2:
            raise ValueError("--batch-size must be >= 1 and --classes >= 2")
        out["models"] = parse_list(args.models, what="model")
        out["image_sizes"] = {m: image_size_for(m, args.image_size) for m in out["models"]}
    return out


# ----------------------------------------------------------------------------- summaries

def spread(values):
    """{'min', 'median', 'max', 'n', 'values'} of a list of numbers (None when empty)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals),
            "n": len(vals), "values": vals}


def slowest(worker_results, get):
    """Per timed round: the largest ``get(round)`` over the workers."""
    n = min(len(r["rounds"]) for r in worker_results)
    return [max(get(r["rounds"][i]) for r in worker_results) for i in range(n)]


def overlap(fwd_bwd_s, exchange_s, step_s):
    """Seconds of the exchange hidden behind computation: compute + exchange - step."""
    return fwd_bwd_s + exchange_s - step_s


def checksum_summary(worker_results):
    """Whether the workers' trainable parameters are bitwise identical (and their peak
    memory, reported alongside)."""
    shas = [r.get("param_sha256") for r in sorted(worker_results, key=lambda r: r["index"])]
    rss = [r.get("peak_rss_bytes") for r in worker_results if r.get("peak_rss_bytes")]
    return {"workers_identical": len(set(shas)) == 1 and shas[0] is not None,
            "worker_peak_rss_bytes": max(rss) if rss else None,
            "param_sha256": shas,
            "param_abs_sum": [r.get("param_abs_sum") for r in
                              sorted(worker_results, key=lambda r: r["index"])]}


def hylo_timing(worker_results):
    """hylo's per-phase seconds per exchange over the counter window, per worker (from
    kv.stats()['timing'], which averages over all exchanges so far), or None."""
    out = []
    for r in sorted(worker_results, key=lambda r: r["index"]):
        a, b = r.get("stats") or {}, r.get("stats_before") or {}
        ta, tb = a.get("timing") or {}, b.get("timing") or {}
        sa, sb = a.get("steps") or 0, b.get("steps") or 0
        if not ta or sa <= sb:
            return None
        out.append({k: (ta[k] * sa - tb.get(k, 0.0) * sb) / float(sa - sb) for k in ta})
    return out


def exchange_cpu(worker_results, cpu_before=None, cpu_after=None, exchanges=1):
    """CPU seconds the exchange costs per step, workers and servers apart.

    workers: per worker, the median CPU seconds of a full step (forward, backward, the
    Trainer's step, everything the engine ran for them) minus the median of forward and
    backward alone (the split steps' first half), summed over the workers. servers:
    the servers' processes' CPU seconds over the timed window (the harness reads /proc
    at the 'start' and 'end' marks) per exchange, summed over the servers (0 without
    servers: Horovod). Moving work from workers to servers moves it between the two
    and leaves the total."""
    per_worker = []
    for r in sorted(worker_results, key=lambda r: r["index"]):
        full = [x["full"].get("cpu_s") for x in r["rounds"]]
        comp = [x["split"].get("fwd_bwd_cpu_s") for x in r["rounds"]]
        if None in full or None in comp or not full:
            return None
        per_worker.append(statistics.median(full) - statistics.median(comp))
    servers = 0.0
    if cpu_before and cpu_after:
        names = [n for n in cpu_before if n.startswith("server") and n in cpu_after]
        servers = sum(cpu_after[n] - cpu_before[n] for n in names) / float(max(exchanges, 1))
    workers = sum(per_worker)
    return {"workers_s": workers, "servers_s": servers, "total_s": workers + servers,
            "per_worker_s": per_worker,
            "fwd_bwd_cpu_s": statistics.median(
                [statistics.median([x["split"]["fwd_bwd_cpu_s"] for x in r["rounds"]])
                 for r in worker_results])}


def summarise_speed(worker_results, before, after, steps, cpu_before=None, cpu_after=None):
    """One mode's result from its workers' results and the counters (interface bytes,
    CPU seconds) around the window of ``steps`` timed rounds (2 * steps exchanges)."""
    step = slowest(worker_results, lambda x: x["full"]["seconds"])
    comp = slowest(worker_results, lambda x: x["split"]["fwd_bwd_s"])
    exch = slowest(worker_results, lambda x: x["split"]["exchange_s"])
    res = {"status": "ok", "step": spread(step), "fwd_bwd": spread(comp),
           "exchange": spread(exch)}
    res["step_s"] = res["step"]["median"]
    res["fwd_bwd_s"] = res["fwd_bwd"]["median"]
    res["exchange_s"] = res["exchange"]["median"]
    res["overlap_s"] = overlap(res["fwd_bwd_s"], res["exchange_s"], res["step_s"])
    res["overlap_fraction_of_exchange"] = (res["overlap_s"] / res["exchange_s"]
                                           if res["exchange_s"] > 0 else None)
    res["step_over_fwd_bwd"] = (res["step_s"] / res["fwd_bwd_s"]
                                if res["fwd_bwd_s"] > 0 else None)
    # where the full step's time was spent in Python (slowest worker's medians)
    res["full_step_parts_s"] = {
        k: statistics.median(slowest(worker_results, lambda x, k=k: x["full"][k]))
        for k in ("fwd_bwd_call_s", "step_call_s", "wait_s")}
    res["exchange_call_s"] = statistics.median(
        slowest(worker_results, lambda x: x["split"]["exchange_call_s"]))
    streams = [r.get("stream") for r in worker_results]
    if all(streams):
        res["stream_step_s"] = max(s["seconds"] / s["steps"] for s in streams)
    res["warmup_step_s"] = [max(r["warmup"][i]["full"]["seconds"] for r in worker_results)
                            for i in range(min(len(r["warmup"]) for r in worker_results))]
    res["setup_s"] = max(r["setup_s"] for r in worker_results)
    if all(r.get("first_step") for r in worker_results):
        # the store's construction (its measuring included) and the Trainer's first
        # step (the broadcast, a hylo store's plan), each the slowest worker's
        res["store_s"] = max(r["store_s"] for r in worker_results)
        res["first_step_s"] = max(r["first_step"]["seconds"] for r in worker_results)
        res["store_and_first_step_s"] = max(r["store_s"] + r["first_step"]["seconds"]
                                            for r in worker_results)
    res["plan"] = worker_results[0].get("plan")     # (the same on every worker)
    res["store_warmup_steps_run"] = max(r.get("store_warmup_steps_run", 0)
                                        for r in worker_results)
    res["update_on_kvstore"] = worker_results[0].get("update_on_kvstore")
    exchanges = 2 * steps
    if before and after:
        res["wire"] = wire_summary(before, after, exchanges)     # per exchange
    res["exchange_cpu"] = exchange_cpu(worker_results, cpu_before, cpu_after, exchanges)
    if any(r.get("stats") is not None for r in worker_results):
        res["hylo"] = hylo_summary(worker_results, exchanges)
        timing = hylo_timing(worker_results)
        if timing is not None:
            res["hylo"]["timing_per_exchange_s"] = timing
    res.update(checksum_summary(worker_results))
    return res


def add_speedups(per_mode, baseline=BASELINE):
    """speedup_vs_<baseline> = baseline step seconds / mode step seconds (also for the
    stream steps), for every mode that ran."""
    base = per_mode.get(baseline, {})
    for res in per_mode.values():
        if res.get("status") != "ok":
            continue
        b, m = base.get("step_s"), res.get("step_s")
        res["speedup_vs_" + baseline] = (b / m) if (b and m) else None
        b, m = base.get("stream_step_s"), res.get("stream_step_s")
        res["stream_speedup_vs_" + baseline] = (b / m) if (b and m) else None
    return per_mode


def add_best_peer(per_mode):
    """speedup_vs_best_peer = the best peer's step seconds / the mode's, for every mode
    that ran; the best peer (named in best_peer) is the fastest mode of the same run not
    named hylo* (comm.is_peer)."""
    peer, peer_s = best_peer(per_mode, "step_s")
    for res in per_mode.values():
        if res.get("status") != "ok":
            continue
        res["best_peer"] = peer
        step = res.get("step_s")
        res["speedup_vs_best_peer"] = (peer_s / step) if (peer_s and step) else None
    return per_mode


def time_to_target(history, target):
    """The first evaluation at or above ``target``: {train_s, wall_s, epochs, steps,
    accuracy}, or None when none reached it."""
    for h in history:
        if h.get("accuracy") is not None and h["accuracy"] >= target:
            return {"train_s": h["train_s"], "wall_s": h["wall_s"], "epochs": h["epoch"],
                    "steps": h["steps"], "accuracy": h["accuracy"]}
    return None


def summarise_tta_run(worker_results, target, before=None, after=None):
    rank0 = [r for r in worker_results if r["rank"] == 0]
    if len(rank0) != 1:
        raise ValueError("expected one rank-0 result, got %d" % len(rank0))
    history = rank0[0]["history"]
    res = {"status": "ok", "seed": rank0[0]["seed"], "history": history,
           "time_to_target": time_to_target(history, target),
           "final_accuracy": history[-1].get("accuracy") if history else None,
           "train_s": history[-1]["train_s"] if history else None,
           "wall_s": history[-1]["wall_s"] if history else None,
           "steps_per_epoch": rank0[0]["steps_per_epoch"],
           "updates_per_epoch": [h["updates"] - (history[i - 1]["updates"] if i else 0)
                                 for i, h in enumerate(history) if "updates" in h],
           "setup_s": max(r["setup_s"] for r in worker_results),
           "update_on_kvstore": rank0[0].get("update_on_kvstore")}
    steps = history[-1]["steps"] if history else 0
    if before and after and steps:
        res["wire"] = wire_summary(before, after, steps)        # per step
    stats = rank0[0].get("stats")
    if stats:
        res["hylo"] = {k: stats.get(k) for k in ("steps", "bytes_pushed", "bytes_pulled",
                                                  "dense_bytes", "ratio", "timing")}
    res.update(checksum_summary(worker_results))
    return res


def summarise_tta(runs, baseline=BASELINE):
    """Per mode over its seeds: time to target (training clock; runs that reached it),
    epochs, final accuracy (mean, sd), gap to the baseline in points, speedup."""
    out = {}
    for mode, rs in runs.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        reached = [r["time_to_target"] for r in ok if r.get("time_to_target")]
        finals = [r["final_accuracy"] for r in ok if r.get("final_accuracy") is not None]
        s = {"runs": len(rs), "ok": len(ok), "reached": len(reached),
             "time_to_target_s": spread([t["train_s"] for t in reached]),
             "wall_to_target_s": spread([t["wall_s"] for t in reached]),
             "epochs_to_target": spread([t["epochs"] for t in reached]),
             "steps_to_target": spread([t["steps"] for t in reached]),
             "final_accuracy": spread(finals),
             "train_s": spread([r["train_s"] for r in ok]),
             "workers_identical_all": all(r.get("workers_identical") for r in ok) if ok
             else None}
        if len(finals) > 1:
            s["final_accuracy"]["mean"] = statistics.mean(finals)
            s["final_accuracy"]["sd"] = statistics.stdev(finals)
        elif finals:
            s["final_accuracy"]["mean"], s["final_accuracy"]["sd"] = finals[0], 0.0
        out[mode] = s
    base = out.get(baseline)
    peers = {m: s["time_to_target_s"]["median"] for m, s in out.items()
             if is_peer(m) and s["time_to_target_s"]}
    peer = min(peers, key=peers.get) if peers else None
    finals_of = {m: {r["seed"]: r["final_accuracy"] for r in rs if r.get("status") == "ok"
                     and r.get("final_accuracy") is not None} for m, rs in runs.items()}
    for mode, s in out.items():
        s["updates"] = sum(sum(r.get("updates_per_epoch") or [0]) for r in runs[mode]
                           if r.get("status") == "ok") / max(1, s["ok"])
        # the same seed in both modes: differences, not a difference of means; a
        # *_dynamic mode also against its fixed-schedule twin
        twin = mode[:-len("_dynamic")] if mode.endswith("_dynamic") else None
        for key, other in (("paired_gap_points", baseline),
                           ("paired_gap_vs_fixed_points", twin)):
            paired = [100.0 * (finals_of[mode][seed] - finals_of[other][seed])
                      for seed in sorted(finals_of[mode]) if seed in finals_of.get(other, {})]
            if paired and mode != other:
                s[key] = {"vs": other, "mean": statistics.mean(paired), "sd": (
                    statistics.stdev(paired) if len(paired) > 1 else 0.0),
                    "n": len(paired), "worst": min(paired)}
        if twin in out and out[twin]["time_to_target_s"] and s["time_to_target_s"]:
            s["time_to_target_speedup_vs_fixed"] = (
                out[twin]["time_to_target_s"]["median"] / s["time_to_target_s"]["median"])
        if base and base["final_accuracy"] and s["final_accuracy"]:
            s["accuracy_gap_points"] = 100.0 * (s["final_accuracy"]["mean"]
                                                - base["final_accuracy"]["mean"])
        if base and base["time_to_target_s"] and s["time_to_target_s"]:
            s["time_to_target_speedup_vs_" + baseline] = (
                base["time_to_target_s"]["median"] / s["time_to_target_s"]["median"])
        s["best_peer"] = peer        # the peer fastest to the target (median over seeds)
        if peer and s["time_to_target_s"]:
            s["time_to_target_speedup_vs_best_peer"] = (
                peers[peer] / s["time_to_target_s"]["median"])
    return out


# ----------------------------------------------------------------------------- tables

def _ordered(report, per_mode):
    """The modes of ``per_mode`` in the order of the run's --modes (a report read back
    from JSON has its keys sorted)."""
    first = [m for m in report.get("config", {}).get("modes", []) if m in per_mode]
    return first + [m for m in per_mode if m not in first]


def _ordered_models(report):
    first = [m for m in report.get("config", {}).get("models", []) if m in report["results"]]
    return first + [m for m in report["results"] if m not in first]


def _mb(x):
    return "%.1f" % (x / 1e6) if x is not None else "-"


def format_speed_table(report):
    """Per model and mode: step, compute, exchange and overlap seconds, the exchange's
    CPU seconds per step (workers' sum + servers' sum: exchange_cpu), the step speedup
    over dist_sync ('speedup') and over the run's best peer ('vs peer'), stream steps,
    bytes per exchange, identical workers, memory; then the best peer."""
    lines = ["%-13s %-15s %14s %7s %7s %7s %11s %8s %8s %7s %9s %9s %5s %6s" % (
        "model", "mode", "step s (range)", "fwd+bwd", "exch", "overlap", "CPU s w+s",
        "speedup", "vs peer", "stream", "push MB/x", "pull MB/x", "same", "RSS GB")]
    for model in _ordered_models(report):
        per_mode = report["results"][model]
        for mode in _ordered(report, per_mode):
            r = per_mode[mode]
            if r.get("status") != "ok":
                lines.append("%-13s %-15s %s" % (model, mode, r.get("status")))
                continue
            wire = r.get("wire", {})
            sp = r.get("speedup_vs_" + BASELINE)
            vp = r.get("speedup_vs_best_peer")
            rss = r.get("worker_peak_rss_bytes")
            cpu = r.get("exchange_cpu")
            lines.append("%-13s %-15s %5.3f %-8s %7.3f %7.3f %7.3f %11s %8s %8s %7s %9s %9s "
                         "%5s %6s" % (
                model, mode, r["step_s"], "(%.2f-%.2f)" % (r["step"]["min"], r["step"]["max"]),
                r["fwd_bwd_s"], r["exchange_s"], r["overlap_s"],
                "%.2f+%.2f" % (cpu["workers_s"], cpu["servers_s"]) if cpu else "-",
                "%.2fx" % sp if sp else "-", "%.2fx" % vp if vp else "-",
                "%.3f" % r["stream_step_s"] if r.get("stream_step_s") else "-",
                _mb(wire.get("push_bytes_per_step")), _mb(wire.get("pull_bytes_per_step")),
                "yes" if r.get("workers_identical") else "NO",
                "%.2f" % (rss / 2.0 ** 30) if rss else "-"))
        vs = [(mode, per_mode[mode].get("speedup_vs_horovod_dense"))
              for mode in _ordered(report, per_mode) if mode != "horovod_dense"]
        vs = [(mode, x) for mode, x in vs if x]
        if vs:
            lines.append("%-13s step speedup vs horovod_dense: %s" % (
                model, ", ".join("%s %.2fx" % v for v in vs)))
        peer, peer_s = best_peer(per_mode, "step_s")
        if peer:
            vs = [(mode, per_mode[mode].get("speedup_vs_best_peer"))
                  for mode in _ordered(report, per_mode)
                  if not is_peer(mode) and per_mode[mode].get("status") == "ok"]
            lines.append("%-13s best peer (fastest non-hylo mode): %s, step %.3f s%s" % (
                model, peer, peer_s, "; step speedup vs it: " + ", ".join(
                    "%s %s" % (mode, "%.2fx" % x if x else "-") for mode, x in vs)
                if vs else ""))
    return lines


def format_tta_table(report):
    lines = ["%-15s %4s %8s %9s %7s %9s %8s %5s" % (
        "mode", "seed", "target s", "wall s", "epochs", "final acc", "train s", "same")]
    for mode in _ordered(report, report["runs"]):
        for r in report["runs"][mode]:
            if r.get("status") != "ok":
                lines.append("%-15s %4s %s" % (mode, r.get("seed"), r.get("status")))
                continue
            t = r["time_to_target"]
            lines.append("%-15s %4d %8s %9s %7s %9.4f %8.1f %5s" % (
                mode, r["seed"], "%.1f" % t["train_s"] if t else "not hit",
                "%.1f" % t["wall_s"] if t else "-", t["epochs"] if t else "-",
                r["final_accuracy"], r["train_s"],
                "yes" if r.get("workers_identical") else "NO"))
    for mode in _ordered(report, report["summary"]):
        s = report["summary"][mode]
        tt = s["time_to_target_s"]
        fa = s["final_accuracy"]
        lines.append("%-15s  reached %d/%d, time to target median %s s, final accuracy "
                     "%s%s%s" % (
                         mode, s["reached"], s["runs"], "%.1f" % tt["median"] if tt else "-",
                         "%.4f +- %.4f" % (fa["mean"], fa["sd"]) if fa else "-",
                         ", %+.2f points vs %s" % (s["accuracy_gap_points"], BASELINE)
                         if "accuracy_gap_points" in s else "",
                         ", %.2fx faster to target" % s["time_to_target_speedup_vs_" + BASELINE]
                         if s.get("time_to_target_speedup_vs_" + BASELINE) else ""))
        if s.get("time_to_target_speedup_vs_best_peer") and not is_peer(mode):
            lines[-1] += ", %.2fx vs the best peer (%s)" % (
                s["time_to_target_speedup_vs_best_peer"], s["best_peer"])
        extra = ["%.0f exchanges a run" % s["updates"]] if s.get("updates") else []
        for key in ("paired_gap_points", "paired_gap_vs_fixed_points"):
            if key in s:
                p = s[key]
                extra.append("paired final accuracy vs %s %+.2f points (sd %.2f, worst "
                             "%+.2f, %d seeds)" % (p["vs"], p["mean"], p["sd"], p["worst"],
                                                  p["n"]))
        if s.get("time_to_target_speedup_vs_fixed"):
            extra.append("%.2fx faster to target than the fixed batch"
                         % s["time_to_target_speedup_vs_fixed"])
        if extra:
            lines.append("%-15s  %s" % ("", "; ".join(extra)))
    return lines


# ----------------------------------------------------------------------------- plots

def write_speed_plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _ordered_models(report)
    fig, axes = plt.subplots(1, len(models), figsize=(max(7.5, 4.8 * len(models) + 1), 5.0),
                             squeeze=False)
    kinds = (("step", "step (fwd+bwd+exchange)"), ("fwd_bwd", "fwd+bwd alone"),
             ("exchange", "exchange alone"))
    colors = ("tab:blue", "tab:green", "tab:orange")
    for ax, model in zip(axes[0], models):
        per_mode = report["results"][model]
        modes = _ordered(report, per_mode)
        width = 0.26
        for j, ((key, label), color) in enumerate(zip(kinds, colors)):
            xs, ys, lo, hi = [], [], [], []
            for i, mode in enumerate(modes):
                r = per_mode[mode]
                if r.get("status") != "ok":
                    continue
                xs.append(i + (j - 1) * width)
                ys.append(r[key]["median"])
                lo.append(r[key]["median"] - r[key]["min"])
                hi.append(r[key]["max"] - r[key]["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=color, label=label)
        for i, mode in enumerate(modes):
            r = per_mode[mode]
            if r.get("status") != "ok":
                ax.text(i, 0, (r.get("status") or "").split(":")[0], ha="center",
                        va="bottom", fontsize=8, color="tab:red")
            sp = r.get("speedup_vs_" + BASELINE) if r.get("status") == "ok" else None
            vp = r.get("speedup_vs_best_peer") if r.get("status") == "ok" else None
            if sp:
                label = "%.2fx" % sp
                if vp and not is_peer(mode):
                    label += "\n%.2fx peer" % vp
                ax.annotate(label, (i - width, r["step_s"]), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 3),
                            textcoords="offset points")
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes, fontsize=8)
        ax.set_title("%s, %dpx, batch %d/worker" % (
            model, report["config"]["image_sizes"][model], report["config"]["batch_size"]),
            fontsize=9)
        ax.set_ylabel("seconds (median of slowest worker; bars: min-max)")
    axes[0][0].legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle("bench train: %d workers + %d servers, %s links\nspeedup = dist_sync step "
                 "/ mode step; 'peer' = the best peer's step (fastest non-hylo mode) / mode "
                 "step\n%s, %s" % (cfg["workers"], cfg["servers"], cfg["rate"],
                                   report["machine"].get("cpu", ""),
                                   report["date"][:16]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tta_plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    dynamic = any(m.endswith("_dynamic") for m in report["runs"])
    fig, axes = plt.subplots(2 if dynamic else 1, 1, figsize=(8, 8 if dynamic else 5),
                             squeeze=False, sharex=True)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    for j, mode in enumerate(_ordered(report, report["runs"])):
        for k, r in enumerate(report["runs"][mode]):
            if r.get("status") != "ok":
                continue
            xs = [h["train_s"] for h in r["history"]]
            ys = [h["accuracy"] for h in r["history"]]
            ax.plot(xs, ys, styles[k % len(styles)], marker=".", color=colors[j % len(colors)],
                    label="%s seed %d" % (mode, r["seed"]))
            if dynamic and k == 0 and r.get("updates_per_epoch"):
                # the global batch of each epoch's updates: its micro-batches per update
                per_update = [cfg["batch_size"] * cfg["workers"] * r["steps_per_epoch"] / u
                              for u in r["updates_per_epoch"]]
                axes[1][0].step([0.0] + xs, per_update + per_update[-1:], where="post",
                                color=colors[j % len(colors)], label=mode)
    if dynamic:
        axes[1][0].set_ylabel("samples per update (all workers)")
        axes[1][0].set_xlabel("training seconds (evaluation excluded); first seed")
        axes[1][0].legend(fontsize=7)
    ax.axhline(cfg["target"], color="k", lw=0.8, ls="--", label="target %.2f" % cfg["target"])
    if not dynamic:
        ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation accuracy (rank 0)")
    ax.set_ylim(max(0.0, cfg["target"] - 0.35), 1.0)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("time to accuracy: %s %dpx on the digits, %d workers + %d servers, %s"
                 % (cfg["model"], cfg["image_size"], cfg["workers"], cfg["servers"],
                    cfg["rate"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- machine

def machine_report():
    info = machine_info()
    try:
        info["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for key, cmd in (("git_commit", ["git", "-C", repo, "log", "-1", "--oneline"]),
                     ("git_dirty", ["git", "-C", repo, "status", "--porcelain", "--",
                                    "kvstore", "ops", "mxhylo"])):
        try:
            res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, timeout=10)
            if res.returncode == 0:
                info[key] = res.stdout.strip() if key == "git_commit" else \
                    [line for line in res.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


# ----------------------------------------------------------------------------- jobs

def speed_timeout(summary, num_workers, steps, warmup, stream):
    """Seconds for one speed job: start-up plus, per exchange, 6 dense-pull floors, the
    codec CPU bound and 10 s of computation."""
    exchanges = 2 * (steps + warmup) + stream + STORE_WARMUP_ALLOWANCE
    return 240.0 + exchanges * (6.0 * summary["dense_pull_floor_s"]
                                + num_workers * summary["dense_bytes"] / _CPU_BYTES_PER_S
                                + 10.0)


def tta_timeout(summary, num_workers, total_steps, epochs):
    return 240.0 + epochs * 20.0 + total_steps * (
        6.0 * summary["dense_pull_floor_s"]
        + num_workers * summary["dense_bytes"] / _CPU_BYTES_PER_S + 2.0)


# ----------------------------------------------------------------------------- run

def _log(msg):
    print("[train] " + msg, file=sys.stderr, flush=True)


def digits_records(folder, size, tmp):
    """{'train_rec', 'train_idx', 'val_rec', 'val_idx'} of the digits sample at ``size``
    (written under ``tmp`` unless ``folder`` already holds them)."""
    if folder is None:
        from mxhylo.io.digits_sample import write_digits
        folder = os.path.join(tmp, "digits%d" % size)
        write_digits(folder, size=size, progress=False)
    out = {}
    for part in ("train", "val"):
        for ext in ("rec", "idx"):
            path = os.path.join(folder, "digits_%s.%s" % (part, ext))
            if not os.path.isfile(path):
                raise SystemExit("mxhylo.bench train: %s is missing (make it with python -m "
                                 "mxhylo.im2rec --digits %s --size %d)" % (path, folder, size))
            out["%s_%s" % (part, ext)] = path
    return out


def steps_per_epoch(num_records, num_workers, batch_size):
    """Steps every worker can take per epoch: its smallest ImageRecordIter part
    (ceil(N/W) records each, the last one smaller) in whole batches."""
    from mxhylo.io.recfile import part_range
    sizes = [b - a for a, b in (part_range(num_records, num_workers, p)
                                for p in range(num_workers))]
    return min(sizes) // batch_size


DEFAULT_MODE = "hylo"        # mxhylo's defaults: the mode a sweep's bar is about


def run(args):
    """One report per rate of --rate (a comma-separated list); with several rates, a
    sweep report holding them and each mode's speedup over dist_sync against
    bandwidth (mxhylo.bench.sweep)."""
    try:
        rates = check_args(args)["rates"]
    except ValueError as err:
        raise SystemExit("mxhylo.bench train: %s" % err)
    if len(rates) == 1:
        return run_rate(args)
    per_rate = {}
    for rate in rates:
        _log("=== rate %s ===" % rate)
        per_rate[rate] = run_rate(argparse.Namespace(**dict(vars(args), rate=rate)),
                                  plot="")
    report = sweep.sweep_report("train", rates, per_rate, BASELINE, DEFAULT_MODE)
    for line in sweep.format_sweep(report):
        _log(line)
    plot = plot_path(args)
    if plot:
        sweep.write_sweep_plot(report, plot)
        report["plot"] = plot
        _log("plot: " + plot)
    return report


def run_rate(args, plot=None):
    """The report of one rate (args.rate); plot: the PNG's path ('' for none; None: next
    to --json)."""
    try:
        parsed = check_args(args)
    except ValueError as err:
        raise SystemExit("mxhylo.bench train: %s" % err)
    reason = netns.check_capable()
    if reason:
        raise SystemExit("mxhylo.bench train: cannot create network namespaces: "
                         + reason.replace("the comm benchmark", "this benchmark"))
    W, S = args.workers, args.servers
    modes = parsed["modes"]
    skipped = {m: "skipped: mxhylo.kvstore.transport_ps is not available in this build"
               for m in modes if m in HYLO_MODES and not hylo_available()}
    skipped.update({m: "skipped: horovod.mxnet is not installed (make setup builds it with "
                       "MXNet and Gloo)"
                    for m in modes if m in HOROVOD_MODES and not horovod_available()})
    if plot is None:
        plot = plot_path(args)
    if args.cleanup_stale:
        for name in netns.stale_namespaces():
            subprocess.run(["ip", "netns", "del", name], timeout=netns.CMD_TIMEOUT)
            _log("removed stale namespace " + name)

    report = {"suite": "train", "task": "tta" if args.tta else "speed",
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_report(),
              "mode_descriptions": {m: MODES[m].description for m in modes}}
    common = {"workers": W, "servers": S, "rate": args.rate, "rate_bps": parsed["rate_bps"],
              "delay": args.delay, "mtu": args.mtu, "modes": modes,
              "hylo_options": parsed["hylo_options"], "momentum": args.momentum,
              "wd": args.wd, "worker_omp_threads": args.worker_threads or None,
              "server_omp_threads": launch.SERVER_DEFAULTS.get("OMP_NUM_THREADS"),
              "hybridize": args.hybridize, "seed": args.seed}

    topo = netns.Topology(role_names(W, S), parsed["rate_bps"], parsed["delay_s"],
                          mtu=args.mtu, tag="train")
    tmp = tempfile.mkdtemp(prefix="mxhylo-train-")

    with ShapedRun(topo, tmp, "train", args.keep_tmp) as shaped:
        _log("namespaces %s* up: %d roles, %s links" % (topo.prefix, len(topo.roles),
                                                         args.rate))
        run_mode = _run_tta if args.tta else _run_speed
        shaped.failed = run_mode(args, parsed, common, report, topo, tmp, skipped)
    try:
        report["machine"]["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    lines = report["table"]
    for line in lines:
        _log(line)
    if plot:
        (write_tta_plot if args.tta else write_speed_plot)(report, plot)
        report["plot"] = plot
        _log("plot: " + plot)
    return report


def _run_speed(args, parsed, common, report, topo, tmp, skipped):
    W, S = args.workers, args.servers
    models, sizes = parsed["models"], parsed["image_sizes"]
    report["config"] = dict(common, task="speed", models=models, image_sizes=sizes,
                            batch_size=args.batch_size, classes=args.classes, lr=args.lr,
                            steps=args.steps, warmup=args.warmup,
                            stream_steps=args.stream_steps, data="synthetic, one fixed "
                            "random batch per worker")
    report["notes"] = [
        "seconds: median (and min/max) over %d timed rounds of the slowest worker's time; "
        "workers meet at a file barrier before each step; %d warm-up rounds excluded"
        % (args.steps, args.warmup),
        "step = forward + backward + trainer.step + mx.nd.waitall(); fwd_bwd = forward + "
        "backward + waitall, no exchange running; exchange = trainer.step + waitall on "
        "gradients already computed (same job; every step is a real update)",
        "overlap_s = fwd_bwd + exchange - step",
        "speedup_vs_best_peer: the best peer's step seconds (the fastest mode not named "
        "hylo* that ran for the model in this run, named in best_peer) over the mode's",
        "a store with a dense warm-up (hylo's warmup_steps) first runs untimed steps past "
        "it (store_warmup_steps_run): the steady state is measured",
        "stream_step_s: %d back-to-back steps with one wait at the end, per step"
        % args.stream_steps,
        "wire bytes: interface counters (L2 frames incl. headers) over the %d timed "
        "exchanges, per exchange; push = workers' tx, pull = workers' rx" % (2 * args.steps),
        "%d processes share this machine's %s cores" % (1 + S + W, os.cpu_count()),
    ] + ([
        "Horovod modes (%s): %d worker processes, one per worker namespace, with "
        "horovodrun's Gloo environment (ring collectives over the same shaped links), no "
        "servers; Horovod's rendezvous server runs in the scheduler's namespace (used at "
        "hvd.init only); hvd.DistributedTrainer averages, so it is stepped with the "
        "per-worker batch size (the same update as the summing stores with W times it)"
        % (", ".join(m for m in parsed["modes"] if m in HOROVOD_MODES), W)]
        if any(m in HOROVOD_MODES for m in parsed["modes"]) else [])
    report["results"], report["models"] = {}, {}
    failed = False
    _log("model shapes (gluoncv, one forward)...")
    for m in models:
        shapes = shapes_in_subprocess([m], sizes[m])[m]
        report["models"][m] = model_summary(shapes, W, S, parsed["rate_bps"])
        report["models"][m]["image_size"] = sizes[m]
    port = PS_PORT
    for m in models:
        per_mode = report["results"][m] = {}
        for mode in parsed["modes"]:
            if mode in skipped:
                per_mode[mode] = {"status": skipped[mode]}
                continue
            timeout = args.timeout or speed_timeout(report["models"][m], W, args.steps,
                                                    args.warmup, args.stream_steps)
            job_dir = os.path.join(tmp, "%s-%s" % (m, mode))
            os.makedirs(job_dir)
            config = {"task": "speed", "mode": mode, "model": m, "num_workers": W,
                      "num_servers": S, "image_size": sizes[m],
                      "batch_size": args.batch_size, "classes": args.classes,
                      "lr": args.lr, "momentum": args.momentum, "wd": args.wd,
                      "steps": args.steps, "warmup": args.warmup,
                      "stream_steps": args.stream_steps, "seed": args.seed,
                      "hybridize": args.hybridize, "hylo_options": parsed["hylo_options"]}
            _log("%s / %s (time limit %.0f s)..." % (m, mode, timeout))
            t0 = time.monotonic()
            try:
                results, counters, cpu = run_job(
                    topo, job_dir, config, port, timeout, WORKER, args.worker_threads,
                    launcher="horovod" if mode in HOROVOD_MODES else "ps")
                r = per_mode[mode] = summarise_speed(results, counters.get("start"),
                                                     counters.get("end"), args.steps,
                                                     cpu.get("start"), cpu.get("end"))
                r["job_seconds"] = time.monotonic() - t0
                _log("  step %.3f s, fwd+bwd %.3f s, exchange %.3f s, overlap %.3f s "
                     "(job %.0f s)" % (r["step_s"], r["fwd_bwd_s"], r["exchange_s"],
                                       r["overlap_s"], r["job_seconds"]))
            except JobError as err:
                failed = True
                per_mode[mode] = {"status": "failed: %s" % err, "log_tail": err.log_tail}
                _log("  FAILED: %s\n%s" % (err, err.log_tail[-1500:]))
            port += 1
        add_speedups(per_mode)
        add_best_peer(per_mode)
        if "horovod_dense" in per_mode:
            add_speedups(per_mode, "horovod_dense")
    report["table"] = format_speed_table(report)
    return failed


def _run_tta(args, parsed, common, report, topo, tmp, skipped):
    W, S = args.workers, args.servers
    model = parsed["models"][0]
    data = digits_records(args.tta_data, args.tta_size, tmp)
    with open(data["train_idx"]) as f:
        n_train = sum(1 for line in f if line.strip())
    spe = steps_per_epoch(n_train, W, args.tta_batch_size)
    if spe < 1:
        raise SystemExit("mxhylo.bench train: %d training images over %d workers leave "
                         "less than one batch of %d per worker" % (n_train, W,
                                                                  args.tta_batch_size))
    shapes = shapes_in_subprocess([model], args.tta_size)[model]
    # shapes_in_subprocess builds 1000-class heads; a 10-class head is what is trained
    summary = model_summary(shapes, W, S, parsed["rate_bps"])
    report["config"] = dict(common, task="tta", model=model, image_size=args.tta_size,
                            classes=10, batch_size=args.tta_batch_size, lr=args.tta_lr,
                            lr_schedule="cosine to 0 over all steps (optimizer lr_scheduler)", epochs=args.tta_epochs,
                            target=args.target, seeds=args.seeds, train_images=n_train,
                            steps_per_epoch=spe,
                            batch_schedule=parsed["batch_schedule"],
                            batch_lr=args.tta_batch_lr,
                            data="scikit-learn digits as .rec (grey, %dpx), mean 128 std "
                                 "64, no augmentation" % args.tta_size)
    report["notes"] = [
        "time to target: training seconds (the clock stops while rank 0 evaluates) up to "
        "the first per-epoch evaluation at or above the target; wall_s includes "
        "evaluations",
        "final accuracy: rank 0's after the last epoch (BatchNorm running statistics are "
        "each worker's own; trainable parameters must be identical: workers_identical)",
        "modes interleaved within each seed; one parameter-server job per run",
        "time_to_target_speedup_vs_best_peer: against the peer (mode not named hylo*) "
        "with the shortest median time to target, named in best_peer",
        "model summary computed with a 1000-class head (bytes nearly the same)",
    ]
    report["model_summary"] = summary
    runs = {m: [] for m in parsed["modes"]}
    failed = False
    port = PS_PORT
    total_steps = spe * args.tta_epochs
    # each run as it ends, one JSON line: a run stopped early keeps what it measured
    runs_file = (args.json + ".runs.jsonl") if getattr(args, "json", None) else None
    if runs_file and os.path.exists(runs_file):
        os.remove(runs_file)

    def keep(mode, r):
        runs[mode].append(r)
        if runs_file:
            with open(runs_file, "a") as f:
                f.write(json.dumps(dict(r, mode=mode)) + "\n")

    for seed in range(args.seed, args.seed + args.seeds):
        for mode in parsed["modes"]:
            if mode in skipped:
                runs[mode].append({"status": skipped[mode], "seed": seed})
                continue
            timeout = args.timeout or tta_timeout(summary, W, total_steps, args.tta_epochs)
            job_dir = os.path.join(tmp, "tta-%s-%d" % (mode, seed))
            os.makedirs(job_dir)
            config = dict(data, task="tta", mode=mode, model=model, num_workers=W,
                          num_servers=S, image_size=args.tta_size, classes=10,
                          batch_size=args.tta_batch_size, lr=args.tta_lr,
                          momentum=args.momentum, wd=args.wd, epochs=args.tta_epochs,
                          steps_per_epoch=spe, seed=seed, hybridize=args.hybridize,
                          hylo_options=parsed["hylo_options"],
                          batch_schedule=parsed["batch_schedule"],
                          batch_lr=args.tta_batch_lr)
            _log("tta %s seed %d (time limit %.0f s)..." % (mode, seed, timeout))
            t0 = time.monotonic()
            try:
                results, counters, _ = run_job(
                    topo, job_dir, config, port, timeout, WORKER, args.worker_threads,
                    launcher="horovod" if mode in HOROVOD_MODES else "ps")
                r = summarise_tta_run(results, args.target, counters.get("start"),
                                      counters.get("end"))
                r["job_seconds"] = time.monotonic() - t0
                keep(mode, r)
                t = r["time_to_target"]
                _log("  final accuracy %.4f, %s, %.1f s training (job %.0f s)" % (
                    r["final_accuracy"], "target at %.1f s (epoch %d)" % (
                        t["train_s"], t["epochs"]) if t else "target not reached",
                    r["train_s"], r["job_seconds"]))
            except JobError as err:
                failed = True
                keep(mode, {"status": "failed: %s" % err, "seed": seed,
                            "log_tail": err.log_tail})
                _log("  FAILED: %s\n%s" % (err, err.log_tail[-1500:]))
            port += 1
    report["runs"] = runs
    report["summary"] = summarise_tta(runs)
    report["table"] = format_tta_table(report)
    return failed
