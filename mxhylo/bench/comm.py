"""``python -m mxhylo.bench comm``: gradient exchange over MXNet's parameter server,
each process in its own network namespace behind a shaped link.

W workers, S servers and a scheduler each run in a network namespace whose one veth
link to a bridge is shaped with tc tbf at --rate in both directions (see
mxhylo.bench.netns). For every model (real parameter shapes from the gluoncv model zoo,
one forward at --image-size) and every mode, a fresh parameter-server job exchanges one
step's gradients --warmup + --steps times; the report gives per model and mode:

* seconds per exchange: median over the timed steps of the slowest worker's time
  (workers meet at a file barrier before each step; the warm-up is excluded);
* bytes on the wire: /sys/class/net/eth0/statistics/{tx,rx}_bytes of every role's
  interface, read before and after the timed steps: push = workers' tx, pull =
  workers' rx, per step (L2 frames: payload plus TCP/IP/Ethernet headers);
* hylo's own counters (kv.stats(): bytes pushed/pulled, per layer, timing if any);
* the dense-pull floor, (dense model bytes * W / S) / rate: the time the servers'
  links need to send every worker its pull of a dense model;
* the speedup of each mode over dense_pushpull, and over the best peer of the run: the
  fastest mode not named hylo* (what a user would run instead of mxhylo).

Peers moving float16 (half the dense bytes; compute stays float32 in training):
dist_sync_fp16 (MXNet's dist_sync with each gradient cast to float16 around the store's
pushpull, mxhylo.bench.fp16.DistSyncFP16Store) and horovod_fp16 (horovod_dense's
exchange with hvd.Compression.fp16).

Horovod modes (horovod_dense: hvd.DistributedTrainer's exchange, per-gradient
allreduce fused by Horovod; horovod_fp16: the same in float16; hylo_horovod:
mxhylo.create('dist_sync_hylo', transport='horovod')) run W processes, one per worker
namespace, with horovodrun's Gloo environment and no servers
(mxhylo.bench.horovod_jobs); the same links, counters and report fields. Their floor
is the ring's: 2 (W - 1) / W * dense bytes / rate.

Gradients are synthetic, N(0, --grad-scale) with 0.01 by default: a realistic scale
(N(0, 1) is the worst case of threshold codecs such as MXNet's 2-bit). Needs root
(namespaces); says so and exits non-zero otherwise. Everything created (processes,
namespaces) is removed at the end, on error and on SIGINT/SIGTERM/SIGHUP.
"""
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from . import comm_worker, netns, plot_path, sweep
from .horovod_jobs import HOROVOD_MODES, horovod_available
from .jobs import JobError, _Interrupted, clean_env, run_job

ALL_MODES = ("dense_pushpull", "dist_sync_fp16", "dense_push_pull", "mxnet_2bit", "hylo",
             "hylo_gather", "hylo_auto") + HOROVOD_MODES
HYLO_MODES = ("hylo", "hylo_gather", "hylo_auto")
DEFAULT_MODELS = ("resnet50_v1b", "vgg16", "alexnet")
BASELINE = "dense_pushpull"
FLOAT_BYTES = 4
PS_PORT = 9091
WORKER = "mxhylo.bench.comm_worker"
# ps-lite chatter in the counter window is tiny; codec CPU is the other bound on time:
# per-job timeout = 120 s + (steps + warmup + 2) * (6 * floor + W * dense / 50 MB/s)
_CPU_BYTES_PER_S = 50e6


