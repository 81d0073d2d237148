"""Accuracy study: does compressed training converge per step like dense?

``python -m mxhylo.bench accuracy [--nets digits_net,conv_net,resnet20 --lrs 0.02,0.05,0.1
--epochs 20 --short-epochs 6 --lr-schedule cosine --warmup-epochs 1
--modes dense,hylo,hylo_densepull --seeds 3 --workers 4 --servers 2] --json F``

For every net, learning rate, seed and mode, one parameter-server job (``python -m
mxhylo.launch -n W -s S``) whose workers each call :func:`mxhylo.digits.train` (momentum
SGD 0.9, wd 1e-4, per-worker batch, each worker on its shard of
scikit-learn's digits: 1347 training / 450 test images) and record test accuracy every
``--eval-every`` steps. Only the kvstore differs between modes:

- ``dense``: MXNet's ``dist_sync``, float32 gradients (Gluon's pushpull).
- ``2bit``: ``dist_sync`` with MXNet's 2-bit compression (threshold ``--threshold``),
  adapted by :class:`PushThenPull` (Gluon's pushpull aborts with compression in 1.9).
- ``hylo``: ``mxhylo.create('dist_sync_hylo', cost_model=False)``, every other default
  (compress_pull 'gather', momentum correction): what a user gets where the cost model
  keeps every offered layer compressed (a slow network; the worst case for accuracy).
- ``hylo_densepull``: compress_pull=False (the dense pull of Hylo as published).
- ``hylo_nomc``: the default without momentum correction (plain error feedback).

Learning rate: by default as gluoncv's training scripts schedule it (``--lr-mode cosine``
with a warm-up): a linear ramp over ``--warmup-epochs``, then a cosine to 0 at the
budget's last step, so each budget (``--short-epochs``, ``--epochs``) is its own job and
its final accuracy is that of a model trained to the end of its schedule. With
``--lr-schedule constant`` a run of ``--short-epochs`` is exactly the first part of the
``--epochs`` run and both budgets come from one job (the study's first protocol: at a
constant rate the last evaluation of a short budget lands wherever the noise of the
rate leaves it). Per cell (net,
learning rate, budget) the report gives each mode's final test accuracy (mean, sd,
per seed), and the steps it needs to reach 95% of dense's mean final accuracy
(per seed, from the curve; the cell's figure is the mean over seeds, None if a seed
never gets there), with the ratio to dense's. ``checks`` applies the bar of the
default store: within 0.5 point of dense and at most 1.25x dense's steps, in every cell
where dense itself reaches that target in every seed (``checks_not_applicable`` lists
the others, where dense diverged: they measure divergence, and the steps ratio is
undefined).

Results are appended run by run to ``--runs-file`` (JSON lines) and runs already there
are not run again: a long study survives an interruption (``--resume``).

Nets (mxhylo.models.NETS): ``digits_net`` (8x8, FC-dominated), ``conv_net`` (16x16,
three 3x3 convs and two dense layers, conv_topk and fc_2bit), ``resnet20`` (gluoncv's
cifar_resnet20_v1 at 16x16: residual, BatchNorm, conv_topk only).

Each worker also reports a checksum of its trainable parameters, which synchronous
workers must share; ``diverged_runs`` lists runs where they did not (seen now and then
with MXNet's own dist_sync, never with hylo).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .. import procs
from ..digits import LR_SCHEDULES
from .comm import parse_hylo_options
from .native_store import WorkerUpdateStore

MODES = ("dense", "2bit", "hylo", "hylo_densepull", "hylo_nomc")
DEFAULT_MODES = ("dense", "hylo", "hylo_densepull")
COLORS = {"dense": "tab:blue", "2bit": "tab:orange", "hylo": "tab:red",
          "hylo_densepull": "tab:green", "hylo_nomc": "tab:gray"}
# mxhylo.create options of the hylo modes. 'hylo' turns the cost model off: on this
# machine's loopback it may leave layers dense, which converge as dense does; the study
# measures compression itself, every layer the policy offers compressed (the worst case
# of the default). hylo_densepull gives compress_pull, which turns it off already.
HYLO_OPTIONS = {"hylo": {"cost_model": False}, "hylo_densepull": {"compress_pull": False},
                "hylo_nomc": {"momentum_correction": False, "cost_model": False}}
DEFAULT_NETS = ("digits_net", "conv_net", "resnet20")
IN_PROCESS_DEVICES = 2          # --servers 0: one process, cpu(0) and cpu(1)
TARGET_FRACTION = 0.95          # of dense's mean final accuracy
MAX_GAP_POINTS = 0.5
MAX_STEPS_RATIO = 1.25


# ----------------------------------------------------------------------------- bench side

def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def add_arguments(parser):
    parser.add_argument("--nets", default=",".join(DEFAULT_NETS),
                        help="comma-separated, of mxhylo.models.NETS (default %(default)s)")
    parser.add_argument("--lrs", default="0.02,0.05,0.1",
                        help="comma-separated learning rates (default %(default)s)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated subset of %s (default %s)"
                             % (",".join(MODES), ",".join(DEFAULT_MODES)))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (3)")
    parser.add_argument("--epochs", type=int, default=20, help="long budget, epochs (20)")
    parser.add_argument("--short-epochs", type=int, default=6,
                        help="short budget, epochs: the first part of each run (6)")
    parser.add_argument("--lr-schedule", default="cosine", choices=LR_SCHEDULES,
                        help="cosine: warm-up then down to 0 at each budget's end, one job "
                             "per budget; constant: one job for both budgets (cosine)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="cosine: epochs of linear warm-up from 0 (1)")
    parser.add_argument("--eval-every", type=int, default=5,
                        help="steps between test evaluations (5)")
    parser.add_argument("--workers", type=int, default=4, help="workers per job (4)")
    parser.add_argument("--servers", type=int, default=2,
                        help="servers per job (2); 0: no job, one process over %d devices "
                             "(with --workers 1): dense is MXNet's 'device' store, the hylo "
                             "modes the in-process store" % 2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (32)")
    parser.add_argument("--threshold", type=float, default=2.0,
                        help="2bit mode: MXNet's quantization threshold (2.0)")
    parser.add_argument("--runs-file", default=None,
                        help="JSON lines of finished runs (default: beside --json, or a "
                             "temporary file)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the runs already in --runs-file")
    parser.add_argument("--plots-dir", default="docs",
                        help="folder for the PNG plot ('' : none) (default docs)")
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON object of mxhylo.create options added to every hylo mode "
                             "(a mode's own option wins), e.g. '{\"warmup_steps\": 60}'")
    parser.add_argument("--job-timeout", type=float, default=600,
                        help="seconds before one training job is stopped (600)")


def _config(args):
    from ..models import NETS

    cfg = {"nets": [n.strip() for n in args.nets.split(",") if n.strip()],
           "lrs": _floats(args.lrs),
           "modes": [m.strip() for m in args.modes.split(",") if m.strip()],
           "seeds": args.seeds, "epochs": args.epochs, "short_epochs": args.short_epochs,
           "lr_schedule": args.lr_schedule, "warmup_epochs": args.warmup_epochs,
           "eval_every": args.eval_every, "workers": args.workers, "servers": args.servers,
           "batch_size": args.batch_size, "threshold": args.threshold}
    try:
        cfg["hylo_options"] = parse_hylo_options(args.hylo_options)
    except ValueError as err:
        raise SystemExit("accuracy: %s" % err)
    bad = sorted(set(cfg["modes"]) - set(MODES))
    if bad or not cfg["modes"]:
        raise SystemExit("accuracy: --modes must be a subset of %s, got %r"
                         % (",".join(MODES), args.modes))
    bad = sorted(set(cfg["nets"]) - set(NETS))
    if bad or not cfg["nets"]:
        raise SystemExit("accuracy: --nets must be a subset of %s, got %r"
                         % (",".join(NETS), args.nets))
    if not cfg["lrs"] or min(cfg["lrs"]) <= 0:
        raise SystemExit("accuracy: --lrs must be positive numbers, got %r" % args.lrs)
    if min(args.seeds, args.epochs, args.short_epochs, args.workers,
           args.eval_every, args.batch_size) < 1 or args.short_epochs > args.epochs \
            or not 0 <= args.warmup_epochs < args.short_epochs or args.servers < 0:
        raise SystemExit("accuracy: --seeds, --epochs, --short-epochs (<= --epochs), "
                         "--eval-every, --workers, --batch-size must be >= 1, --servers "
                         ">= 0, --warmup-epochs in [0, --short-epochs)")
    if args.servers == 0 and (args.workers != 1 or "2bit" in cfg["modes"]):
        raise SystemExit("accuracy: --servers 0 is one process over %d devices (W = 1): "
                         "it needs --workers 1 and no 2bit mode (MXNet's dist_sync only)"
                         % IN_PROCESS_DEVICES)
    return cfg


def budgets(cfg):
    """Epoch counts of the jobs each (net, lr, mode, seed) needs: one job covers both
    budgets at a constant rate, a schedule that ends with the budget needs one each."""
    if cfg["lr_schedule"] == "constant":
        return [cfg["epochs"]]
    return sorted({cfg["short_epochs"], cfg["epochs"]})


def job_for_budget(cfg, epochs):
    """The epochs of the job whose curve gives the cell of budget ``epochs``."""
    return cfg["epochs"] if cfg["lr_schedule"] == "constant" else epochs


def _run_id(cfg, net, lr, mode, seed, epochs):
    if cfg["lr_schedule"] == "constant":
        return "%s/lr%g/%s/seed%d" % (net, lr, mode, seed)
    return "%s/lr%g/%s/seed%d/%s%g-e%d" % (net, lr, mode, seed, cfg["lr_schedule"],
                                           cfg["warmup_epochs"], epochs)


def run(args):
    cfg = _config(args)
    runs_file = args.runs_file or ((args.json + ".runs.jsonl") if getattr(args, "json", None)
                                   else None)
    done = {}
    if runs_file and os.path.dirname(os.path.abspath(runs_file)):
        os.makedirs(os.path.dirname(os.path.abspath(runs_file)), exist_ok=True)
    if runs_file and args.resume and os.path.exists(runs_file):
        with open(runs_file) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    done[r["id"]] = r
    elif runs_file and os.path.exists(runs_file):
        os.remove(runs_file)
    start = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="mxhylo-accuracy-") as tmp:
        for net in cfg["nets"]:
            for lr in cfg["lrs"]:
                for seed in range(cfg["seeds"]):
                    for epochs, mode in [(e, m) for e in budgets(cfg)
                                         for m in cfg["modes"]]:   # interleaved: load drifts
                        rid = _run_id(cfg, net, lr, mode, seed, epochs)
                        if rid not in done:
                            r = launch_job(cfg, net, lr, mode, seed, epochs, tmp,
                                           args.job_timeout)
                            r["id"] = rid
                            done[rid] = r
                            if runs_file:
                                with open(runs_file, "a") as f:
                                    f.write(json.dumps(r) + "\n")
                            print("accuracy: %-28s final %.4f  %.0f s"
                                  % (rid, r["accuracy"], r["job_seconds"]),
                                  file=sys.stderr, flush=True)
                        results.append(done[rid])
    report = summarize(cfg, results)
    report["study_seconds"] = time.time() - start
    if args.plots_dir:
        report["plots"] = make_plots(report, args.plots_dir)
    print(format_table(report), file=sys.stderr, flush=True)
    return report


def launch_job(cfg, net, lr, mode, seed, epochs, tmp, timeout):
    """One parameter-server job of ``epochs``; returns rank 0's result (plus every
    rank's checksum)."""
    out = os.path.join(tmp, "%s-%g-%s-%d-%d-{rank}.json" % (net, lr, mode, seed, epochs))
    worker = [sys.executable, "-m", "mxhylo.bench.accuracy", "--mode", mode, "--net", net,
              "--seed", str(seed), "--epochs", str(epochs),
              "--lr-schedule", cfg["lr_schedule"], "--warmup-epochs", str(cfg["warmup_epochs"]),
              "--eval-every", str(cfg["eval_every"]),
              "--batch-size", str(cfg["batch_size"]), "--lr", str(lr),
              "--threshold", str(cfg["threshold"]),
              "--hylo-options", json.dumps(cfg.get("hylo_options", {})), "--out", out]
    if cfg["servers"] == 0:             # one process over IN_PROCESS_DEVICES devices
        cmd = worker + ["--devices", str(IN_PROCESS_DEVICES)]
    else:
        # One OpenMP thread per process: W workers and S servers share the machine's cores.
        cmd = [sys.executable, "-m", "mxhylo.launch", "-n", str(cfg["workers"]),
               "-s", str(cfg["servers"]), "--timeout", str(timeout),
               "--env", "OMP_NUM_THREADS:1"] + worker
    t0 = time.time()
    # the job ends with this process, however it ends (a SIGTERM to the study included)
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout + 60, preexec_fn=procs.die_with_parent())
    if res.returncode != 0:
        raise RuntimeError("accuracy: %s failed (exit %d):\n%s"
                           % (_run_id(cfg, net, lr, mode, seed, epochs), res.returncode,
                              res.stdout[-4000:]))
    ranks = []
    for r in range(cfg["workers"]):
        with open(out.format(rank=r)) as f:
            ranks.append(json.load(f))
    result = ranks[0]
    result.update(net=net, lr=lr, mode=mode, seed=seed, epochs=epochs,
                  rank_accuracies=[r["accuracy"] for r in ranks],
                  rank_checksums=[r["param_checksum"] for r in ranks],
                  job_seconds=time.time() - t0)
    return result


