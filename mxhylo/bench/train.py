"""``python -m mxhylo.bench train``: real Gluon training steps per mode, in an emulated
cluster.

The cluster is the single-machine stand-in of ``bench comm`` (mxhylo.bench.netns):
every process in its own network namespace behind a shaped link, all on this
machine's cores. One job per model and mode (mxhylo.bench.modes); only the store
differs between modes. Every store sums the workers' gradients and the Trainer steps
with the global batch.

Speed (the default): every worker trains gluoncv ``--models`` on one fixed synthetic
batch (ResNets at 64 px, whose shapes do not depend on the input; vgg*/alexnet at
224) with gluon.Trainer and momentum SGD: untimed steps until the store is past its
start-up (hylo's dense warm-up, its route trial), --warmup untimed rounds, --steps
timed rounds, then --stream-steps back-to-back steps. A round is two real steps, each
after a barrier of the workers: a full step (forward, backward, trainer.step, wait)
and a split one (forward and backward, wait, barrier, then trainer.step and wait).
Per model and mode, medians over the rounds of the slowest worker's seconds:

* ``step``; ``fwd_bwd`` (nothing else running); ``exchange`` (trainer.step alone);
* ``overlap_s`` = fwd_bwd + exchange - step: how much of the exchange hides behind
  backward; ``stream_step_s``: seconds a step of back-to-back steps;
* ``exchange_cpu``: CPU seconds the exchange costs a step, workers and servers;
* bytes on the wire per exchange (interface counters), hylo's own counts;
* speedups over dist_sync, horovod_dense and the best peer (the fastest mode not of
  the hylo store); whether the workers end with identical parameters.

Time to accuracy (``--tta``): every mode and seed trains ``--tta-model`` on the digits
packed as .rec (mxhylo.io.RecordLoader, each worker its part) with a cosine learning
rate; rank 0 evaluates after every epoch. Per mode and seed: training seconds to the
first evaluation at or above ``--target`` (the clock stops while rank 0 evaluates),
epochs, final accuracy; over the seeds, paired accuracy gaps and the speedups.
"""
import hashlib
import os
import statistics
import time

from . import jobs, netns, report
from .comm import (hylo_summary, job_timeout, model_summary, shapes_in_subprocess,
                   slowest, wire_summary)
from .modes import HEADLINE, MODES, describe, hylo_options, mode, parse_modes

log = report.logger("train")
FULL_SIZE_MODELS = ("vgg", "alexnet")     # their classifier's shape follows the input