def add_arguments(parser):
    parser.add_argument("-n", "--workers", type=int, default=4, help="workers (default 4)")
    parser.add_argument("-s", "--servers", type=int, default=2, help="servers (default 2)")
    parser.add_argument("--rate", default="1gbit",
                        help="tc tbf rate of every link, each direction (default 1gbit)")
    parser.add_argument("--role-rate", default="",
                        help="links of some roles at another rate than --rate, both "
                             "ways: ROLE=RATE[,ROLE=RATE...], e.g. server1=250mbit (a "
                             "server on a slower link)")
    parser.add_argument("--delay", "--latency", dest="delay", default=None,
                        help="one-way delay between nodes via netem, e.g. 1ms (default none;"
                             " needs the kernel's netem qdisc)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated gluoncv model names (default %(default)s)")
    parser.add_argument("--modes", default=",".join(ALL_MODES),
                        help="comma-separated modes, of %s (default all; hylo is skipped "
                             "with a note while mxhylo.kvstore.transport_ps is missing)"
                             % ", ".join(ALL_MODES))
    parser.add_argument("--steps", type=int, default=5,
                        help="exchanges per model and mode, the warm-up included; the median "
                             "of the others is reported (default 5: a median of 4 timed "
                             "steps; hylo's exchanges vary by 20%% from step to step here)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="how many of the first exchanges are warm-up, not reported "
                             "(default 1)")
    parser.add_argument("--grad-scale", type=float, default=0.01,
                        help="gradients are N(0, this) (default 0.01)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="input size of the forward that fixes the shapes (default 224)")
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the links (default 1500)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per job (model x mode) before it is killed (default: "
                             "from the model size and rate)")
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON dict of options for mxhylo.create (default {})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic arrays")
    parser.add_argument("--plot", default=None,
                        help="PNG plot (default: beside --json, same name with .png)")
    parser.add_argument("--keep-tmp", action="store_true",
                        help="keep the job directories (configs, logs, worker results)")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="first delete namespaces left by comm runs that were killed "
                             "(mxhcomm<pid>-* whose pid is gone)")


# ----------------------------------------------------------------------------- pure parts

def parse_list(text, allowed=None, what="item"):
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError("no %s given" % what)
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise ValueError("unknown %s %s (choose from %s)"
                             % (what, ", ".join(bad), ", ".join(allowed)))
    return items


def parse_hylo_options(text):
    """--hylo-options: a JSON object of mxhylo.create options; ValueError if not."""
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ValueError("--hylo-options is not JSON: %s" % err)
    if not isinstance(options, dict):
        raise ValueError("--hylo-options must be a JSON object, e.g. '{\"warmup_steps\": "
                         "0}', got %r" % (text,))
    return options


def role_names(num_workers, num_servers):
    """Roles in address order: scheduler, server0.., worker0.."""
    return (["scheduler"] + ["server%d" % i for i in range(num_servers)]
            + ["worker%d" % i for i in range(num_workers)])


def block_shapes(net, image_size=224, channels=3):
    """[{'key', 'name', 'shape'}] of the parameters a Trainer would exchange (grad_req
    not 'null'), keyed by their index in collect_params() as gluon.Trainer keys them."""
    import mxnet as mx
    net.initialize(mx.init.Zero(), force_reinit=False)
    net(mx.nd.zeros((1, channels, image_size, image_size)))
    mx.nd.waitall()
    out = []
    for i, p in enumerate(net.collect_params().values()):
        if p.grad_req != "null":
            out.append({"key": i, "name": p.name, "shape": [int(d) for d in p.shape]})
    return out