def _spread(values):
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "values": [float(x) for x in v]}


def accuracy_at(curve, step):
    """Test accuracy of the last evaluation at or before ``step`` of [(step, acc)]."""
    got = [a for s, a in curve if s <= step]
    return got[-1] if got else 0.0


def steps_to_reach(curve, target, last_step):
    """First evaluated step whose accuracy reaches ``target`` within ``last_step``, or
    None."""
    for s, a in curve:
        if s > last_step:
            break
        if a >= target:
            return s
    return None


def summarize_cell(runs, dense_mode, last_step):
    """One (net, lr, budget) cell: {mode: figures} from the runs of every mode."""
    by_mode = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    finals = {m: [accuracy_at(r["curve"], last_step) for r in rs] for m, rs in by_mode.items()}
    cell = {}
    target = None
    if dense_mode in finals:
        target = TARGET_FRACTION * float(np.mean(finals[dense_mode]))
    for mode, rs in by_mode.items():
        entry = {"final_accuracy": _spread(finals[mode]),
                 "workers_identical": [len(set(r["rank_checksums"])) == 1 for r in rs]}
        if target is not None:
            steps = [steps_to_reach(r["curve"], target, last_step) for r in rs]
            entry["target_accuracy"] = target
            entry["steps_to_target"] = steps
            entry["mean_steps_to_target"] = (None if any(s is None for s in steps)
                                             else float(np.mean(steps)))
        cell[mode] = entry
    if dense_mode in cell:
        dense = cell[dense_mode]
        for mode, entry in cell.items():
            entry["gap_points"] = 100.0 * (entry["final_accuracy"]["mean"]
                                           - dense["final_accuracy"]["mean"])
            a, b = entry.get("mean_steps_to_target"), dense.get("mean_steps_to_target")
            entry["steps_ratio"] = (None if a is None or not b else a / b)
    return cell


