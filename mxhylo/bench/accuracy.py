"""``python -m mxhylo.bench accuracy``: does compressed training converge per step like
dense?

For every net, learning rate, seed and mode (mxhylo.bench.modes), one job on this
machine (``python -m mxhylo.launch -n W -s S``, or horovodrun for the Horovod modes)
whose workers each call :func:`mxhylo.digits.train` on their shard of scikit-learn's
digits (1347 training / 450 test images; momentum SGD 0.9, wd 1e-4) and evaluate the
test set every ``--eval-every`` steps. ``--servers 0``: one process over 2 devices
and no job (W = 1; dist_sync is then MXNet's 'device' store, hylo the in-process one).
The default modes: dist_sync, hylo_rule (every layer the policy offers compressed:
the most compression the defaults give, on any network) and hylo_dense_pull.

Learning rate: ``--lr-schedule cosine`` (gluoncv's: a linear ramp over
``--warmup-epochs``, then a cosine to 0 at the budget's last step), one job per budget
(``--short-epochs``, ``--epochs``); ``constant``: one job gives both budgets.

Per cell (net, learning rate, budget), each mode's final test accuracy (mean, sd, per
seed) and the steps it takes to reach 95% of dist_sync's mean final accuracy, with
the ratio to dist_sync's. ``checks`` applies the bar to the first hylo mode given:
within 0.5 point of dist_sync and at most 1.25x its steps, in every cell where
dist_sync reaches that target in every seed (``checks_not_applicable``: the others).
Runs are appended to a runs file as they end; ``--resume`` reuses them.
"""
import os
import time

import numpy as np

from . import jobs, report
from .modes import describe, hylo_options, mode, parse_modes
from .modes import PushThenPull  # noqa: F401  (MXNet's 2-bit under gluon.Trainer)
from ..digits import LR_SCHEDULES

log = report.logger("accuracy")
DEFAULT_MODES = ("dist_sync", "hylo_rule", "hylo_dense_pull")
DEFAULT_NETS = ("digits_net", "conv_net", "resnet20")
IN_PROCESS_DEVICES = 2
TARGET_FRACTION = 0.95          # of dist_sync's mean final accuracy
MAX_GAP_POINTS = 0.5
MAX_STEPS_RATIO = 1.25


def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def add_arguments(parser):
    parser.add_argument("--nets", default=",".join(DEFAULT_NETS),
                        help="of mxhylo.models.NETS (default %(default)s)")
    parser.add_argument("--lrs", default="0.02,0.05,0.1", help="learning rates (%(default)s)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated modes (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (3)")
    parser.add_argument("--epochs", type=int, default=20, help="long budget, epochs (20)")
    parser.add_argument("--short-epochs", type=int, default=6, help="short budget (6)")
    parser.add_argument("--lr-schedule", default="cosine", choices=LR_SCHEDULES,
                        help="cosine: one job per budget; constant: one job for both")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="cosine: epochs of linear warm-up from 0 (1)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between tests (5)")
    parser.add_argument("--workers", type=int, default=4, help="workers per job (4)")
    parser.add_argument("--servers", type=int, default=2,
                        help="servers per job (2); 0: one process over %d devices, no job "
                             "(with --workers 1)" % IN_PROCESS_DEVICES)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (32)")
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON object of mxhylo.create options for every hylo mode")
    parser.add_argument("--timeout", "--job-timeout", dest="timeout", type=float,
                        default=600, help="seconds before a job is stopped (600)")
    parser.add_argument("--runs-file", default=None,
                        help="JSON lines of finished runs (default: beside --json)")
    parser.add_argument("--resume", action="store_true", help="reuse the runs in --runs-file")