def model_shapes(name, image_size=224):
    """Exchanged parameter shapes of gluoncv model ``name`` after one forward."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gluoncv
        net = gluoncv.model_zoo.get_model(name, pretrained=False)
        return block_shapes(net, image_size)


def shapes_in_subprocess(models, image_size, timeout=600):
    """{model: shapes} computed in a child python, so that the harness does not keep
    the models' memory (MXNet's pool holds freed arrays) for the whole run."""
    code = ("import json, sys; from mxhylo.bench.comm import model_shapes; "
            "print(json.dumps({m: model_shapes(m, %d) for m in %r}))" % (image_size,
                                                                        list(models)))
    res = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, timeout=timeout,
                         env=clean_env())
    if res.returncode != 0:
        raise SystemExit("mxhylo.bench comm: could not get the model shapes:\n"
                         + res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def model_summary(params, num_workers, num_servers, rate_bps):
    sizes = [numel(p["shape"]) for p in params]
    total = sum(sizes)
    big = max(range(len(params)), key=lambda i: sizes[i])
    dense_bytes = total * FLOAT_BYTES
    return {"num_params": total, "num_keys": len(params), "dense_bytes": dense_bytes,
            "largest_key": {"name": params[big]["name"], "shape": params[big]["shape"],
                            "fraction": sizes[big] / total},
            "dense_pull_floor_s": dense_pull_floor(dense_bytes, num_workers, num_servers,
                                                   rate_bps),
            "dense_push_floor_s": dense_bytes * 8.0 / rate_bps,   # 0 when unshaped
            "ring_allreduce_floor_s": ring_allreduce_floor(dense_bytes, num_workers,
                                                           rate_bps)}


def ring_allreduce_floor(dense_bytes, num_workers, rate_bps):
    """Seconds a ring allreduce of the dense model needs on links of ``rate_bps``: each
    worker sends (and receives) 2 (W - 1) / W of the model over its own link."""
    return 2.0 * (num_workers - 1) / num_workers * dense_bytes / (rate_bps / 8.0)


def dense_pull_floor(dense_bytes, num_workers, num_servers, rate_bps):
    """Seconds the servers' links need to send the dense pull: each server holds 1/S of
    the model and sends it to W workers over one link of ``rate_bps``."""
    return dense_bytes * num_workers / float(num_servers) / (rate_bps / 8.0)


def step_seconds(worker_results):
    """Per timed step: (slowest worker's own time, span from the first start to the
    last finish) over all workers."""
    n = min(len(r["steps"]) for r in worker_results)
    slowest, span = [], []
    for i in range(n):
        steps = [r["steps"][i] for r in worker_results]
        slowest.append(max(s["seconds"] for s in steps))
        span.append(max(s["start"] + s["seconds"] for s in steps) - min(s["start"] for s in steps))
    return slowest, span


def wire_summary(before, after, steps):
    """Bytes per step from counters {role: (tx, rx)} before/after ``steps`` exchanges."""
    delta = {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in before}
    workers = [r for r in delta if r.startswith("worker")]
    servers = [r for r in delta if r.startswith("server")]
    per = float(max(steps, 1))
    return {
        "push_bytes_per_step": sum(delta[r][0] for r in workers) / per,
        "pull_bytes_per_step": sum(delta[r][1] for r in workers) / per,
        "server_tx_bytes_per_step": sum(delta[r][0] for r in servers) / per,
        "server_rx_bytes_per_step": sum(delta[r][1] for r in servers) / per,
        "per_role_per_step": {r: {"tx": d[0] / per, "rx": d[1] / per}
                              for r, d in sorted(delta.items())},
    }


def hylo_summary(worker_results, steps):
    """hylo's own byte counts over the timed steps (summed over workers, per step), its
    timing dict if it reports one, and worker 0's full stats."""
    keys = ("bytes_pushed", "bytes_pulled", "dense_bytes")
    out = {}
    for k in keys:
        vals = []
        for r in worker_results:
            a, b = (r.get("stats") or {}).get(k), (r.get("stats_before") or {}).get(k)
            if isinstance(a, (int, float)):
                vals.append(a - (b if isinstance(b, (int, float)) else 0))
        if vals:
            out[k + "_per_step"] = sum(vals) / float(max(steps, 1))
    timings = [(r.get("stats") or {}).get("timing") for r in worker_results]
    if any(t is not None for t in timings):
        out["timing"] = timings
    w0 = min(worker_results, key=lambda r: r["index"])
    out["worker0_stats"] = w0.get("stats")
    return out


