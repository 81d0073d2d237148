"""Compression operators: every ISA build of the C++ library vs memcpy, side by side.

One process can load only one build of the operator library into MXNet (the
operator names would clash), so each ISA level (--isa, default native,
x86-64-v3 = AVX2, x86-64 = the SSE2 baseline) is measured in a process of
its own, and the levels take turns: round 1 runs native, v3, baseline, round
2 again, ... (--rounds). Levels this CPU cannot run are reported as skipped,
naming the missing CPU features (an AVX-512 machine measures the AVX2 build
too: -march=x86-64-v3 has no AVX-512 instruction).

Figures are gradient GB/s: bytes of the dense float32 gradient a call stands
for (4 * size) over the median wall time of --repeats calls
(mx.nd.waitall() before and after each). memcpy GB/s is numpy's np.copyto of
a float32 array of the same size, timed right before each timed call, in the
same process: on a shared machine both see the same load, so the ratio
C++ / memcpy is the figure to read (a round's ratio is the median over its
call pairs of memcpy time / C++ time). Every round gives one ratio per
operator and level; the report gives their median and range (min-max). Kernels run on one thread (the library has no threads).

Operators and data: gradient ~ N(0, scale) float32 of --size elements
(default 16M), viewed as (size / F, F) filters for the kernel operators with
F = --filter (default 2304 = 256x3x3). quantize_2bit's threshold is the mean
|g| (as the kvstore's adaptive threshold), and it is timed as the store calls it:
paying the previous step's owed subtraction and leaving its own owed (pending=,
defer=True: one pass over gradient and residual); quantize_2bit_eager is the
call with nothing owed in or out (a second pass over the residual once the
value is known), settle_2bit that second pass alone; select_kernels keeps --topk of the
filters. dequantize_2bit writes into a preallocated `out` (as the server
does) and its accumulate variant adds into it; scatter_kernels accumulate
adds k filters into a dense array, so its "gradient GB/s" counts the whole
dense array it stands for, not the k rows it touches. The NDArray reference
is timed once, in the first round's native process.

Each process also quantizes, selects and dequantizes a fixed input with
edge values (NaN, Inf, zeros, an odd tail, fp16) and reports a digest of
every output: `outputs_identical` says whether all levels agreed bit for bit
(tests/test_ops.py checks this in detail).

--compute-rounds N (default 0: skip) answers "does a process that ran hylo's
operators compute slower afterwards?": gluoncv resnet50_v1b forward+backward
(64x64 input, batch 8, the shapes of 224) timed in a process that quantizes a
16M-element gradient before every step vs one that never loads the library,
both processes alive at once and taking turns step by step (so each pair of
steps sees the same load), N rounds of --compute-steps pairs: wall seconds
and CPU seconds (all threads) per step, the per-pair ratio; plus the process's thread count and the CPU time its threads
use while it sleeps for a second after the operators ran (a thread left
spinning would show in both).
"""
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from . import plot_path

DEFAULT_ISAS = "native,x86-64-v3,x86-64"
OPS = ("quantize_2bit", "quantize_2bit_fp16", "quantize_2bit_eager", "settle_2bit", "l1_stats",
       "dequantize_2bit", "dequantize_2bit_accumulate", "select_kernels",
       "scatter_kernels_accumulate")
# /proc/cpuinfo flags worth naming in a report (what the ISA levels and
# MXNet's oneDNN bf16 kernels use).
CPU_FLAGS_OF_INTEREST = (
    "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
    "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_bf16", "amx_tile")
CHILD_TIMEOUT_S = 900
YMAX = 2.0  # plot's axis limit in x memcpy (scatter accumulate touches only k rows: ~5-10x)


