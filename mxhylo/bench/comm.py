"""``python -m mxhylo.bench comm``: one step's gradient exchange per mode, in an emulated
cluster.

The cluster is a single-machine stand-in (mxhylo.bench.netns): W workers, S servers and
a scheduler, each in a network namespace behind a link shaped to --rate both ways,
all on this machine's cores. For every model (its real parameter shapes: gluoncv's
model zoo, one forward at --image-size) and mode (mxhylo.bench.modes), one job
exchanges synthetic gradients, N(0, --grad-scale), as gluon.Trainer would: untimed
exchanges until the store is past its start-up (hylo's dense warm-up), --warmup
untimed ones, then --steps timed ones, the workers meeting at a barrier before each.

Per model and mode the record gives the median over the timed exchanges of the
slowest worker's seconds; the bytes on the wire per exchange from the interface
counters (push = the workers' tx, pull = their rx; L2 frames, headers included);
hylo's own counts (kv.stats()); the speedup over dist_sync, horovod_dense and the
best peer of the run (the fastest mode not of the hylo store); the floors: the
dense pull (dense bytes * W / S / rate) and the ring allreduce (2 (W - 1) / W * dense
bytes / rate).
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time

from . import jobs, netns, report
from .modes import HEADLINE, describe, exchange_modes, hylo_options, mode, parse_modes

log = report.logger("comm")
DEFAULT_MODELS = ("resnet50_v1b", "vgg16", "alexnet")
CPU_BYTES_PER_S = 50e6          # codec and copy bound used in the time limits


def add_arguments(parser):
    netns.add_arguments(parser)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated gluoncv model names (default %(default)s)")
    parser.add_argument("--modes", default=",".join(HEADLINE),
                        help="comma-separated modes (default %(default)s) of: " + ", ".join(exchange_modes()))
    parser.add_argument("--steps", type=int, default=4, help="timed exchanges (default 4)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed exchanges after the store's start-up (default 1)")
    parser.add_argument("--grad-scale", type=float, default=0.01,
                        help="gradients are N(0, this) (default 0.01)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="input side of the forward that fixes the shapes (224)")
    parser.add_argument("--hylo-options", default="{}",
                        help="JSON object of mxhylo.create options for every hylo mode")
    parser.add_argument("--seed", type=int, default=0, help="seed of the gradients")


# ----------------------------------------------------------------------------- shapes

def block_shapes(net, image_size=224, channels=3):
    """[{'key', 'name', 'shape'}] of the parameters a Trainer exchanges (grad_req not
    'null'), keyed by their index in collect_params() as gluon.Trainer keys them."""
    import mxnet as mx
    net.initialize(mx.init.Zero(), force_reinit=False)
    net(mx.nd.zeros((1, channels, image_size, image_size)))
    return [{"key": i, "name": p.name, "shape": [int(d) for d in p.shape]}
            for i, p in enumerate(net.collect_params().values()) if p.grad_req != "null"]


def model_shapes(name, image_size=224):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gluoncv
        return block_shapes(gluoncv.model_zoo.get_model(name, pretrained=False), image_size)


def shapes_in_subprocess(models, image_size, timeout=600):
    """{model: shapes}, computed in a child python (MXNet's pool would keep the
    models' memory in this process for the whole run)."""
    code = ("import json; from mxhylo.bench.comm import model_shapes; "
            "print(json.dumps({m: model_shapes(m, %d) for m in %r}))" % (image_size,
                                                                        list(models)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=jobs.clean_env())
    if res.returncode != 0:
        raise SystemExit("could not get the model shapes:\n" + res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def numel(shape):
    return int(math.prod(int(d) for d in shape))


def model_summary(params, workers, servers, rate_bps):
    """Sizes of a model and the floors of its exchange at ``rate_bps``."""
    sizes = [numel(p["shape"]) for p in params]
    big = max(range(len(params)), key=sizes.__getitem__)
    dense = 4 * sum(sizes)
    return {"num_params": sum(sizes), "num_keys": len(params), "dense_bytes": dense,
            "largest_key": {"name": params[big]["name"], "shape": params[big]["shape"],
                            "fraction": sizes[big] / sum(sizes)},
            "dense_pull_floor_s": dense_pull_floor(dense, workers, servers, rate_bps),
            "ring_allreduce_floor_s": ring_allreduce_floor(dense, workers, rate_bps)}


def dense_pull_floor(dense_bytes, workers, servers, rate_bps):
    """Seconds the servers' links need to send every worker the dense model."""
    return dense_bytes * workers / float(servers) / (rate_bps / 8.0)


def ring_allreduce_floor(dense_bytes, workers, rate_bps):
    """Seconds a ring allreduce of the dense model needs: each worker sends 2 (W-1)/W."""
    return 2.0 * (workers - 1) / workers * dense_bytes / (rate_bps / 8.0)


def job_timeout(summary, workers, exchanges, compute_s=0.0, start_s=120.0):
    """Seconds for a job: start-up, a store's warm-up (40 exchanges), then per exchange
    6 dense-pull floors, the codecs' CPU bound and ``compute_s``."""
    return start_s + (exchanges + 40) * (6.0 * summary["dense_pull_floor_s"] + compute_s
                                         + workers * summary["dense_bytes"] / CPU_BYTES_PER_S)


# ----------------------------------------------------------------------------- summaries

def slowest(results, get, part="steps"):
    """Per timed step: the largest ``get(step)`` over the workers' ``part``."""
    n = min(len(r[part]) for r in results)
    return [max(get(r[part][i]) for r in results) for i in range(n)]


def wire_summary(before, after, exchanges):
    """Bytes per exchange from the counters {role: (tx, rx)} around ``exchanges``."""
    d = {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in before}
    per = float(max(exchanges, 1))

    def total(prefix, i):
        return sum(v[i] for r, v in d.items() if r.startswith(prefix)) / per
    return {"push_bytes_per_step": total("worker", 0), "pull_bytes_per_step": total("worker", 1),
            "server_tx_bytes_per_step": total("server", 0),
            "server_rx_bytes_per_step": total("server", 1),
            "per_role_per_step": {r: {"tx": v[0] / per, "rx": v[1] / per}
                                  for r, v in sorted(d.items())}}


def hylo_summary(results, exchanges):
    """hylo's own counts over the timed window, summed over the workers, per exchange;
    its seconds per phase per exchange, per worker; worker 0's whole stats."""
    out = {}
    for k in ("bytes_pushed", "bytes_pulled", "dense_bytes"):
        out[k + "_per_step"] = sum((r["stats"] or {}).get(k, 0)
                                   - (r["stats_before"] or {}).get(k, 0)
                                   for r in results) / float(max(exchanges, 1))
    timing = []
    for r in results:
        a, b = r["stats"] or {}, r["stats_before"] or {}
        sa, sb = a.get("steps") or 0, b.get("steps") or 0
        if a.get("timing") and sa > sb:
            timing.append({k: (v * sa - (b.get("timing") or {}).get(k, 0.0) * sb) / (sa - sb)
                           for k, v in a["timing"].items()})
    out["timing_per_step_s"] = timing or None
    out["worker0_stats"] = results[0]["stats"]
    return out


def summarise(results, counters, exchanges):
    secs = slowest(results, lambda s: s["seconds"])
    res = {"status": "ok", "seconds": statistics.median(secs), "seconds_steps": secs,
           "warmup_seconds": [max(r["warmup"][i] for r in results)
                              for i in range(min(len(r["warmup"]) for r in results))],
           "init_s": max(r["init_s"] for r in results),
           "startup_exchanges": max(r["startup_steps"] for r in results)}
    if counters.get("start") and counters.get("end"):
        res["wire"] = wire_summary(counters["start"], counters["end"], exchanges)
    if any(r["stats"] is not None for r in results):
        res["hylo"] = hylo_summary(results, exchanges)
    return res


# ----------------------------------------------------------------------------- run

def run(args):
    """One record per rate of --rate; with several rates, a sweep record of them."""
    try:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        modes = parse_modes(args.modes, exchange_modes())
        options = hylo_options(args.hylo_options)
        if not models or args.steps < 1 or args.warmup < 0:
            raise ValueError("need --models, --steps >= 1 and --warmup >= 0")
        for rate in args.rate.split(","):
            netns.topology(args, rate)
    except ValueError as err:
        raise SystemExit("mxhylo.bench comm: %s" % err)
    shapes = {}

    def at_rate(a):                     # the models' shapes once, after the checks
        if not shapes:
            shapes.update(shapes_in_subprocess(models, args.image_size))
        return run_rate(a, modes, options, shapes)
    return jobs.over_rates("comm", args, at_rate, log)


def run_rate(args, modes, options, shapes):
    W, S = args.workers, args.servers
    topo, rate_bps = netns.topology(args, args.rate), netns.parse_rate(args.rate)
    summaries = {m: model_summary(shapes[m], W, S, rate_bps) for m in shapes}
    out = report.new("comm", dict(
        report.options(args), models=list(shapes), modes=modes, hylo_options=options,
        tbf_burst_bytes=netns.tbf_burst_bytes(rate_bps)), notes=[
        "an emulated cluster: %d processes in network namespaces on one machine's %s "
        "cores, links shaped with tc; at high rates the CPU, not the link, is the bound"
        % (1 + S + W, os.cpu_count()),
        "seconds: median over the timed exchanges of the slowest worker's, after the "
        "store's start-up and the warm-up exchanges",
        "wire bytes: interface counters per exchange; push = workers' tx, pull = rx"])
    out.update(modes=describe(modes), models=summaries, results={})
    port = jobs.PS_PORT
    with jobs.Run(topo, args.keep_tmp, log) as run_:
        for model in shapes:
            per_mode = out["results"][model] = {}
            for m in modes:
                per_mode[m] = jobs.unavailable(m)
                if per_mode[m]:
                    continue
                cfg = {"task": "exchange", "mode": m, "workers": W, "servers": S,
                       "keys": [p["key"] for p in shapes[model]],
                       "shapes": [p["shape"] for p in shapes[model]],
                       "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
                       "grad_scale": args.grad_scale, "hylo_options": options}
                timeout = args.timeout or job_timeout(summaries[model], W,
                                                      args.steps + args.warmup)
                t0 = time.monotonic()
                got, per_mode[m] = run_.job(cfg, "%s-%s" % (model, m), timeout, port,
                                            worker_threads=0)
                port += 1
                if got:
                    r = per_mode[m] = summarise(got[0], got[1], args.steps)
                    r["job_seconds"] = time.monotonic() - t0
                    log("  %.3f s per exchange (job %.0f s)" % (r["seconds"], r["job_seconds"]))
            report.compare(per_mode, "seconds", ("dist_sync", "horovod_dense"))
    out["table"] = table(out)
    for line in out["table"]:
        log(line)
    return out


def table(out):
    lines = ["%-14s %-16s %9s %9s %8s %8s %10s %10s %10s" % (
        "model", "mode", "s/exch", "vs dsync", "vs hvd", "vs peer", "push MB", "pull MB",
        "hylo MB")]
    for model, per_mode in out["results"].items():
        for m, r in per_mode.items():
            if r.get("status") != "ok":
                lines.append("%-14s %-16s %s" % (model, m, r.get("status")))
                continue
            wire, hy = r.get("wire", {}), r.get("hylo", {})
            lines.append("%-14s %-16s %9.3f %9s %8s %8s %10s %10s %10s" % (
                model, m, r["seconds"], report.x(r.get("speedup_vs_dist_sync")),
                report.x(r.get("speedup_vs_horovod_dense")),
                report.x(r.get("speedup_vs_best_peer")),
                report.mb(wire.get("push_bytes_per_step")),
                report.mb(wire.get("pull_bytes_per_step")),
                report.mb(hy["bytes_pushed_per_step"] + hy["bytes_pulled_per_step"])
                if hy else "-"))
        peer = next((r.get("best_peer") for r in per_mode.values() if r.get("best_peer")), None)
        s = out["models"][model]
        lines.append("%-14s best peer %s; floors: dense pull %.3f s, ring %.3f s" % (
            model, peer, s["dense_pull_floor_s"], s["ring_allreduce_floor_s"]))
    return lines


def plot(out, path):
    if out["suite"].endswith("_sweep"):
        return report.plot_sweep(out, path)
    plt = report.pyplot()
    models, modes = list(out["results"]), out["config"]["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(modes)
    for j, m in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2.0) * width for i in range(len(models))]
        rs = [out["results"][model].get(m, {}) for model in models]
        secs = [r.get("seconds") or 0 for r in rs]
        push = [r.get("wire", {}).get("push_bytes_per_step", 0) / 1e6 for r in rs]
        pull = [r.get("wire", {}).get("pull_bytes_per_step", 0) / 1e6 for r in rs]
        bars = axes[0].bar(xs, secs, width, label=m)
        for x_, y, r in zip(xs, secs, rs):
            if not mode(m).peer and r.get("speedup_vs_best_peer"):
                axes[0].annotate(report.x(r["speedup_vs_best_peer"]), (x_, y), ha="center",
                                 va="bottom", fontsize=7)
        color = bars.patches[0].get_facecolor()
        axes[1].bar(xs, push, width, color=color, label=m + " push")
        axes[1].bar(xs, pull, width, bottom=push, color=color, alpha=0.45, hatch="//")
    for i, model in enumerate(models):
        for key, style in (("dense_pull_floor_s", "k--"), ("ring_allreduce_floor_s", "k:")):
            axes[0].plot([i - 0.45, i + 0.45], [out["models"][model][key]] * 2, style, lw=1,
                         label=key.replace("_s", "").replace("_", " ") if i == 0 else None)
    for ax in axes:
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
    axes[0].set_ylabel("seconds per exchange (median); labels: x the best peer")
    axes[1].set_ylabel("MB per exchange on the wire (push; hatched: pull)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    cfg = out["config"]
    report.save(fig, path, report.caption(out, "comm: %d workers, %d servers, %s links "
                                          "(emulated on one machine)" % (
                                              cfg["workers"], cfg["servers"], cfg["rate"])))


# ----------------------------------------------------------------------------- worker

POOL = (1 << 20) + 7      # odd: the tiles do not line up with power-of-two dimensions


def synthetic_gradients(shapes, scale, seed, pool=POOL):
    """N(0, scale) float32 arrays: a pool of ~1M normal draws tiled from a random offset
    per array (drawing every element of vgg16 on every worker took 18 s of CPU)."""
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(seed)
    values = rng.normal(0.0, scale, size=pool).astype(np.float32)
    twice = np.concatenate([values, values])
    out = []
    for shape in shapes:
        n, start = numel(shape), int(rng.randint(pool))
        flat = twice[start:start + n] if n <= pool else np.resize(np.roll(values, -start), n)
        out.append(mx.nd.array(flat.reshape(shape), dtype=np.float32))
    return out


def exchange_worker(cfg):
    import mxnet as mx
    from .modes import make_store
    from .worker import MAX_STARTUP_STEPS, FileSync, stats, steady
    kv, _ = make_store(cfg["mode"], cfg["hylo_options"])
    rank = kv.rank
    keys, shapes = [int(k) for k in cfg["keys"]], [tuple(s) for s in cfg["shapes"]]
    grads = synthetic_gradients(shapes, float(cfg["grad_scale"]), cfg["seed"] * 1000 + rank)
    params, outs = [mx.nd.full(s, 0.01) for s in shapes], [mx.nd.zeros(s) for s in shapes]
    sync = FileSync(cfg, rank)
    t0 = time.perf_counter()
    kv.broadcast(keys, params, out=params)
    mx.nd.waitall()
    init_s = time.perf_counter() - t0
    if mode(cfg["mode"]).store == "hylo":       # the whole step in one call, as a Trainer
        def exchange():
            kv.pushpull(keys, grads, out=outs)
    else:                                       # one call per key, as a Trainer
        def exchange():
            for k, g, o in zip(keys, grads, outs):
                kv.pushpull(k, g, out=o, priority=-k)

    def step():
        sync.barrier()
        start = time.perf_counter()
        exchange()
        mx.nd.waitall()
        return time.perf_counter() - start
    startup = 0
    while not steady(kv) and startup < MAX_STARTUP_STEPS:
        step()
        startup += 1
    warm = [step() for _ in range(cfg["warmup"])]
    before = stats(kv)
    sync.mark("start")
    timed = [{"seconds": step()} for _ in range(cfg["steps"])]
    sync.mark("end")
    return {"rank": rank, "init_s": init_s, "startup_steps": startup, "warmup": warm,
            "steps": timed, "stats_before": before, "stats": stats(kv)}