def summarise_job(worker_results, before, after, steps):
    slowest, span = step_seconds(worker_results)
    res = {"status": "ok", "seconds": statistics.median(slowest) if slowest else None,
           "seconds_steps": slowest, "span_steps": span,
           "warmup_seconds": [max(r["warmup"][i]["seconds"] for r in worker_results)
                              for i in range(min(len(r["warmup"]) for r in worker_results))],
           "init_seconds": max(r["init_s"] for r in worker_results)}
    if all("timeline" in r for r in worker_results):
        res["worker_timeline_max_s"] = {k: max(r["timeline"][k] for r in worker_results)
                                        for k in worker_results[0]["timeline"]}
    if before and after:
        res["wire"] = wire_summary(before, after, steps)
    if any(r.get("stats") is not None for r in worker_results):
        res["hylo"] = hylo_summary(worker_results, steps)
    return res


HOROVOD_BASELINE = "horovod_dense"


def is_peer(mode):
    """Whether ``mode`` is a peer: a way to train that a user would pick instead of
    mxhylo (every mode not named hylo*)."""
    return not mode.startswith("hylo")


def best_peer(per_mode, key):
    """(mode, value) of the peer with the smallest ``key`` (seconds) among the modes of
    ``per_mode`` that ran, or (None, None)."""
    ran = [(res[key], mode) for mode, res in per_mode.items()
           if is_peer(mode) and res.get("status", "ok") == "ok" and res.get(key)]
    if not ran:
        return None, None
    value, mode = min(ran)
    return mode, value


def add_speedups(results, floor_s):
    """speedup = baseline seconds / mode seconds; also seconds / dense-pull floor;
    speedup_vs_best_peer against the fastest peer of the same run (its name in
    best_peer); and, when horovod_dense ran, speedup_vs_horovod_dense."""
    base = results.get(BASELINE, {}).get("seconds")
    hvd = results.get(HOROVOD_BASELINE, {}).get("seconds")
    peer, peer_s = best_peer(results, "seconds")
    for res in results.values():
        if res.get("seconds"):
            res["speedup_vs_" + BASELINE] = (base / res["seconds"]) if base else None
            res["x_dense_pull_floor"] = res["seconds"] / floor_s if floor_s else None
            res["best_peer"] = peer
            res["speedup_vs_best_peer"] = (peer_s / res["seconds"]) if peer_s else None
            if HOROVOD_BASELINE in results:
                res["speedup_vs_" + HOROVOD_BASELINE] = (hvd / res["seconds"]) if hvd \
                    else None
    return results


def job_timeout(summary, num_workers, steps, warmup):
    # (unshaped links: the floor is 0 and the CPU term bounds the job)
    rounds = steps + warmup + 2
    return 120.0 + rounds * (6.0 * summary["dense_pull_floor_s"]
                             + num_workers * summary["dense_bytes"] / _CPU_BYTES_PER_S)


def _x(value):
    return "%.2fx" % value if value else "-"


def format_table(report):
    """Per model and mode: seconds per exchange, speedup over dense_pushpull ('speedup')
    and over the run's best peer ('vs peer'), bytes on the wire; then the best peer."""
    lines = ["%-14s %-16s %9s %8s %8s %11s %11s %11s" % (
        "model", "mode", "s/exch", "speedup", "vs peer", "push MB/st", "pull MB/st",
        "hylo MB/st")]
    for model, per_mode in report["results"].items():
        floor = report["models"][model]["dense_pull_floor_s"]
        for mode, res in per_mode.items():
            if res.get("status") != "ok":
                lines.append("%-14s %-16s %s" % (model, mode, res.get("status")))
                continue
            wire = res.get("wire", {})
            hy = res.get("hylo", {})
            hylo_mb = ((hy.get("bytes_pushed_per_step", 0) + hy.get("bytes_pulled_per_step", 0))
                       / 1e6 if "bytes_pushed_per_step" in hy else None)
            lines.append("%-14s %-16s %9.3f %8s %8s %11.1f %11.1f %11s" % (
                model, mode, res["seconds"], _x(res.get("speedup_vs_" + BASELINE)),
                _x(res.get("speedup_vs_best_peer")),
                wire.get("push_bytes_per_step", 0) / 1e6,
                wire.get("pull_bytes_per_step", 0) / 1e6,
                "%.1f" % hylo_mb if hylo_mb is not None else "-"))
        peer, peer_s = best_peer(per_mode, "seconds")
        if peer:
            vs = [(mode, res.get("speedup_vs_best_peer")) for mode, res in per_mode.items()
                  if not is_peer(mode) and res.get("status") == "ok"]
            lines.append("%-14s best peer (fastest non-hylo mode): %s, %.3f s/exch%s" % (
                model, peer, peer_s, "; speedup vs it: " + ", ".join(
                    "%s %s" % (mode, _x(x)) for mode, x in vs) if vs else ""))
        vs = [(mode, res.get("speedup_vs_" + HOROVOD_BASELINE)) for mode, res in
              per_mode.items() if mode != HOROVOD_BASELINE]
        vs = [(mode, x) for mode, x in vs if x]
        if vs:
            lines.append("%-14s speedup vs %s: %s" % (model, HOROVOD_BASELINE, ", ".join(
                "%s %.2fx" % v for v in vs)))
        lines.append("%-14s %-16s %9.3f   (dense bytes * W / S / rate)" % (model,
                                                                          "dense-pull floor",
                                                                          floor))
        ring = report["models"][model].get("ring_allreduce_floor_s")
        if ring is not None and any(m in HOROVOD_MODES for m in per_mode):
            lines.append("%-14s %-16s %9.3f   (2 (W - 1) / W * dense bytes / rate)" % (
                model, "ring floor", ring))
    return lines