def add_arguments(parser):
    parser.add_argument("--size", type=int, default=16 * 2 ** 20,
                        help="gradient elements (default 16M = 64 MB of float32)")
    parser.add_argument("--isa", default=DEFAULT_ISAS,
                        help="comma-separated ISA levels of the library to measure, one "
                             "process each (default %s)" % DEFAULT_ISAS)
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per ISA level, taking turns (the spread is over these)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed calls per figure and round (median)")
    parser.add_argument("--ref-repeats", type=int, default=3,
                        help="timed calls for the (slow) reference path; 0 = skip it")
    parser.add_argument("--scale", type=float, default=0.01, help="gradient std")
    parser.add_argument("--filter", type=int, default=2304,
                        help="F, elements per filter for the kernel operators")
    parser.add_argument("--topk", type=float, default=0.1,
                        help="fraction of filters select_kernels keeps")
    parser.add_argument("--ops", default="all", help="comma-separated subset of %s" % (OPS,))
    parser.add_argument("--plot", help="PNG plot (default: beside --json, same name with .png)")
    parser.add_argument("--compute-rounds", type=int, default=0,
                        help="rounds of the forward+backward comparison (0 = skip)")
    parser.add_argument("--compute-steps", type=int, default=8,
                        help="timed resnet50_v1b steps per process of that comparison")


# ----------------------------------------------------------------------------- machine

def cpu_info():
    """Model name, the named feature flags (present or not), cores, ISA levels runnable."""
    from mxhylo.ops import build
    flags = build.cpu_flags()
    levels = {}
    for isa in build.ISA_LEVELS:
        missing = build.missing_features(isa)
        levels[isa] = "ok" if not missing else "missing " + ", ".join(missing)
    return {"model_name": build.cpu_model(),
            "flags": {f: f in flags for f in CPU_FLAGS_OF_INTEREST},
            "avx512_flags": sorted(f for f in flags if f.startswith("avx512")),
            "cpu_count": os.cpu_count(),
            "isa_levels": levels}


# ----------------------------------------------------------------------------- child side

def _timed(fn, sync):
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _median_seconds(fn, repeats, sync, interleave=None):
    """Median seconds of fn() over `repeats` calls after one warm-up call; with
    `interleave`, that function is timed right before each call and its median
    returned too (both see the same load)."""
    fn()
    sync()
    times, other = [], []
    for _ in range(repeats):
        if interleave is not None:
            other.append(_timed(interleave, lambda: None))
        times.append(_timed(fn, sync))
    if interleave is None:
        return statistics.median(times)
    ratio = statistics.median(o / t for o, t in zip(other, times))  # per call pair
    return statistics.median(times), statistics.median(other), ratio


def _cases(mx, ops, ref, n, cfg):
    """name -> (cpp callable, reference callable) on shared prepared inputs."""
    rng = np.random.RandomState(0)
    grad_np = (rng.randn(n) * cfg["scale"]).astype(np.float32)
    grad = mx.nd.array(grad_np)
    grad16 = grad.astype(np.float16)
    residual = mx.nd.zeros((n,))
    t = float(np.float32(np.abs(grad_np).mean()))
    codes, stats = ops.quantize_2bit(grad, mx.nd.zeros((n,)), t)
    owed = (t, float(stats.asnumpy()[2]))   # what the store's quantize pays each step
    out = mx.nd.zeros((n,))

    rows = n // cfg["filter"]
    shape = (rows, cfg["filter"])
    k = max(1, int(rows * cfg["topk"]))
    grad2d = mx.nd.array(grad_np[:rows * cfg["filter"]].reshape(shape))
    res2d = mx.nd.zeros(shape)
    indices, values, _ = ops.select_kernels(grad2d, mx.nd.zeros(shape), k)
    out2d = mx.nd.zeros(shape)

    def pair(fn):
        return (lambda: fn(ops), lambda: fn(ref))

    return {
        # the store's call (kvstore TwoBit): one pass, last step's debt paid, this one's owed
        "quantize_2bit": pair(
            lambda m: m.quantize_2bit(grad, residual, t, pending=owed, defer=True)),
        "quantize_2bit_fp16": pair(
            lambda m: m.quantize_2bit(grad16, residual, t, pending=owed, defer=True)),
        # nothing owed in or out: the value's second pass (= quantize, then settle_2bit)
        "quantize_2bit_eager": pair(lambda m: m.quantize_2bit(grad, residual, t)),
        "settle_2bit": pair(lambda m: m.settle_2bit(codes, owed[1], residual)),  # by codes
        "l1_stats": pair(lambda m: m.l1_stats(grad, residual)),
        "dequantize_2bit": pair(lambda m: m.dequantize_2bit(codes, t, (n,), out=out)),
        "dequantize_2bit_accumulate": pair(
            lambda m: m.dequantize_2bit(codes, t, (n,), out=out, accumulate=True)),
        "select_kernels": pair(lambda m: m.select_kernels(grad2d, res2d, k)),
        "scatter_kernels_accumulate": pair(
            lambda m: m.scatter_kernels(indices, values, shape, out=out2d, accumulate=True)),
    }, {"threshold": t, "kernel_shape": list(shape), "k": k}