def add_arguments(parser):
    netns.add_arguments(parser)
    parser.add_argument("--modes", default=",".join(HEADLINE),
                        help="comma-separated modes (default %(default)s) of: "
                             + ", ".join(MODES))
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON object of mxhylo.create options for every hylo mode")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9)")
    parser.add_argument("--wd", type=float, default=1e-4, help="weight decay (1e-4)")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of each worker (default 1; 0: MXNet's)")
    parser.add_argument("--no-hybridize", dest="hybridize", action="store_false",
                        help="run the models imperatively")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and data (0)")
    g = parser.add_argument_group("speed (default)")
    g.add_argument("--models", default="resnet50_v1b", help="gluoncv models (resnet50_v1b)")
    g.add_argument("--image-size", type=int, default=None,
                   help="input side (default 224 for vgg*/alexnet, else 64)")
    g.add_argument("--batch-size", type=int, default=8, help="images per worker (8)")
    g.add_argument("--classes", type=int, default=1000, help="output classes (1000)")
    g.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (0.01)")
    g.add_argument("--steps", type=int, default=5, help="timed rounds (5)")
    g.add_argument("--warmup", type=int, default=2, help="untimed rounds first (2)")
    g.add_argument("--stream-steps", type=int, default=4,
                   help="back-to-back steps timed together (4; 0: none)")
    g = parser.add_argument_group("time to accuracy (--tta)")
    g.add_argument("--tta", action="store_true", help="time to accuracy on the digits")
    g.add_argument("--tta-model", default="resnet18_v1b", help="gluoncv model, 10 classes")
    g.add_argument("--tta-size", type=int, default=16, help="image side in pixels (16)")
    g.add_argument("--tta-batch-size", type=int, default=32, help="per worker (32)")
    g.add_argument("--tta-lr", type=float, default=0.03, help="peak lr, cosine to 0 (0.03)")
    g.add_argument("--tta-epochs", type=int, default=15, help="epochs per run (15)")
    g.add_argument("--tta-batch-schedule", default="5,10", metavar="E1,E2,...",
                   help="the *_dynamic modes: micro-batches per update doubled at these "
                        "epochs (5,10)")
    g.add_argument("--tta-batch-lr", choices=("linear", "none"), default="linear",
                   help="the *_dynamic modes: lr times the micro-batches (linear) or not")
    g.add_argument("--target", type=float, default=0.95, help="target accuracy (0.95)")
    g.add_argument("--seeds", type=int, default=3, help="seeds per mode (3)")
    g.add_argument("--tta-data", default=None,
                   help="folder with digits_{train,val}.{rec,idx} (default: written to a "
                        "temporary folder)")


def image_size_for(model, image_size=None):
    full = model.lower().startswith(FULL_SIZE_MODELS)
    if image_size is None:
        return 224 if full else 64
    if full and image_size != 224:
        raise ValueError("%s needs --image-size 224 (its classifier's shape follows the "
                         "input), got %d" % (model, image_size))
    if image_size < 16:
        raise ValueError("--image-size must be at least 16, got %d" % image_size)
    return image_size


def check_args(args):
    """The parsed options (modes, models, image sizes, hylo options, batch schedule), or
    ValueError saying what is wrong."""
    rates = [r for r in args.rate.split(",") if r.strip()]
    for rate in rates:
        netns.topology(args, rate)
    out = {"modes": parse_modes(args.modes), "hylo_options": hylo_options(args.hylo_options)}
    if args.tta:
        if len(rates) > 1:
            raise ValueError("--tta runs at one --rate, got %s" % args.rate)
        if not 0.0 < args.target <= 1.0:
            raise ValueError("--target is an accuracy in (0, 1], got %g" % args.target)
        if min(args.seeds, args.tta_epochs, args.tta_batch_size) < 1 or args.tta_size < 8:
            raise ValueError("--seeds, --tta-epochs and --tta-batch-size must be >= 1, "
                             "--tta-size >= 8")
        out["batch_schedule"] = [float(e) for e in args.tta_batch_schedule.split(",") if e]
        out["models"] = [args.tta_model]
        return out
    if args.steps < 1 or args.warmup < 0 or args.stream_steps < 0:
        raise ValueError("--steps must be >= 1, --warmup and --stream-steps >= 0")
    if [m for m in out["modes"] if mode(m).batch_schedule]:
        raise ValueError("the *_dynamic modes run with --tta only")
    out["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    out["image_sizes"] = {m: image_size_for(m, args.image_size) for m in out["models"]}
    return out


# ----------------------------------------------------------------------------- summaries

def exchange_cpu(results, cpu_before, cpu_after, exchanges):
    """CPU seconds the exchange costs a step: per worker the median full step's minus
    the median forward and backward's, summed; the servers' over the timed window
    per exchange, summed (0 with no servers)."""
    per_worker = [statistics.median(x["full"]["cpu_s"] for x in r["rounds"])
                  - statistics.median(x["split"]["fwd_bwd_cpu_s"] for x in r["rounds"])
                  for r in results]
    servers = sum(cpu_after[n] - cpu_before[n] for n in cpu_before
                  if n.startswith("server") and n in cpu_after) / exchanges \
        if cpu_before and cpu_after else 0.0
    return {"workers_s": sum(per_worker), "servers_s": servers,
            "total_s": sum(per_worker) + servers, "per_worker_s": per_worker}


def checksums(results):
    """Whether the workers' trainable parameters are bitwise identical; peak memory."""
    shas = [r["param_sha256"] for r in results]
    return {"workers_identical": len(set(shas)) == 1, "param_sha256": shas,
            "worker_peak_rss_bytes": max(r["peak_rss_bytes"] for r in results)}


def summarise_speed(results, counters, cpu, steps):
    """One mode's record from its workers' results and the harness's readings around
    the ``steps`` timed rounds (2 * steps exchanges)."""
    res = {"status": "ok"}
    for key, get in (("step", lambda x: x["full"]["seconds"]),
                     ("fwd_bwd", lambda x: x["split"]["fwd_bwd_s"]),
                     ("exchange", lambda x: x["split"]["exchange_s"])):
        res[key] = report.spread(slowest(results, get, "rounds"))
        res[key + "_s"] = res[key]["median"]
    res["overlap_s"] = res["fwd_bwd_s"] + res["exchange_s"] - res["step_s"]
    if all(r["stream"] for r in results):
        res["stream_step_s"] = max(r["stream"]["seconds"] / r["stream"]["steps"]
                                   for r in results)
    res["warmup_step_s"] = slowest(results, lambda x: x["full"]["seconds"], "warmup") \
        if results[0]["warmup"] else []
    for key in ("setup_s", "store_s", "first_step_s", "startup_steps"):
        res[key] = max(r[key] for r in results)
    res["plan"], res["update_on_kvstore"] = results[0]["plan"], results[0]["update_on_kvstore"]
    if counters.get("start") and counters.get("end"):
        res["wire"] = wire_summary(counters["start"], counters["end"], 2 * steps)
    res["exchange_cpu"] = exchange_cpu(results, cpu.get("start"), cpu.get("end"), 2 * steps)
    if results[0]["stats"] is not None:
        res["hylo"] = hylo_summary(results, 2 * steps)
    res.update(checksums(results))
    return res


def time_to_target(history, target):
    """The first evaluation at or above ``target``, or None."""
    return next(({"train_s": h["train_s"], "wall_s": h["wall_s"], "epochs": h["epoch"],
                  "steps": h["steps"], "accuracy": h["accuracy"]}
                 for h in history if h.get("accuracy", -1) >= target), None)


def summarise_tta_run(results, target, counters=None):
    r0 = results[0]
    history = r0["history"]
    res = {"status": "ok", "seed": r0["seed"], "history": history,
           "time_to_target": time_to_target(history, target),
           "final_accuracy": history[-1]["accuracy"], "train_s": history[-1]["train_s"],
           "wall_s": history[-1]["wall_s"], "steps_per_epoch": r0["steps_per_epoch"],
           "updates_per_epoch": [h["updates"] - (history[i - 1]["updates"] if i else 0)
                                 for i, h in enumerate(history)],
           "update_on_kvstore": r0["update_on_kvstore"], "hylo": r0["stats"]}
    if counters and counters.get("start") and counters.get("end"):
        res["wire"] = wire_summary(counters["start"], counters["end"], history[-1]["steps"])
    res.update(checksums(results))
    return res


def summarise_tta(runs, baseline="dist_sync"):
    """Per mode over its seeds: time to target, epochs, final accuracy, exchanges; the
    final accuracy's gap to the baseline's, seed by seed (and of a *_dynamic mode to
    its fixed twin); speedups to the target over the baseline and the best peer."""
    out = {}
    finals = {m: {r["seed"]: r["final_accuracy"] for r in rs if r["status"] == "ok"}
              for m, rs in runs.items()}
    for m, rs in runs.items():
        ok = [r for r in rs if r["status"] == "ok"]
        hit = [r["time_to_target"] for r in ok if r["time_to_target"]]
        s = out[m] = {"runs": len(rs), "ok": len(ok), "reached": len(hit),
                      "time_to_target_s": report.spread([t["train_s"] for t in hit]),
                      "epochs_to_target": report.spread([t["epochs"] for t in hit]),
                      "final_accuracy": report.spread([r["final_accuracy"] for r in ok]),
                      "train_s": report.spread([r["train_s"] for r in ok]),
                      "updates": statistics.mean([sum(r["updates_per_epoch"]) for r in ok])
                      if ok else None,
                      "workers_identical_all": all(r["workers_identical"] for r in ok)}
        if s["time_to_target_s"]:
            s["time_to_target_median_s"] = s["time_to_target_s"]["median"]
        twin = m[:-len("_dynamic")] if m.endswith("_dynamic") else None
        for key, other in (("paired_gap_points", baseline), ("paired_gap_vs_fixed_points", twin)):
            gaps = [100 * (a - finals[other][seed]) for seed, a in sorted(finals[m].items())
                    if other in finals and other != m and seed in finals[other]]
            if gaps:
                s[key] = dict(report.spread(gaps), vs=other, worst=min(gaps))
    report.compare(out, "time_to_target_median_s", (baseline,), prefix="time_to_target_")
    for m, s in out.items():
        twin = out.get(m[:-len("_dynamic")]) if m.endswith("_dynamic") else None
        if twin and twin.get("time_to_target_median_s") and s.get("time_to_target_median_s"):
            s["time_to_target_speedup_vs_fixed"] = (twin["time_to_target_median_s"]
                                                    / s["time_to_target_median_s"])
    return out


# ----------------------------------------------------------------------------- run

def run(args):
    """One record per rate of --rate; with several rates, a sweep record of them."""
    try:
        parsed = check_args(args)
    except ValueError as err:
        raise SystemExit("mxhylo.bench train: %s" % err)
    return jobs.over_rates("train", args, lambda a: run_rate(a, parsed), log)


def run_rate(args, parsed):
    W, S = args.workers, args.servers
    config = dict(report.options(args), task="tta" if args.tta else "speed", **parsed)
    out = report.new("train", config, notes=[
        "an emulated cluster: %d processes in network namespaces on one machine's %d "
        "cores, links shaped with tc" % (1 + S + W, os.cpu_count())])
    out["modes"] = describe(parsed["modes"])
    with jobs.Run(netns.topology(args, args.rate, "train"), args.keep_tmp, log) as run_:
        (run_tta if args.tta else run_speed)(args, parsed, out, run_)
    out["table"] = (tta_table if args.tta else speed_table)(out)
    for line in out["table"]:
        log(line)
    return out


def run_speed(args, parsed, out, run_):
    W, S = args.workers, args.servers
    out["models"], out["results"] = {}, {}
    port = jobs.PS_PORT
    for model in parsed["models"]:
        size = parsed["image_sizes"][model]
        summary = out["models"][model] = dict(model_summary(
            shapes_in_subprocess([model], size)[model], W, S, netns.parse_rate(args.rate)),
            image_size=size)
        per_mode = out["results"][model] = {}
        for m in parsed["modes"]:
            per_mode[m] = jobs.unavailable(m)
            if per_mode[m]:
                continue
            timeout = args.timeout or job_timeout(summary, W, 2 * (args.steps + args.warmup)
                                                  + args.stream_steps, 10.0, 240.0)
            cfg = {"task": "speed", "mode": m, "model": model, "workers": W, "servers": S,
                   "image_size": size, "batch_size": args.batch_size,
                   "classes": args.classes, "lr": args.lr, "momentum": args.momentum,
                   "wd": args.wd, "steps": args.steps, "warmup": args.warmup,
                   "stream_steps": args.stream_steps, "seed": args.seed,
                   "hybridize": args.hybridize, "hylo_options": parsed["hylo_options"]}
            t0 = time.monotonic()
            got, per_mode[m] = run_.job(cfg, "%s-%s" % (model, m), timeout, port,
                                        args.worker_threads)
            port += 1
            if not got:
                continue
            r = per_mode[m] = summarise_speed(*got, args.steps)
            r["job_seconds"] = time.monotonic() - t0
            log("  step %.3f s, fwd+bwd %.3f s, exchange %.3f s, overlap %.3f s" % (
                r["step_s"], r["fwd_bwd_s"], r["exchange_s"], r["overlap_s"]))
        report.compare(per_mode, "step_s", ("dist_sync", "horovod_dense"))
        report.compare(per_mode, "stream_step_s", ("dist_sync",), prefix="stream_")


def steps_per_epoch(num_records, workers, batch_size):
    """Steps every worker can take per epoch: its smallest part in whole batches."""
    from mxhylo.io.recfile import part_range
    return min(b - a for a, b in (part_range(num_records, workers, p)
                                  for p in range(workers))) // batch_size


def digits_records(folder, size, tmp):
    """{'train_rec', 'train_idx', 'val_rec', 'val_idx'} of the digits at ``size``."""
    if folder is None:
        from mxhylo.io.digits_sample import write_digits
        folder = os.path.join(tmp, "digits%d" % size)
        write_digits(folder, size=size, progress=False)
    out = {"%s_%s" % (part, ext): os.path.join(folder, "digits_%s.%s" % (part, ext))
           for part in ("train", "val") for ext in ("rec", "idx")}
    missing = [p for p in out.values() if not os.path.isfile(p)]
    if missing:
        raise SystemExit("mxhylo.bench train: %s missing (python -m mxhylo.im2rec --digits "
                         "%s --size %d makes them)" % (", ".join(missing), folder, size))
    return out


def run_tta(args, parsed, out, run_):
    W, S, model = args.workers, args.servers, parsed["models"][0]
    data = digits_records(args.tta_data, args.tta_size, run_.tmp)
    with open(data["train_idx"]) as f:
        n_train = sum(1 for line in f if line.strip())
    spe = steps_per_epoch(n_train, W, args.tta_batch_size)
    if spe < 1:
        raise SystemExit("mxhylo.bench train: %d images over %d workers leave less than "
                         "one batch of %d each" % (n_train, W, args.tta_batch_size))
    summary = model_summary(shapes_in_subprocess([model], args.tta_size)[model], W, S,
                            netns.parse_rate(args.rate))
    out["config"].update(train_images=n_train, steps_per_epoch=spe)
    out["model_summary"] = summary
    runs = out["runs"] = {m: [] for m in parsed["modes"]}
    log_file = report.RunLog(args.json + ".runs.jsonl" if args.json else None)
    port = jobs.PS_PORT
    for seed in range(args.seed, args.seed + args.seeds):
        for m in parsed["modes"]:           # interleaved: a drift in load hits all alike
            r = jobs.unavailable(m)
            if r is None:
                timeout = args.timeout or job_timeout(summary, W, spe * args.tta_epochs, 2.0,
                                                      240.0 + 20.0 * args.tta_epochs)
                cfg = dict(data, task="tta", mode=m, model=model, workers=W, servers=S,
                           image_size=args.tta_size, classes=10,
                           batch_size=args.tta_batch_size, lr=args.tta_lr,
                           momentum=args.momentum, wd=args.wd, epochs=args.tta_epochs,
                           steps_per_epoch=spe, seed=seed, hybridize=args.hybridize,
                           hylo_options=parsed["hylo_options"],
                           batch_schedule=parsed["batch_schedule"], batch_lr=args.tta_batch_lr)
                got, r = run_.job(cfg, "tta-%s-%d" % (m, seed), timeout, port,
                                  args.worker_threads)
                port += 1
                if got:
                    r = summarise_tta_run(got[0], args.target, got[1])
                    t = r["time_to_target"]
                    log("  final accuracy %.4f, %s" % (r["final_accuracy"], "target at "
                        "%.1f s (epoch %d)" % (t["train_s"], t["epochs"]) if t
                        else "target not reached"))
            r = dict(r, seed=seed)
            runs[m].append(r)
            log_file.add(dict(r, id="%s/%d" % (m, seed), mode=m))
    out["summary"] = summarise_tta(runs)


# ----------------------------------------------------------------------------- tables

def speed_table(out):
    lines = ["%-13s %-15s %14s %7s %7s %7s %10s %8s %8s %7s %9s %9s %4s" % (
        "model", "mode", "step s (range)", "fwd+bwd", "exch", "overlap", "CPU s w+s",
        "vs dsync", "vs peer", "stream", "push MB/x", "pull MB/x", "same")]
    for model, per_mode in out["results"].items():
        for m, r in per_mode.items():
            if r.get("status") != "ok":
                lines.append("%-13s %-15s %s" % (model, m, r.get("status")))
                continue
            wire, cpu = r.get("wire", {}), r["exchange_cpu"]
            lines.append("%-13s %-15s %5.3f %-8s %7.3f %7.3f %7.3f %10s %8s %8s %7s %9s %9s "
                         "%4s" % (
                             model, m, r["step_s"], "(%.2f-%.2f)" % (r["step"]["min"],
                                                                     r["step"]["max"]),
                             r["fwd_bwd_s"], r["exchange_s"], r["overlap_s"],
                             "%.2f+%.2f" % (cpu["workers_s"], cpu["servers_s"]),
                             report.x(r.get("speedup_vs_dist_sync")),
                             report.x(r.get("speedup_vs_best_peer")),
                             "%.3f" % r["stream_step_s"] if r.get("stream_step_s") else "-",
                             report.mb(wire.get("push_bytes_per_step")),
                             report.mb(wire.get("pull_bytes_per_step")),
                             "yes" if r["workers_identical"] else "NO"))
        peer = next((r["best_peer"] for r in per_mode.values() if r.get("best_peer")), None)
        lines.append("%-13s best peer: %s" % (model, peer))
    return lines


def tta_table(out):
    lines = ["%-17s %4s %8s %6s %9s %8s %4s" % ("mode", "seed", "target s", "epochs",
                                                  "final acc", "train s", "same")]
    for m, rs in out["runs"].items():
        for r in rs:
            if r["status"] != "ok":
                lines.append("%-17s %4s %s" % (m, r["seed"], r["status"]))
                continue
            t = r["time_to_target"]
            lines.append("%-17s %4d %8s %6s %9.4f %8.1f %4s" % (
                m, r["seed"], "%.1f" % t["train_s"] if t else "not hit",
                t["epochs"] if t else "-", r["final_accuracy"], r["train_s"],
                "yes" if r["workers_identical"] else "NO"))
    for m, s in out["summary"].items():
        fa, gap = s["final_accuracy"], s.get("paired_gap_points")
        lines.append("%-17s reached %d/%d, to target %s s (%s vs dist_sync, %s vs the best "
                     "peer), final %s%s" % (
                         m, s["reached"], s["runs"], "%.1f" % s["time_to_target_median_s"]
                         if s.get("time_to_target_median_s") else "-",
                         report.x(s.get("time_to_target_speedup_vs_dist_sync")),
                         report.x(s.get("time_to_target_speedup_vs_best_peer")),
                         "%.4f +- %.4f" % (fa["mean"], fa["sd"]) if fa else "-",
                         ", paired %+.2f points vs %s (worst %+.2f)" % (
                             gap["mean"], gap["vs"], gap["worst"]) if gap else ""))
    return lines


# ----------------------------------------------------------------------------- plots

def plot(out, path):
    if out["suite"].endswith("_sweep"):
        return report.plot_sweep(out, path)
    return (plot_tta if out["config"]["task"] == "tta" else plot_speed)(out, path)


def plot_speed(out, path):
    plt = report.pyplot()
    models, cfg = list(out["results"]), out["config"]
    fig, axes = plt.subplots(1, len(models), figsize=(max(7.5, 4.8 * len(models) + 1), 5),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        per_mode = out["results"][model]
        modes = list(per_mode)
        for j, (key, label) in enumerate((("step", "step"), ("fwd_bwd", "fwd+bwd alone"),
                                          ("exchange", "exchange alone"))):
            ok = [(i, per_mode[m][key]) for i, m in enumerate(modes)
                  if per_mode[m].get("status") == "ok"]
            ax.bar([i + (j - 1) * 0.26 for i, _ in ok], [s["median"] for _, s in ok], 0.26,
                   yerr=[[s["median"] - s["min"] for _, s in ok],
                         [s["max"] - s["median"] for _, s in ok]], capsize=2, label=label)
        for i, m in enumerate(modes):
            r = per_mode[m]
            if r.get("status") != "ok":
                ax.text(i, 0, r["status"].split(":")[0], ha="center", fontsize=8, color="r")
            elif r.get("speedup_vs_dist_sync"):
                text = report.x(r["speedup_vs_dist_sync"])
                if not mode(m).peer and r.get("speedup_vs_best_peer"):
                    text += "\n%s peer" % report.x(r["speedup_vs_best_peer"])
                ax.annotate(text, (i - 0.26, r["step_s"]), ha="center", va="bottom",
                            fontsize=8)
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes, fontsize=8, rotation=20)
        ax.set_title("%s, %d px, batch %d a worker" % (model, cfg["image_sizes"][model],
                                                       cfg["batch_size"]), fontsize=9)
        ax.set_ylabel("seconds (median of the slowest worker; bars: min-max)")
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    report.save(fig, path, report.caption(out, "train: %d workers, %d servers, %s links "
                                          "(emulated on one machine); labels: x dist_sync, "
                                          "x the best peer" % (cfg["workers"], cfg["servers"],
                                                               cfg["rate"])))


def plot_tta(out, path):
    """Accuracy against training seconds, every mode and seed; with a *_dynamic mode,
    a panel below of the batch each update took (the momentum stays --momentum)."""
    plt = report.pyplot()
    cfg = out["config"]
    dynamic = any(mode(m).batch_schedule for m in out["runs"])
    if dynamic:
        fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                     gridspec_kw={"height_ratios": (3, 1)})
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (m, rs) in enumerate(out["runs"].items()):
        for k, r in enumerate(x for x in rs if x["status"] == "ok"):
            seconds = [h["train_s"] for h in r["history"]]
            ax.plot(seconds, [h["accuracy"] for h in r["history"]],
                    ("-", "--", ":", "-.")[k % 4], marker=".", color=colors[j % len(colors)],
                    label="%s seed %d" % (m, r["seed"]))
            if dynamic and k == 0:
                bx.stairs(update_batches(m, r, cfg), [0.0] + seconds, color=colors[j % len(colors)],
                          label=m, baseline=None)
    ax.axhline(cfg["target"], color="k", lw=0.8, ls="--")
    ax.set(ylim=(max(0, cfg["target"] - 0.35), 1), ylabel="validation accuracy (rank 0)")
    ax.legend(fontsize=7, ncol=2)
    last = bx if dynamic else ax
    last.set(xlabel="training seconds (evaluation excluded)")
    if dynamic:
        bx.set(ylabel="samples per update\n(momentum %g)" % cfg["momentum"], yscale="log",
               title="first seed of each mode, epoch by epoch")
        bx.set_yscale("log", base=2)
        bx.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        bx.title.set_fontsize(8)
        bx.legend(fontsize=7)
    report.save(fig, path, report.caption(out, "time to accuracy: %s %d px on the digits, "
                                          "%d workers, %d servers, %s (emulated)" % (
                                              cfg["tta_model"], cfg["tta_size"], cfg["workers"],
                                              cfg["servers"], cfg["rate"])))


def update_batches(name, run, cfg):
    """Samples per update in each epoch of mode ``name``'s tta run: --tta-batch-size *
    workers * k, k doubled at each --tta-batch-schedule epoch (*_dynamic), else 1."""
    growth = cfg["batch_schedule"] if mode(name).batch_schedule else []
    return [cfg["tta_batch_size"] * cfg["workers"] * 2 ** sum(1 for g in growth if e >= g)
            for e in range(len(run["history"]))]


# ----------------------------------------------------------------------------- worker

CHECKSUM_PIECE = 1 << 22      # elements read to the host at a time


def param_checksum(net):
    """SHA-256 of the trainable parameters in name order (BatchNorm's running
    statistics are each worker's own), read in pieces (vgg16 whole took 2.5 GB)."""
    digest = hashlib.sha256()
    params = net.collect_params()
    for name in sorted(params.keys()):
        if params[name].grad_req == "null":
            continue
        flat = params[name].data().reshape((-1,))
        digest.update(name.encode())
        for lo in range(0, flat.size, CHECKSUM_PIECE):
            digest.update(flat[lo:lo + CHECKSUM_PIECE].asnumpy().tobytes())
    return digest.hexdigest()


def build_net(cfg):
    import warnings
    import mxnet as mx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gluoncv
    mx.random.seed(cfg["seed"])
    net = gluoncv.model_zoo.get_model(cfg["model"], pretrained=False, classes=cfg["classes"])
    net.initialize(mx.init.Xavier(magnitude=2))
    if cfg.get("hybridize", True):
        net.hybridize(static_alloc=True, static_shape=True)
    return net


def make_trainer(cfg, net, lr_scheduler=None):
    """(store, gluon.Trainer with momentum SGD) of the mode. A schedule is the
    optimizer's lr_scheduler: dist_sync's servers run their own copy of the optimizer,
    which Trainer.set_learning_rate would not reach."""
    import mxnet as mx
    from .modes import make_store
    sgd = {"momentum": cfg["momentum"], "wd": cfg["wd"]}
    sgd.update({"lr_scheduler": lr_scheduler} if lr_scheduler else {"learning_rate": cfg["lr"]})
    kv, update_on_kvstore = make_store(cfg["mode"], cfg["hylo_options"])
    return kv, mx.gluon.Trainer(net.collect_params(), "sgd", sgd, kvstore=kv,
                                update_on_kvstore=update_on_kvstore)


def _done(cfg, kv, trainer, net, **fields):
    import resource
    from .worker import stats
    return dict(fields, rank=int(kv.rank), mode=cfg["mode"],
                update_on_kvstore=bool(trainer._update_on_kvstore), stats=stats(kv),
                param_sha256=param_checksum(net),
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def sync_batchnorm_if_asked(cfg, kv, net):
    """The *_syncbn modes: BatchNorm over every worker's batch (mxhylo.sync_batchnorm),
    in the graph traced again at the next forward."""
    if mode(cfg["mode"]).sync_batchnorm:
        from mxhylo import sync_batchnorm
        sync_batchnorm.install(sync_batchnorm.join(kv))
        net._clear_cached_op()


def speed_worker(cfg):
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon
    from .worker import MAX_STARTUP_STEPS, FileSync, stats, steady
    t_begin = time.perf_counter()
    B, S, C = cfg["batch_size"], cfg["image_size"], cfg["classes"]
    net = build_net(cfg)
    # deferred initialisation in training mode: an inference forward would leave the
    # weights in oneDNN's own layout, which Horovod's operators cannot read
    with autograd.train_mode():
        net(mx.nd.zeros((B, 3, S, S)))
    mx.nd.waitall()
    t_store = time.perf_counter()
    kv, trainer = make_trainer(cfg, net)
    sync_batchnorm_if_asked(cfg, kv, net)
    store_s = time.perf_counter() - t_store
    rank, W = int(kv.rank), int(kv.num_workers)
    rng = np.random.RandomState(cfg["seed"] * 1000 + rank)
    data = mx.nd.array(rng.uniform(-1, 1, size=(B, 3, S, S)))
    label = mx.nd.array(rng.randint(0, C, size=(B,)))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    sync = FileSync(cfg, rank)
    setup_s = time.perf_counter() - t_begin

    def fwd_bwd():
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()

    def full_step():        # CPU: every thread of this process, read after the wait
        sync.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fwd_bwd()
        trainer.step(B * W)
        mx.nd.waitall()
        return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}

    def split_step():
        sync.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fwd_bwd()
        mx.nd.waitall()
        t1, c1 = time.perf_counter(), time.process_time()
        sync.barrier()
        t2 = time.perf_counter()
        trainer.step(B * W)
        mx.nd.waitall()
        return {"fwd_bwd_s": t1 - t0, "fwd_bwd_cpu_s": c1 - c0,
                "exchange_s": time.perf_counter() - t2}

    first = full_step()         # the Trainer's first step: broadcast, plan
    startup = 1
    while not steady(kv) and startup < MAX_STARTUP_STEPS:
        full_step()
        startup += 1
    warm = [{"full": full_step(), "split": split_step()} for _ in range(cfg["warmup"])]
    before = stats(kv)
    sync.mark("start")
    rounds = [{"full": full_step(), "split": split_step()} for _ in range(cfg["steps"])]
    sync.mark("end")
    stream = None
    if cfg["stream_steps"] > 0:
        sync.barrier("-stream")
        t0 = time.perf_counter()
        for _ in range(cfg["stream_steps"]):
            fwd_bwd()
            trainer.step(B * W)
        mx.nd.waitall()
        stream = {"steps": cfg["stream_steps"], "seconds": time.perf_counter() - t0}
    out = _done(cfg, kv, trainer, net, setup_s=setup_s, store_s=store_s,
                first_step_s=first["seconds"], startup_steps=startup, warmup=warm,
                rounds=rounds, stream=stream, stats_before=before,
                plan=kv.plan().as_dict() if hasattr(kv, "plan") else None)
    sync.barrier("-done")
    return out


def evaluate(net, loader):
    correct = seen = 0
    for data, label in loader:
        pred = net(data[0]).argmax(axis=1).asnumpy()
        y = label[0].asnumpy().reshape(-1)[:len(pred)]
        correct, seen = correct + int((pred == y).sum()), seen + len(y)
    return correct / float(max(seen, 1))


def tta_worker(cfg):
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxhylo.io import RecordLoader
    from .worker import FileSync
    B, S = cfg["batch_size"], cfg["image_size"]
    net = build_net(cfg)
    net(mx.nd.zeros((1, 1, S, S)))
    spe = int(cfg["steps_per_epoch"])
    schedule = mx.lr_scheduler.CosineScheduler(max_update=spe * cfg["epochs"],
                                               base_lr=cfg["lr"], final_lr=0.0)
    kv, trainer = make_trainer(cfg, net, lr_scheduler=schedule)
    sync_batchnorm_if_asked(cfg, kv, net)
    rank, W = int(kv.rank), int(kv.num_workers)
    if mode(cfg["mode"]).batch_schedule:
        from mxhylo import schedules
        schedules.attach(trainer, iters_per_epoch=spe,
                         batch=schedules.StepBatch(cfg["batch_schedule"]),
                         lr_scaling=None if cfg["batch_lr"] == "none" else "linear")
    norm = {"mean": 128.0, "std": 64.0}
    train = RecordLoader(cfg["train_rec"], cfg["train_idx"], B, (1, S, S), shuffle=True,
                         seed=cfg["seed"] * 1000 + rank, num_parts=W, part_index=rank,
                         last_batch="drop", preprocess_threads=1, **norm)
    val = RecordLoader(cfg["val_rec"], cfg["val_idx"], 256, (1, S, S), num_parts=1,
                       part_index=0, last_batch="keep", preprocess_threads=1, prefetch=0,
                       **norm) if rank == 0 else None
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    sync = FileSync(cfg, rank)
    history, train_s, step = [], 0.0, 0
    sync.mark("start")
    wall0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        sync.barrier()
        t0 = time.perf_counter()
        for i, (data, label) in enumerate(train):
            if i == spe:
                break
            with autograd.record():
                loss = loss_fn(net(data[0]), label[0])
            loss.backward()
            trainer.step(B * W)
            step += 1
        mx.nd.waitall()
        train_s += time.perf_counter() - t0
        entry = {"epoch": epoch + 1, "steps": step, "train_s": train_s,
                 "updates": trainer.schedules.updates if getattr(trainer, "schedules", None)
                 else step, "wall_s": time.perf_counter() - wall0}
        if val is not None:
            entry["accuracy"] = evaluate(net, val)
        history.append(entry)
    sync.mark("end")
    train.close()
    out = _done(cfg, kv, trainer, net, seed=cfg["seed"], history=history,
                steps_per_epoch=spe)
    if out["stats"]:
        out["stats"].pop("layers", None)
    sync.barrier("-done")
    return out