# ----------------------------------------------------------------------------- machine

CPU_FEATURES = re.compile(r"avx512[a-z_0-9]*|avx2|f16c")


def cpu_features(cpuinfo_text):
    """Sorted distinct AVX2/AVX-512/F16C flags, as
    ``grep -o 'avx512[a-z_0-9]*\\|avx2\\|f16c' /proc/cpuinfo | sort -u`` lists them."""
    return sorted(set(CPU_FEATURES.findall(cpuinfo_text)))


def machine_info():
    """The machine a report was measured on: CPU model and features, and the ISA level
    of hylo's operator build every process of the run loads (MXHYLO_ISA)."""
    info = {"hostname": socket.gethostname(), "kernel": platform.release(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_features": None,
            "ops_isa": os.environ.get("MXHYLO_ISA", "").strip() or "native"}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        info["cpu_features"] = cpu_features(text)
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    try:
        import mxnet
        info["mxnet"] = mxnet.__version__
    except ImportError:
        pass
    return info


def hylo_available():
    try:
        return importlib.util.find_spec("mxhylo.kvstore.transport_ps") is not None
    except (ImportError, ValueError):
        return False


# ----------------------------------------------------------------------------- processes

class ShapedRun:
    """The namespaces and job folder of one benchmark run, torn down whatever happens.

    ``with ShapedRun(topo, tmp, "comm", keep_tmp) as run:`` creates the namespaces,
    turns SIGTERM/SIGHUP into an interruption, and on the way out (shielded from a
    second signal) deletes the namespaces and, unless ``keep_tmp`` or ``run.failed``
    (set by the body when a job failed), the job folder. A namespace error or an
    interruption leaves as SystemExit with a message (130 when interrupted).
    """

    def __init__(self, topo, tmp, bench, keep_tmp=False):
        self.topo, self.tmp, self.bench, self.keep_tmp = topo, tmp, bench, keep_tmp
        self.failed = False

    def __enter__(self):
        def on_signal(signum, frame):
            raise _Interrupted("signal %d" % signum)
        self.old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self.topo.create()
        except BaseException as err:
            self.__exit__(type(err), err, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            with _Shielded():
                errors = self.topo.destroy()
                if errors:
                    _log("could not delete: %s" % "; ".join(errors))
                if self.keep_tmp or self.failed:
                    _log("job files kept in " + self.tmp)
                else:
                    shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            for s, h in self.old.items():
                signal.signal(s, h)
        if exc_type is not None and issubclass(exc_type, netns.NetnsError):
            raise SystemExit("mxhylo.bench %s: network namespaces: %s" % (self.bench, exc))
        if exc_type is not None and issubclass(exc_type, (_Interrupted, KeyboardInterrupt)):
            _log("interrupted (%s): cleaning up" % (str(exc) or "SIGINT"))
            raise SystemExit(130)
        return False


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Shielded:
    """Cleanup that a second Ctrl-C (or SIGTERM/SIGHUP) cannot cut short: signals that
    arrive meanwhile are held and raised when the block ends."""

    def __enter__(self):
        self.caught = []
        self.old = {s: signal.signal(s, lambda signum, frame: self.caught.append(signum))
                    for s in _SIGNALS}
        return self

    def __exit__(self, exc_type, exc, tb):
        for s, h in self.old.items():
            signal.signal(s, h)
        if self.caught and exc_type is None:
            if self.caught[0] == signal.SIGINT:
                raise KeyboardInterrupt
            raise _Interrupted("signal %d" % self.caught[0])
        return False


# ----------------------------------------------------------------------------- plot

def write_plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["results"])
    modes = [m for m in report["config"]["modes"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(modes), 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2.0) * width for i in range(len(models))]
        secs, push, pull = [], [], []
        for m in models:
            res = report["results"][m].get(mode, {})
            ok = res.get("status") == "ok"
            secs.append(res["seconds"] if ok else 0)
            wire = res.get("wire", {}) if ok else {}
            push.append(wire.get("push_bytes_per_step", 0) / 1e6)
            pull.append(wire.get("pull_bytes_per_step", 0) / 1e6)
        c = colors[j % len(colors)]
        axes[0].bar(xs, secs, width, label=mode, color=c)
        if not is_peer(mode):
            for x, y, m in zip(xs, secs, models):
                sp = report["results"][m].get(mode, {}).get("speedup_vs_best_peer")
                if sp and y:
                    axes[0].annotate("%.2fx" % sp, (x, y), ha="center", va="bottom",
                                     fontsize=7, xytext=(0, 2), textcoords="offset points")
        axes[1].bar(xs, push, width, color=c, label=mode + " push")
        axes[1].bar(xs, pull, width, bottom=push, color=c, alpha=0.45, hatch="//",
                    label=mode + " pull")
    for i, m in enumerate(models):
        floor = report["models"][m]["dense_pull_floor_s"]
        axes[0].plot([i - 0.45, i + 0.45], [floor, floor], "k--", lw=1,
                     label="dense-pull floor" if i == 0 else None)
        ring = report["models"][m].get("ring_allreduce_floor_s")
        if ring is not None and any(mode in HOROVOD_MODES for mode in modes):
            axes[0].plot([i - 0.45, i + 0.45], [ring, ring], "k:", lw=1,
                         label="ring-allreduce floor" if i == 0 else None)
    cfg = report["config"]
    for ax in axes:
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
    axes[0].set_ylabel("seconds per exchange (median); hylo labels: x best peer")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("MB on the wire per step (workers' tx push + rx pull)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("comm: %d workers, %d servers, %s links, grads %s, %s, %s"
                 % (cfg["workers"], cfg["servers"], cfg["rate"], cfg["gradients"],
                    report["machine"].get("hostname", ""), report["date"][:10]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- run

def _log(msg):
    print("[comm] " + msg, file=sys.stderr, flush=True)


def run(args):
    """One report per rate of --rate (a comma-separated list); with several rates, a
    sweep report holding them and each mode's speedup over dense against bandwidth."""
    reason = netns.check_capable()
    if reason:
        raise SystemExit("mxhylo.bench comm: cannot create network namespaces: " + reason)
    rates = parse_list(args.rate, what="rate")
    try:
        for rate in rates:
            netns.parse_rate(rate)
        models = parse_list(args.models, what="model")
    except ValueError as err:
        raise SystemExit("mxhylo.bench comm: %s" % err)
    if len(rates) == 1:
        return run_rate(args, rates[0])
    _log("model shapes (gluoncv, one forward at %d)..." % args.image_size)
    shapes = shapes_in_subprocess(models, args.image_size)
    plot = plot_path(args)
    per_rate = {}
    for rate in rates:
        _log("=== rate %s ===" % rate)
        per_rate[rate] = run_rate(args, rate, shapes=shapes, plot="")
    report = sweep.sweep_report("comm", rates, per_rate, BASELINE, AUTO_MODE)
    for line in sweep.format_sweep(report):
        _log(line)
    if plot:
        sweep.write_sweep_plot(report, plot)
        report["plot"] = plot
        _log("plot: " + plot)
    return report


AUTO_MODE = "hylo_auto"          # mxhylo's defaults: the mode the sweep's bar is about


def run_rate(args, rate, shapes=None, plot=None):
    """The report of one rate (shapes: {model: params} already computed, or None)."""
    reason = netns.check_capable()
    if reason:
        raise SystemExit("mxhylo.bench comm: cannot create network namespaces: " + reason)
    W, S = args.workers, args.servers
    if W < 1 or S < 1:
        raise SystemExit("mxhylo.bench comm: need at least one worker and one server")
    try:
        rate_bps = netns.parse_rate(rate)
        role_rates = netns.parse_role_rates(args.role_rate)
        delay_s = netns.parse_time(args.delay) if args.delay else 0.0
        models = parse_list(args.models, what="model")
        modes = parse_list(args.modes, ALL_MODES, what="mode")
        hylo_options = json.loads(args.hylo_options)
    except ValueError as err:
        raise SystemExit("mxhylo.bench comm: %s" % err)
    timed_steps = args.steps - args.warmup
    if args.warmup < 0 or timed_steps < 1:
        raise SystemExit("mxhylo.bench comm: --steps must exceed --warmup (%d)" % args.warmup)
    notes = []
    skipped = {}
    for mode in HYLO_MODES:
        if mode in modes and not hylo_available():
            skipped[mode] = "skipped: mxhylo.kvstore.transport_ps is not available in this build"
            notes.append(mode + " mode " + skipped[mode])
    for mode in HOROVOD_MODES:
        if mode in modes and not horovod_available():
            skipped[mode] = ("skipped: horovod.mxnet is not installed (make setup builds it "
                             "with MXNet and Gloo)")
            notes.append(mode + " mode " + skipped[mode])

    if plot is None:
        plot = plot_path(args)
    if args.cleanup_stale:
        for name in netns.stale_namespaces():
            subprocess.run(["ip", "netns", "del", name], timeout=netns.CMD_TIMEOUT)
            _log("removed stale namespace " + name)

    if shapes is None:
        _log("model shapes (gluoncv, one forward at %d)..." % args.image_size)
        shapes = shapes_in_subprocess(models, args.image_size)
    summaries = {}
    for m in models:
        summaries[m] = model_summary(shapes[m], W, S, rate_bps)
        _log("  %s: %d keys, %.1f MB dense, dense-pull floor %.2f s" % (
            m, summaries[m]["num_keys"], summaries[m]["dense_bytes"] / 1e6,
            summaries[m]["dense_pull_floor_s"]))

    report = {
        "suite": "comm",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {"workers": W, "servers": S, "rate": rate,
                   "rate_bps": None if math.isinf(rate_bps) else rate_bps,
                   "delay": args.delay, "mtu": args.mtu, "role_rates": role_rates,
                   "tbf_burst_bytes": netns.tbf_burst_bytes(rate_bps),
                   "steps": args.steps, "warmup": args.warmup, "timed_steps": timed_steps,
                   "gradients": "synthetic N(0, %g)" % args.grad_scale,
                   "grad_scale": args.grad_scale, "image_size": args.image_size,
                   "models": models, "modes": modes, "hylo_options": hylo_options,
                   "seed": args.seed},
        "mode_descriptions": {m: comm_worker.describe(m) for m in modes},
        "models": summaries,
        "notes": notes + [
            "gradients are synthetic, drawn once per worker from N(0, %g) (a realistic "
            "scale; N(0, 1) is the worst case for threshold codecs such as 2-bit)"
            % args.grad_scale,
            "seconds: median over %d timed exchanges (after %d warm-up) of the slowest "
            "worker's time; workers meet at a file barrier before each exchange"
            % (timed_steps, args.warmup),
            "wire bytes: interface counters (L2 frames incl. TCP/IP/Ethernet headers) "
            "read before/after the timed exchanges; push = workers' tx, pull = workers' rx",
            "dense-pull floor = dense model bytes * W / S / rate",
            "speedup_vs_best_peer: the fastest peer's seconds (the fastest mode not named "
            "hylo* that ran for the model in this run, named in best_peer) over the mode's",
            "every link shaped with tc tbf at the rate in both directions (star through a "
            "bridge in a hub namespace)",
            "%d processes (scheduler, %d servers, %d workers) share this machine's %s CPU "
            "cores: at high rates the CPU, not the link, is the limit"
            % (1 + S + W, S, W, os.cpu_count()),
        ] + ([
            "Horovod modes (%s): %d worker processes, one per worker namespace, with "
            "horovodrun's Gloo environment (ring allreduce/allgather over the same shaped "
            "links), no servers; Horovod's rendezvous server runs in the scheduler's "
            "namespace and is used only at hvd.init; ring floor = 2 (W - 1) / W * dense "
            "bytes / rate" % (", ".join(m for m in modes if m in HOROVOD_MODES), W)]
            if any(m in HOROVOD_MODES for m in modes) else []),
        "results": {},
    }

    try:
        topo = netns.Topology(role_names(W, S), rate_bps, delay_s, mtu=args.mtu,
                              role_rates=role_rates)
    except ValueError as err:
        raise SystemExit("mxhylo.bench comm: %s" % err)
    tmp = tempfile.mkdtemp(prefix="mxhylo-comm-")
    cfg = {"num_workers": W, "num_servers": S, "warmup": args.warmup, "steps": timed_steps,
           "grad_scale": args.grad_scale, "seed": args.seed, "hylo_options": hylo_options}

    with ShapedRun(topo, tmp, "comm", args.keep_tmp) as shaped:
        _log("namespaces %s* up: %d roles, %s links" % (topo.prefix, len(topo.roles), rate))
        port = PS_PORT
        for m in models:
            per_mode = report["results"][m] = {}
            for mode in modes:
                if mode in skipped:
                    per_mode[mode] = {"status": skipped[mode]}
                    continue
                timeout = args.timeout or job_timeout(summaries[m], W, timed_steps,
                                                      args.warmup)
                job_dir = os.path.join(tmp, "%s-%s" % (m, mode))
                os.makedirs(job_dir)
                _log("%s / %s (timeout %.0f s)..." % (m, mode, timeout))
                t0 = time.monotonic()
                config = dict(cfg, mode=mode, keys=[p["key"] for p in shapes[m]],
                              shapes=[p["shape"] for p in shapes[m]])
                try:
                    results, counters, _ = run_job(
                        topo, job_dir, config, port, timeout, WORKER, worker_threads=0,
                        marks=("start", "end"),
                        launcher="horovod" if mode in HOROVOD_MODES else "ps")
                    per_mode[mode] = summarise_job(results, counters["start"],
                                                   counters["end"], timed_steps)
                    per_mode[mode]["job_seconds"] = time.monotonic() - t0
                    _log("  %.3f s per exchange (job %.0f s)" % (per_mode[mode]["seconds"],
                                                                 time.monotonic() - t0))
                except JobError as err:
                    shaped.failed = True
                    per_mode[mode] = {"status": "failed: %s" % err,
                                      "log_tail": err.log_tail}
                    _log("  FAILED: %s" % err)
                port += 1
            add_speedups(per_mode, summaries[m]["dense_pull_floor_s"])

    report["table"] = format_table(report)
    for line in report["table"]:
        _log(line)
    if plot:
        write_plot(report, plot)
        report["plot"] = plot
        _log("plot: " + plot)
    return report