def edge_digest(mx, ops):
    """sha256 over every output of the operators on a fixed input with edges."""
    rng = np.random.RandomState(7)
    h = hashlib.sha256()

    def add(*arrays):
        for a in arrays:
            h.update(np.ascontiguousarray(a.asnumpy()).tobytes())

    for n, dtype in [(1, np.float32), (17, np.float32), (100003, np.float32),
                     (100003, np.float16), (65536, np.float16)]:
        g = (rng.randn(n) * 0.5).astype(dtype)
        if n == 65536:  # every float16 bit pattern
            g = np.arange(65536, dtype=np.uint16).view(np.float16).copy()
        elif n > 16:
            g[[0, 5, n // 2, n - 1]] = [np.nan, np.inf, -np.inf, 0]
        r = (rng.randn(n) * 0.2).astype(np.float32)
        res = mx.nd.array(r)
        codes, stats = ops.quantize_2bit(mx.nd.array(g, dtype=dtype), res, 0.3)
        add(codes, res, stats, ops.l1_stats(mx.nd.array(g, dtype=dtype), mx.nd.array(r)))
        finite = mx.nd.array(np.nan_to_num(g, posinf=0, neginf=0), dtype=dtype)
        deferred = mx.nd.array(r)   # the store's chain: two deferred steps, then settled
        c1, s1 = ops.quantize_2bit(finite, deferred, 0.3, defer=True)
        c2, s2 = ops.quantize_2bit(finite, deferred, 0.3,
                                   pending=(0.3, float(s1.asnumpy()[2])), defer=True)
        add(c1, s1, c2, s2, deferred, ops.settle_2bit(c2, float(s2.asnumpy()[2]), deferred))
        add(ops.dequantize_2bit(codes, 0.3, (n,)))
        rows = max(1, n // 9)
        g2 = g[:rows * 9].reshape(rows, 9) if n >= 9 else g.reshape(n, 1)
        res2 = mx.nd.array(r[:g2.size].reshape(g2.shape))
        idx, vals, stats = ops.select_kernels(mx.nd.array(g2, dtype=dtype), res2,
                                              max(1, g2.shape[0] // 3))
        add(idx, vals, res2, stats, ops.scatter_kernels(idx, vals, g2.shape))
    return h.hexdigest()


def child_measure(cfg):
    """One process, one ISA level ($MXHYLO_ISA): every operator vs memcpy."""
    import mxnet as mx
    import mxhylo.ops as ops
    from mxhylo.ops import build, reference as ref

    if ops.backend() != "cpp":
        raise SystemExit("the C++ operators are unavailable (backend %r)" % ops.backend())
    n = int(cfg["size"])
    cases, setup = _cases(mx, ops, ref, n, cfg)
    src = np.random.RandomState(1).randn(n).astype(np.float32)
    dst = np.empty_like(src)
    gbytes = 4.0 * n / 1e9
    results = {}
    for name in cfg["ops"]:
        cpp_fn, ref_fn = cases[name]
        seconds, memcpy_seconds, ratio = _median_seconds(
            cpp_fn, cfg["repeats"], mx.nd.waitall, interleave=lambda: np.copyto(dst, src))
        results[name] = {"gbps": gbytes / seconds, "memcpy_gbps": gbytes / memcpy_seconds,
                         "over_memcpy": ratio}
        if cfg.get("reference") and cfg["ref_repeats"] > 0:
            results[name]["reference_gbps"] = gbytes / _median_seconds(
                ref_fn, cfg["ref_repeats"], mx.nd.waitall)
    return {"library": build.load(), "build_info": build.build_info(), "setup": setup,
            "results": results, "edge_digest": edge_digest(mx, ops)}


def _child_main():
    cfg = json.loads(sys.argv[1])
    if cfg["mode"] == "ops":
        out = child_measure(cfg)
    else:
        out = child_compute(cfg)
    print("RESULT " + json.dumps(out))


def _run_child(cfg, env_extra):
    env = dict(os.environ)
    env.pop("MXHYLO_OPS", None)
    env.update(env_extra)
    code = "from mxhylo.bench import ops; ops._child_main()"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=CHILD_TIMEOUT_S)
    out = proc.stdout.decode(errors="replace")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.decode(errors="replace") + out).strip().splitlines()[-5:]
        raise RuntimeError("benchmark process (%s) exited with status %d: %s" % (
            ", ".join("%s=%s" % kv for kv in env_extra.items()) or "default",
            proc.returncode, " | ".join(tail)))
    return json.loads(lines[-1][len("RESULT "):])


# ----------------------------------------------------------------------------- compute check

def _thread_cpu_seconds():
    """{tid: utime + stime in seconds} of this process's threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/stat" % tid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _process_cpu_seconds():
    """User + system CPU seconds of all the process's threads (microsecond resolution)."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_compute(cfg):
    """Serve resnet50_v1b forward+backward steps on request (stdin 'step' ->
    stdout 'STEP wall_s cpu_s'), with or without hylo's ops quantizing and
    dequantizing a 16M-element gradient before every step; 'idle' -> thread
    facts after a 1 s sleep; 'quit' ends. Returns the final facts."""
    import mxnet as mx
    from mxnet import autograd
    from gluoncv.model_zoo import get_model

    use_ops = cfg["with_ops"]
    net = get_model("resnet50_v1b", pretrained=False, classes=1000)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    x = mx.nd.random.uniform(shape=(8, 3, 64, 64))
    y = mx.nd.array(np.arange(8) % 1000)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    if use_ops:
        import mxhylo.ops as ops
        if ops.backend() != "cpp":
            raise SystemExit("the C++ operators are unavailable")
        n = 16 * 2 ** 20
        grad = mx.nd.random.normal(0, 0.01, shape=(n,))
        residual = mx.nd.zeros((n,))

    def hylo_work():
        if use_ops:
            codes, stats = ops.quantize_2bit(grad, residual, 0.008)
            ops.dequantize_2bit(codes, 0.008, (n,))
            stats.asnumpy()
        mx.nd.waitall()

    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        mx.nd.waitall()

    for _ in range(2):  # warm-up: allocations, oneDNN primitives
        hylo_work()
        step()
    print("READY", flush=True)
    facts = {}
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            hylo_work()
            cpu0 = _process_cpu_seconds()
            start = time.perf_counter()
            step()
            print("STEP %.6f %.6f" % (time.perf_counter() - start,
                                      _process_cpu_seconds() - cpu0), flush=True)
        elif cmd == "idle":
            hylo_work()
            before = _thread_cpu_seconds()
            time.sleep(1.0)
            after = _thread_cpu_seconds()
            facts = {"threads": len(after), "idle_cpu_s_during_1s_sleep": round(
                sum(after[t] - before[t] for t in after if t in before), 3)}
            print("IDLE " + json.dumps(facts), flush=True)
        elif cmd == "quit":
            break
    return facts


def _expect(proc, prefix):
    while True:
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            raise RuntimeError("compute-check process exited (status %s) before %r" % (
                proc.poll(), prefix))
        if line.startswith(prefix):
            return line[len(prefix):].strip()


def compute_check(args):
    """Both processes live at once and take turns step by step (the order swaps
    every step), so every pair of steps sees the same machine load."""
    code = "from mxhylo.bench import ops; ops._child_main()"
    env = dict(os.environ)
    env.pop("MXHYLO_OPS", None)
    procs = {}
    try:
        for with_ops in (True, False):
            cfg = {"mode": "compute", "with_ops": with_ops}
            procs[with_ops] = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(cfg)], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for proc in procs.values():
            _expect(proc, "READY")

        def ask(proc, cmd, prefix):
            proc.stdin.write((cmd + "\n").encode())
            proc.stdin.flush()
            return _expect(proc, prefix)

        wall = {True: [], False: []}
        cpu = {True: [], False: []}
        total = args.compute_rounds * args.compute_steps
        _log("compute check: %d step pairs" % total)
        for i in range(total):
            for with_ops in ((True, False) if i % 2 == 0 else (False, True)):
                w, c = ask(procs[with_ops], "step", "STEP ").split()
                wall[with_ops].append(float(w))
                cpu[with_ops].append(float(c))
        facts = {k: json.loads(ask(p, "idle", "IDLE ")) for k, p in procs.items()}
        for proc in procs.values():
            proc.stdin.write(b"quit\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ratios = [a / b for a, b in zip(wall[True], wall[False])]
    cpu_ratios = [a / b for a, b in zip(cpu[True], cpu[False]) if b > 0]
    # per round of --compute-steps pairs: the ratio of the median step times
    per_round = []
    for r in range(args.compute_rounds):
        sl = slice(r * args.compute_steps, (r + 1) * args.compute_steps)
        per_round.append(statistics.median(wall[True][sl]) / statistics.median(wall[False][sl]))
    med = statistics.median(ratios)
    q = sorted(ratios)
    return {
        "model": "resnet50_v1b, 8x3x64x64, forward+backward; the two processes alternate "
                 "step by step",
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "steps_each": total,
        "with_ops_median_s": round(statistics.median(wall[True]), 4),
        "without_ops_median_s": round(statistics.median(wall[False]), 4),
        "ratio_per_pair_median": round(med, 4),
        "ratio_per_pair_quartiles": [round(q[len(q) // 4], 4), round(q[(3 * len(q)) // 4], 4)],
        "ratio_per_round": [round(v, 4) for v in per_round],
        "within_5_percent": abs(med - 1.0) <= 0.05,
        "cpu_ratio_per_pair_median": round(statistics.median(cpu_ratios), 4),
        "cpu_within_5_percent": abs(statistics.median(cpu_ratios) - 1.0) <= 0.05,
        "with_ops_cpu_s_median": round(statistics.median(cpu[True]), 4),
        "without_ops_cpu_s_median": round(statistics.median(cpu[False]), 4),
        "threads_with_ops": facts[True]["threads"],
        "threads_without_ops": facts[False]["threads"],
        "idle_cpu_s_with_ops": facts[True]["idle_cpu_s_during_1s_sleep"],
        "idle_cpu_s_without_ops": facts[False]["idle_cpu_s_during_1s_sleep"],
    }


# ----------------------------------------------------------------------------- parent side

def _log(msg):
    print("[ops] " + msg, file=sys.stderr, flush=True)


def _spread(values, digits=3):
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "all": [round(v, digits) for v in values]}


def summarize(per_isa, wanted):
    """results[op][isa] = gbps / memcpy / ratio spreads over the rounds."""
    results = {}
    for name in wanted:
        results[name] = {}
        for isa, runs in per_isa.items():
            if not runs:
                continue
            gbps = [r["results"][name]["gbps"] for r in runs]
            memcpy = [r["results"][name]["memcpy_gbps"] for r in runs]
            ratio = [r["results"][name]["over_memcpy"] for r in runs]
            entry = {"gbps": _spread(gbps), "memcpy_gbps": _spread(memcpy),
                     "over_memcpy": _spread(ratio)}
            refs = [r["results"][name]["reference_gbps"] for r in runs
                    if "reference_gbps" in r["results"][name]]
            if refs:
                entry["reference_gbps"] = round(refs[0], 4)
                entry["over_reference"] = round(statistics.median(gbps) / refs[0], 1)
            results[name][isa] = entry
    return results


def write_plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in OPS if n in report["results"]]
    isas = [i for i in report["isa_levels"] if report["isa_status"][i] == "measured"]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / max(len(isas), 1)
    for j, isa in enumerate(isas):
        xs, med, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            entry = report["results"][name].get(isa)
            if not entry:
                continue
            r = entry["over_memcpy"]
            xs.append(i + (j - (len(isas) - 1) / 2.0) * width)
            med.append(r["median"])
            lo.append(r["median"] - r["min"])
            hi.append(r["max"] - r["median"])
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=isa)
        for x, m in zip(xs, med):  # the median, written at the foot of its bar
            ax.text(x, 0.03, "%.2f" % m, ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_ylim(0, YMAX + 0.25)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="memcpy (same process)")
    ax.axhline(0.4, color="r", lw=1, ls=":", label="0.4x memcpy")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("C++ / memcpy (median, bars: min-max over rounds)")
    ax.legend(fontsize=8)
    cpu = report["cpu"]
    feats = [f for f in ("avx2", "avx512f", "avx512bw", "f16c") if cpu["flags"].get(f)]
    ax.set_title("ops, %d elements, 1 thread, %d rounds; %s (%s)" % (
        report["size"], report["rounds"], cpu["model_name"], " ".join(feats)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    from mxhylo.ops import build

    wanted = list(OPS) if args.ops == "all" else [o for o in args.ops.split(",") if o]
    unknown = sorted(set(wanted) - set(OPS))
    if unknown:
        raise SystemExit("unknown operator(s) %s; choose from %s" % (unknown, list(OPS)))
    try:
        isas = [build.normalize_isa(i.strip()) for i in args.isa.split(",") if i.strip()]
    except build.BuildError as err:
        raise SystemExit(str(err))
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be >= 1")
    status, per_isa = {}, {isa: [] for isa in isas}
    for isa in isas:
        missing = build.missing_features(isa)
        status[isa] = "measured" if not missing else \
            "skipped: this CPU lacks " + ", ".join(missing)
        if missing:
            _log("%s: %s" % (isa, status[isa]))
    base = {"mode": "ops", "size": args.size, "repeats": args.repeats, "scale": args.scale,
            "filter": args.filter, "topk": args.topk, "ops": wanted,
            "ref_repeats": args.ref_repeats}
    first = {}
    for rnd in range(args.rounds):
        for isa in isas:
            if status[isa] != "measured":
                continue
            _log("round %d/%d: %s" % (rnd + 1, args.rounds, isa))
            cfg = dict(base, reference=(rnd == 0 and isa == isas[0]))
            out = _run_child(cfg, {"MXHYLO_ISA": isa})
            per_isa[isa].append(out)
            first.setdefault(isa, out)
    digests = {isa: sorted({r["edge_digest"] for r in runs}) for isa, runs in per_isa.items()
               if runs}
    all_digests = {d for ds in digests.values() for d in ds}
    results = summarize(per_isa, wanted)
    report = {
        "suite": "ops",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "size": args.size,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": 1,
        "cpu": cpu_info(),
        "isa_levels": isas,
        "isa_status": status,
        "build_info": {isa: first[isa]["build_info"] for isa in first},
        "library": {isa: first[isa]["library"] for isa in first},
        "setup": next(iter(first.values()))["setup"] if first else None,
        "results": results,
        "edge_digests": digests,
        "outputs_identical": len(all_digests) <= 1,
    }
    targets = {}
    for name in ("quantize_2bit", "quantize_2bit_fp16"):
        for isa, entry in results.get(name, {}).items():
            targets["%s %s over_memcpy>=0.4" % (name, isa)] = entry["over_memcpy"]["median"] >= 0.4
    report["targets"] = targets
    if args.compute_rounds > 0:
        report["compute_check"] = compute_check(args)
    plot = plot_path(args)
    if plot and first:
        write_plot(report, plot)
        report["plot"] = plot
    return report