def _job_runs(cfg, results, net, lr, job_epochs):
    """The runs of ``net`` at ``lr`` whose jobs lasted ``job_epochs`` (a run file of the
    first protocol has no 'epochs': its jobs lasted cfg['epochs'])."""
    return [r for r in results if r["net"] == net and r["lr"] == lr
            and r.get("epochs", cfg["epochs"]) == job_epochs]


def summarize(cfg, results):
    """The report: per cell 'net lr=.. epochs=..', per mode final accuracy and steps."""
    cells, checks, curves, not_applicable = {}, {}, {}, {}
    for net in cfg["nets"]:
        for lr in cfg["lrs"]:
            for job_epochs in budgets(cfg):
                runs = _job_runs(cfg, results, net, lr, job_epochs)
                if runs:
                    panel = ("%s lr=%g" % (net, lr) if cfg["lr_schedule"] == "constant"
                             else "%s lr=%g epochs=%d" % (net, lr, job_epochs))
                    curves[panel] = {m: [r["curve"] for r in runs if r["mode"] == m]
                                     for m in cfg["modes"]}
            for epochs in sorted({cfg["short_epochs"], cfg["epochs"]}):
                runs = _job_runs(cfg, results, net, lr, job_for_budget(cfg, epochs))
                if not runs:
                    continue
                spe = runs[0]["steps_per_epoch"]
                name = "%s lr=%g epochs=%d" % (net, lr, epochs)
                cell = cells[name] = summarize_cell(runs, "dense", epochs * spe)
                if "hylo" in cell and "dense" in cell:
                    h = cell["hylo"]
                    missed = [seed for seed, s in enumerate(cell["dense"]["steps_to_target"])
                              if s is None]
                    if missed:
                        # dense itself does not get there in every seed (it diverged):
                        # the cell measures divergence, and the steps ratio is undefined
                        not_applicable[name] = ("dense misses 95%% of its own mean final "
                                                "accuracy in seed(s) %s" % missed)
                        continue
                    checks[name] = {
                        "within_%.1f_points" % MAX_GAP_POINTS: h["gap_points"] >= -MAX_GAP_POINTS,
                        "steps_at_most_%.2fx" % MAX_STEPS_RATIO:
                            h["steps_ratio"] is not None and h["steps_ratio"] <= MAX_STEPS_RATIO}
    bytes_, longest = {}, {}
    for r in results:       # per net and mode, from its longest job (the most steady)
        epochs = r.get("epochs", cfg["epochs"])
        if epochs > longest.get((r["net"], r["mode"]), -1):
            longest[(r["net"], r["mode"])] = epochs
            bytes_.setdefault(r["net"], {})[r["mode"]] = (r["bytes_per_step"],
                                                          r["bytes_pulled_per_step"])
    diverged = sorted(r["id"] for r in results if len(set(r["rank_checksums"])) != 1)
    return {"config": cfg, "data": "scikit-learn digits (1347 train / 450 test)",
            "cells": cells, "checks": checks,
            "checks_passed": sum(all(c.values()) for c in checks.values()),
            "checks_total": len(checks), "checks_not_applicable": not_applicable,
            "curves": curves,
            "bytes_per_step_pushed_pulled": bytes_, "diverged_runs": diverged}