def _config(args):
    from ..models import NETS
    cfg = {"nets": [n.strip() for n in args.nets.split(",") if n.strip()],
           "lrs": _floats(args.lrs), "seeds": args.seeds, "epochs": args.epochs,
           "short_epochs": args.short_epochs, "lr_schedule": args.lr_schedule,
           "warmup_epochs": args.warmup_epochs, "eval_every": args.eval_every,
           "workers": args.workers, "servers": args.servers, "batch_size": args.batch_size}
    try:
        cfg["modes"] = parse_modes(args.modes)
        cfg["hylo_options"] = hylo_options(args.hylo_options)
    except ValueError as err:
        raise SystemExit("accuracy: %s" % err)
    if not cfg["nets"] or set(cfg["nets"]) - set(NETS):
        raise SystemExit("accuracy: --nets must be of %s, got %r" % (",".join(NETS), args.nets))
    if not cfg["lrs"] or min(cfg["lrs"]) <= 0:
        raise SystemExit("accuracy: --lrs must be positive numbers, got %r" % args.lrs)
    if min(args.seeds, args.epochs, args.short_epochs, args.workers, args.eval_every,
           args.batch_size) < 1 or args.short_epochs > args.epochs or args.servers < 0 \
            or not 0 <= args.warmup_epochs < args.short_epochs:
        raise SystemExit("accuracy: --seeds, --epochs, --short-epochs (<= --epochs), "
                         "--eval-every, --workers, --batch-size must be >= 1, --servers "
                         ">= 0, --warmup-epochs in [0, --short-epochs)")
    if args.servers == 0:
        bad = [m for m in cfg["modes"] if mode(m).launch != "ps"
               or mode(m).store in ("mxnet_2bit", "horovod")]
        if args.workers != 1 or bad:
            raise SystemExit("accuracy: --servers 0 is one process over %d devices (W = 1): "
                             "it needs --workers 1 and modes with an in-process store%s"
                             % (IN_PROCESS_DEVICES, " (not %s)" % ", ".join(bad) if bad else ""))
    bad = [m for m in cfg["modes"] if mode(m).batch_schedule or mode(m).sync_batchnorm]
    if bad:
        raise SystemExit("accuracy: %s run with bench train --tta only" % ", ".join(bad))
    return cfg


def budgets(cfg):
    """Epochs of the jobs of each (net, lr, mode, seed): one at a constant rate, one per
    budget under a schedule that ends with the budget."""
    if cfg["lr_schedule"] == "constant":
        return [cfg["epochs"]]
    return sorted({cfg["short_epochs"], cfg["epochs"]})


def _run_id(cfg, net, lr, m, seed, epochs):
    if cfg["lr_schedule"] == "constant":
        return "%s/lr%g/%s/seed%d" % (net, lr, m, seed)
    return "%s/lr%g/%s/seed%d/%s%g-e%d" % (net, lr, m, seed, cfg["lr_schedule"],
                                           cfg["warmup_epochs"], epochs)


def run(args):
    cfg = _config(args)
    runs = report.RunLog(args.runs_file or (args.json + ".runs.jsonl" if args.json else None),
                         args.resume)
    start, results = time.time(), []
    with jobs.local_folder() as tmp:
        for net in cfg["nets"]:
            for lr in cfg["lrs"]:
                for seed in range(cfg["seeds"]):
                    for epochs in budgets(cfg):
                        for m in cfg["modes"]:          # interleaved: load drifts
                            rid = _run_id(cfg, net, lr, m, seed, epochs)
                            if rid not in runs.done:
                                runs.add(dict(launch_job(cfg, net, lr, m, seed, epochs, tmp,
                                                         args.timeout), id=rid))
                                log("%-40s final %.4f  %.0f s" % (
                                    rid, runs.done[rid]["accuracy"],
                                    runs.done[rid]["job_seconds"]))
                            results.append(runs.done[rid])
    out = report.new("accuracy", cfg)
    out.update(summarize(cfg, results), study_seconds=time.time() - start,
               modes=describe(cfg["modes"]))
    log("\n" + format_table(out))
    return out


def launch_job(cfg, net, lr, m, seed, epochs, tmp, timeout):
    """One job; rank 0's result with every rank's accuracy and checksum."""
    job_dir = os.path.join(tmp, _run_id(cfg, net, lr, m, seed, epochs).replace("/", "-"))
    os.makedirs(job_dir)
    job = {"task": "digits", "mode": m, "workers": cfg["workers"], "servers": cfg["servers"],
           "net": net, "lr": lr, "seed": seed, "epochs": epochs,
           "hylo_options": cfg["hylo_options"]}
    job.update({k: cfg[k] for k in ("lr_schedule", "warmup_epochs", "eval_every", "batch_size")})
    t0 = time.time()
    try:
        ranks, _, _ = jobs.run_job(job, job_dir, timeout)
    except jobs.JobError as err:
        raise RuntimeError("accuracy: %s failed: %s\n%s" % (
            _run_id(cfg, net, lr, m, seed, epochs), err, err.log_tail[-4000:]))
    return dict(ranks[0], net=net, lr=lr, mode=m, seed=seed, epochs=epochs,
                rank_accuracies=[r["accuracy"] for r in ranks],
                rank_checksums=[r["param_checksum"] for r in ranks],
                job_seconds=time.time() - t0)


# ----------------------------------------------------------------------------- summaries

def accuracy_at(curve, step):
    """Test accuracy of the last evaluation at or before ``step`` of [(step, acc)]."""
    got = [a for s, a in curve if s <= step]
    return got[-1] if got else 0.0


def steps_to_reach(curve, target, last_step):
    return next((s for s, a in curve if s <= last_step and a >= target), None)


def baseline_of(modes):
    return next((m for m in modes if m == "dist_sync"), None)


def summarize_cell(runs, baseline, last_step):
    """One (net, lr, budget) cell: {mode: figures} from the runs of every mode."""
    by_mode = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    finals = {m: [accuracy_at(r["curve"], last_step) for r in rs] for m, rs in by_mode.items()}
    target = TARGET_FRACTION * float(np.mean(finals[baseline])) if baseline in finals else None
    cell = {}
    for m, rs in by_mode.items():
        e = cell[m] = {"final_accuracy": report.spread(finals[m]),
                       "workers_identical": [len(set(r["rank_checksums"])) == 1 for r in rs]}
        if target is not None:
            steps = [steps_to_reach(r["curve"], target, last_step) for r in rs]
            e.update(target_accuracy=target, steps_to_target=steps,
                     mean_steps_to_target=None if None in steps else float(np.mean(steps)))
    if baseline in cell:
        b = cell[baseline]
        for e in cell.values():
            e["gap_points"] = 100.0 * (e["final_accuracy"]["mean"] - b["final_accuracy"]["mean"])
            a, d = e.get("mean_steps_to_target"), b.get("mean_steps_to_target")
            e["steps_ratio"] = None if a is None or not d else a / d
    return cell


def summarize(cfg, results):
    """Per cell 'net lr=.. epochs=..': each mode's final accuracy and steps; the checks."""
    baseline = baseline_of(cfg["modes"])
    checked = next((m for m in cfg["modes"] if not mode(m).peer), None)
    cells, checks, curves, not_applicable = {}, {}, {}, {}

    def job_runs(net, lr, job_epochs):
        return [r for r in results if r["net"] == net and r["lr"] == lr
                and r.get("epochs", cfg["epochs"]) == job_epochs]
    for net in cfg["nets"]:
        for lr in cfg["lrs"]:
            for job_epochs in budgets(cfg):
                runs = job_runs(net, lr, job_epochs)
                if runs:
                    panel = "%s lr=%g" % (net, lr) + (
                        "" if cfg["lr_schedule"] == "constant" else " epochs=%d" % job_epochs)
                    curves[panel] = {m: [r["curve"] for r in runs if r["mode"] == m]
                                     for m in cfg["modes"]}
            for epochs in sorted({cfg["short_epochs"], cfg["epochs"]}):
                runs = job_runs(net, lr, cfg["epochs"] if cfg["lr_schedule"] == "constant"
                                else epochs)
                if not runs:
                    continue
                name = "%s lr=%g epochs=%d" % (net, lr, epochs)
                cell = cells[name] = summarize_cell(runs, baseline,
                                                    epochs * runs[0]["steps_per_epoch"])
                if checked not in cell or baseline not in cell:
                    continue
                missed = [s for s, v in enumerate(cell[baseline]["steps_to_target"]) if v is None]
                if missed:
                    not_applicable[name] = ("%s misses 95%% of its own mean final accuracy in "
                                            "seed(s) %s" % (baseline, missed))
                    continue
                h = cell[checked]
                checks[name] = {
                    "within_%.1f_points" % MAX_GAP_POINTS: h["gap_points"] >= -MAX_GAP_POINTS,
                    "steps_at_most_%.2fx" % MAX_STEPS_RATIO:
                        h["steps_ratio"] is not None and h["steps_ratio"] <= MAX_STEPS_RATIO}
    bytes_, longest = {}, {}
    for r in results:       # per net and mode, from its longest job (the steadiest)
        epochs = r.get("epochs", cfg["epochs"])
        if epochs > longest.get((r["net"], r["mode"]), -1):
            longest[(r["net"], r["mode"])] = epochs
            bytes_.setdefault(r["net"], {})[r["mode"]] = (r["bytes_per_step"],
                                                          r["bytes_pulled_per_step"])
    return {"data": "scikit-learn digits (1347 train / 450 test)", "checked_mode": checked,
            "cells": cells, "checks": checks,
            "checks_passed": sum(all(c.values()) for c in checks.values()),
            "checks_total": len(checks), "checks_not_applicable": not_applicable,
            "curves": curves, "bytes_per_step_pushed_pulled": bytes_,
            "diverged_runs": sorted(r["id"] for r in results
                                    if len(set(r["rank_checksums"])) != 1)}