def format_table(report):
    """Markdown: one row per cell, final accuracy (mean, sd) and steps ratio per mode."""
    modes = report["config"]["modes"]
    lines = ["| cell | " + " | ".join(modes) + " | hylo passes |",
             "|---|" + "---|" * (len(modes) + 1)]
    for name, cell in report["cells"].items():
        row = []
        for m in modes:
            e = cell.get(m)
            if e is None:
                row.append("")
                continue
            ratio = e.get("steps_ratio")
            row.append("%.1f ± %.1f (%s)" % (100 * e["final_accuracy"]["mean"],
                                            100 * e["final_accuracy"]["std"],
                                            "-" if ratio is None else "%.2fx" % ratio))
        ok = report["checks"].get(name)
        verdict = ("n/a (dense diverged)" if name in report.get("checks_not_applicable", {})
                   else "" if ok is None else "yes" if all(ok.values()) else "no")
        lines.append("| %s | %s | %s |" % (name, " | ".join(row), verdict))
    return "\n".join(lines)


def make_plots(report, folder):
    """docs/accuracy_curves.png: test accuracy against steps per (net, lr), every
    mode's mean over seeds; returns {'accuracy_curves': path}."""
    import matplotlib

    matplotlib.use("Agg")   # no display on a build machine
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    panels = report["curves"]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, by_mode) in zip(axes.flat, panels.items()):
        for mode, curves in by_mode.items():
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            acc = np.mean([[a for _, a in c][:len(steps)] for c in curves], axis=0)
            ax.plot(steps, 100 * acc, color=COLORS[mode], label=mode, linewidth=1.2)
        if report["config"].get("lr_schedule", "constant") == "constant":
            ax.axvline(report["config"]["short_epochs"]
                       * (steps[-1] / report["config"]["epochs"]),
                       color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy (%)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    cfg = report["config"]
    schedule = cfg.get("lr_schedule", "constant")
    fig.suptitle("digits, %d workers + %d servers, mean of %d seeds; lr %s%s"
                 % (cfg["workers"], cfg["servers"], cfg["seeds"], schedule,
                    "; dotted: short budget" if schedule == "constant"
                    else " (warm-up %g epochs)" % cfg["warmup_epochs"]), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))    # room for the title
    path = os.path.join(folder, "accuracy_curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"accuracy_curves": path}


# ----------------------------------------------------------------------------- byte counts

def dense_bytes(n):
    """Bytes a float32 gradient of n elements pushes uncompressed."""
    return 4 * int(n)


def twobit_bytes(n):
    """Bytes MXNet 1.9's 2-bit compression pushes for a float32 key of n elements:
    16 codes per float32 word, ceil(n / 16) words (GradientCompression::GetCompressedSize)."""
    return 4 * ((int(n) + 15) // 16)


# ----------------------------------------------------------------------------- worker side

class PushThenPull(WorkerUpdateStore):
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



def _worker_parser():
    p = argparse.ArgumentParser(prog="python -m mxhylo.bench.accuracy",
                                description="one worker of the accuracy study (started by "
                                            "python -m mxhylo.bench accuracy)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--net", default="digits_net")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES)
    p.add_argument("--warmup-epochs", type=float, default=0.0)
    p.add_argument("--threshold", type=float, default=2.0)
    p.add_argument("--hylo-options", default="{}",
                   help="JSON object of mxhylo.create options under the mode's own")
    p.add_argument("--out", required=True, help="result JSON; {rank} is the worker rank")
    p.add_argument("--devices", type=int, default=0,
                   help="0: a worker of a parameter-server job; N: one process over cpu(0) "
                        ".. cpu(N-1), no job (the batch is split over the devices)")
    return p


def worker_main(argv=None):
    args = _worker_parser().parse_args(argv)
    import mxnet as mx

    import mxhylo
    from mxhylo import digits

    one_process = args.devices > 0
    if args.mode == "dense":
        kv = "device" if one_process else mx.kv.create("dist_sync")
    elif args.mode == "2bit":
        kv = PushThenPull(args.threshold)
    else:
        options = dict(json.loads(args.hylo_options), **HYLO_OPTIONS[args.mode])
        kv = mxhylo.create("hylo" if one_process else "dist_sync_hylo", **options)
    contexts = [mx.cpu(i) for i in range(args.devices)] if one_process else [mx.cpu(0)]
    result = digits.train(kvstore=kv, contexts=contexts, epochs=args.epochs,
                          batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                          net=args.net, eval_every=args.eval_every,
                          lr_schedule=args.lr_schedule, warmup_epochs=args.warmup_epochs)
    sizes = {name: int(a.size) for name, a in result["params"].items()}
    stats = result["stats"]
    if args.mode in HYLO_OPTIONS:
        per_step = stats["bytes_pushed"] / stats["steps"]
        pulled_per_step = stats["bytes_pulled"] / stats["steps"]
    else:
        # both native modes pull the dense float32 sum; 2bit compresses only the push
        count = dense_bytes if args.mode == "dense" else twobit_bytes
        per_step = float(sum(count(n) for n in sizes.values()))
        pulled_per_step = float(sum(dense_bytes(n) for n in sizes.values()))
    # Synchronous workers must end with identical trainable parameters: a checksum per
    # rank lets the study see a worker that drifted.
    checksum = float(sum(np.abs(a.astype(np.float64)).sum() for a in result["params"].values()))
    report = {"mode": args.mode, "seed": args.seed, "rank": result["rank"],
              "param_checksum": checksum, "workers": result["workers"],
              "accuracy": result["accuracy"], "history": result["history"],
              "curve": result["curve"], "steps_per_epoch": result["steps_per_epoch"],
              "seconds": result["seconds"], "bytes_per_step": per_step,
              "bytes_pulled_per_step": pulled_per_step}
    with open(args.out.format(rank=result["rank"]), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