def format_table(out):
    """Markdown: a row per cell, final accuracy (mean, sd) and steps ratio per mode."""
    modes = out["config"]["modes"]
    lines = ["| cell | " + " | ".join(modes) + " | %s passes |" % out["checked_mode"],
             "|---|" + "---|" * (len(modes) + 1)]
    for name, cell in out["cells"].items():
        row = ["%.1f ± %.1f (%s)" % (100 * cell[m]["final_accuracy"]["mean"],
                                     100 * cell[m]["final_accuracy"]["sd"],
                                     report.x(cell[m].get("steps_ratio")))
               if m in cell else "" for m in modes]
        ok = out["checks"].get(name)
        verdict = ("n/a" if name in out["checks_not_applicable"] else "" if ok is None
                   else "yes" if all(ok.values()) else "no")
        lines.append("| %s | %s | %s |" % (name, " | ".join(row), verdict))
    return "\n".join(lines)


def plot(out, path):
    """Test accuracy against steps per (net, lr), every mode's mean over the seeds."""
    plt = report.pyplot()
    panels, cfg = out["curves"], out["config"]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, by_mode) in zip(axes.flat, panels.items()):
        for m, curves in by_mode.items():
            if curves:
                steps = [s for s, _ in curves[0]]
                acc = np.mean([[a for _, a in c][:len(steps)] for c in curves], axis=0)
                ax.plot(steps, 100 * acc, label=m, linewidth=1.2)
        ax.set(title=name, ylim=(0, 100), xlabel="step", ylabel="test accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    report.save(fig, path, report.caption(out, "digits, %d workers + %d servers, mean of %d "
                                          "seeds, lr %s" % (cfg["workers"], cfg["servers"],
                                                            cfg["seeds"], cfg["lr_schedule"])))


# ----------------------------------------------------------------------------- worker

def dense_bytes(n):
    """Bytes of a float32 gradient of n elements."""
    return 4 * int(n)


def twobit_bytes(n):
    """Bytes MXNet 1.9's 2-bit compression pushes for n float32 elements: 16 codes a
    float32 word (GradientCompression::GetCompressedSize)."""
    return 4 * ((int(n) + 15) // 16)


def peer_bytes(m, sizes, workers):
    """(pushed, pulled) bytes per step of a peer mode: its format's arithmetic."""
    store = mode(m).store
    dense = sum(dense_bytes(n) for n in sizes)
    if store == "mxnet_2bit":
        return float(sum(twobit_bytes(n) for n in sizes)), float(dense)
    if store == "horovod":
        ring = 2.0 * (workers - 1) / workers * dense
        return (ring / 2, ring / 2) if dict(mode(m).options).get("compression") else (ring, ring)
    half = store == "dist_sync_fp16"
    return (dense / 2.0, dense / 2.0) if half else (float(dense), float(dense))


def digits_worker(cfg):
    import mxnet as mx
    from mxhylo import digits
    from .modes import make_store
    one_process = cfg["servers"] == 0 and mode(cfg["mode"]).launch == "ps"
    kv, _ = make_store(cfg["mode"], cfg["hylo_options"], one_process)
    contexts = [mx.cpu(i) for i in range(IN_PROCESS_DEVICES)] if one_process else [mx.cpu(0)]
    result = digits.train(kvstore=kv, contexts=contexts, epochs=cfg["epochs"],
                          batch_size=cfg["batch_size"], lr=cfg["lr"], seed=cfg["seed"],
                          net=cfg["net"], eval_every=cfg["eval_every"],
                          lr_schedule=cfg["lr_schedule"], warmup_epochs=cfg["warmup_epochs"])
    stats = result["stats"]
    if stats and "bytes_pushed" in stats:
        pushed, pulled = (stats["bytes_pushed"] / stats["steps"],
                          stats["bytes_pulled"] / stats["steps"])
    else:
        pushed, pulled = peer_bytes(cfg["mode"], [a.size for a in result["params"].values()],
                                    result["workers"])
    return {"mode": cfg["mode"], "seed": cfg["seed"], "rank": result["rank"],
            "workers": result["workers"], "accuracy": result["accuracy"],
            "history": result["history"], "curve": result["curve"],
            "steps_per_epoch": result["steps_per_epoch"], "seconds": result["seconds"],
            "bytes_per_step": pushed, "bytes_pulled_per_step": pulled,
            "param_checksum": float(sum(np.abs(a.astype(np.float64)).sum()
                                        for a in result["params"].values()))}
