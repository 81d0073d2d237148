"""``python -m mxhylo.bench ops``: the compression operators of every ISA build of the
C++ library against memcpy, side by side.

Each ISA level (--isa: native, x86-64-v3 = AVX2, x86-64 = SSE2) is measured in a
process of its own (one process loads one build), the levels taking turns for
--rounds rounds; a level this CPU cannot run is reported as skipped, naming the
missing features. A figure is gradient GB/s: 4 * --size bytes over the median of
--repeats calls (mx.nd.waitall() around each), on one thread; memcpy is numpy's
copy of as many bytes timed right before each call in the same process, so the
ratio C++ / memcpy (the median over call pairs) is the figure to read on a shared
machine. The record gives per operator and level the median and range over the
rounds, and the NDArray reference's speed once.

encode_2bit is the store's call for a 2-bit layer under momentum SGD: the velocity,
quantization and the residual's row bound on (size / --filter, --filter) rows, one
operator, the velocity written into a spare; encode_2bit_parts is the same work as the
stages' four operators (momentum_velocity into a new array, quantize_2bit leaving its
subtraction owed, settle_2bit, bound_rows), bitwise the same results. quantize_2bit
pays a previous call's owed subtraction and leaves its own (one pass);
quantize_2bit_eager owes nothing (a second pass), settle_2bit is that pass alone;
select_kernels keeps --topk of the (size / --filter, --filter) filters; dequantize
writes into (or adds to) an output; scatter_kernels_accumulate counts the whole dense
array it stands for. Each process
also digests every operator's outputs on a fixed input with edge values (NaN, Inf,
zeros, an odd tail, float16): ``outputs_identical`` says whether all levels agree.
"""
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from . import report

log = report.logger("ops")

DEFAULT_ISAS = "native,x86-64-v3,x86-64"
OPS = ("encode_2bit", "encode_2bit_parts", "quantize_2bit", "quantize_2bit_fp16", "quantize_2bit_eager", "settle_2bit", "l1_stats",
       "dequantize_2bit", "dequantize_2bit_accumulate", "select_kernels",
       "scatter_kernels_accumulate")
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
    velocity = mx.nd.array(grad_np[:rows * cfg["filter"]].reshape(shape) * 3)
    spare = mx.nd.zeros(shape)

    def pair(fn):
        return (lambda: fn(ops), lambda: fn(ref))

    def encode(m):              # the store's 2-bit layer under momentum: one operator
        _, stats, _ = m.encode_2bit(grad2d, res2d, t, velocity=velocity, momentum=0.9,
                                    velocity_out=spare, bound=1.0)
        stats.asnumpy()         # (the store reads the stats: its value and the check)

    def encode_parts(m):        # the same work as the stages' own operators
        v = m.momentum_velocity(grad2d, velocity, 0.9)
        codes2d, stats = m.quantize_2bit(v, res2d, t, defer=True)
        m.settle_2bit(codes2d, float(stats.asnumpy()[2]), res2d)
        m.bound_rows(res2d, v, 1.0)

    return {
        "encode_2bit": pair(encode),
        "encode_2bit_parts": pair(encode_parts),
        # one pass: a previous call's debt paid, this one's owed
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
        rows = max(1, n // 9)   # the fused encode of a (rows, 9) layer with a velocity
        shaped = g[:rows * 9].reshape(rows, -1) if n >= 9 else g.reshape(n, 1)
        res2 = mx.nd.array(r[:shaped.size].reshape(shaped.shape) * 3)
        add(res2, *ops.encode_2bit(mx.nd.array(shaped, dtype=dtype), res2, 0.3,
                                   velocity=mx.nd.array(r[:shaped.size].reshape(shaped.shape)),
                                   momentum=0.9, bound=0.5))
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
    print("RESULT " + json.dumps(child_measure(json.loads(sys.argv[1]))))


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


# ----------------------------------------------------------------------------- parent side

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
            entry = {"gbps": report.spread(gbps), "memcpy_gbps": report.spread(memcpy),
                     "over_memcpy": report.spread(ratio)}
            refs = [r["results"][name]["reference_gbps"] for r in runs
                    if "reference_gbps" in r["results"][name]]
            if refs:
                entry["reference_gbps"] = round(refs[0], 4)
                entry["over_reference"] = round(statistics.median(gbps) / refs[0], 1)
            results[name][isa] = entry
    return results


def plot(out, path):
    if not out["results"] or not any(out["results"].values()):
        return
    plt = report.pyplot()
    names = [n for n in OPS if n in out["results"]]
    isas = [i for i in out["isa_levels"] if out["isa_status"][i] == "measured"]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / max(len(isas), 1)
    for j, isa in enumerate(isas):
        got = [(i, out["results"][n][isa]["over_memcpy"]) for i, n in enumerate(names)
               if isa in out["results"][n]]
        xs = [i + (j - (len(isas) - 1) / 2.0) * width for i, _ in got]
        med = [r["median"] for _, r in got]
        ax.bar(xs, med, width, capsize=3, label=isa,
               yerr=[[r["median"] - r["min"] for _, r in got],
                     [r["max"] - r["median"] for _, r in got]])
        for x_, m in zip(xs, med):
            ax.text(x_, 0.03, "%.2f" % m, ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_ylim(0, YMAX + 0.25)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="memcpy (same process)")
    ax.axhline(0.4, color="r", lw=1, ls=":", label="0.4x memcpy")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("C++ / memcpy (median, bars: min-max over rounds)")
    ax.legend(fontsize=8)
    cfg = out["config"]
    report.save(fig, path, report.caption(out, "ops: %d elements, 1 thread, %d rounds" % (
        cfg["size"], cfg["rounds"])))


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
        status[isa] = "skipped: this CPU lacks " + ", ".join(missing) if missing \
            else "measured"
        if missing:
            log("%s: %s" % (isa, status[isa]))
    base = {"size": args.size, "repeats": args.repeats, "scale": args.scale,
            "filter": args.filter, "topk": args.topk, "ops": wanted,
            "ref_repeats": args.ref_repeats}
    first = {}
    for rnd in range(args.rounds):
        for isa in [i for i in isas if status[i] == "measured"]:
            log("round %d/%d: %s" % (rnd + 1, args.rounds, isa))
            got = _run_child(dict(base, reference=(rnd == 0 and isa == isas[0])),
                             {"MXHYLO_ISA": isa})
            per_isa[isa].append(got)
            first.setdefault(isa, got)
    digests = {isa: sorted({r["edge_digest"] for r in runs}) for isa, runs in per_isa.items()
               if runs}
    results = summarize(per_isa, wanted)
    out = report.new("ops", dict(base, rounds=args.rounds, isa=isas, threads=1))
    out.update(isa_levels=isas, isa_status=status,
               build_info={isa: first[isa]["build_info"] for isa in first},
               library={isa: first[isa]["library"] for isa in first},
               setup=next(iter(first.values()))["setup"] if first else None,
               results=results, edge_digests=digests,
               outputs_identical=len({d for ds in digests.values() for d in ds}) <= 1,
               targets={"%s %s over_memcpy>=0.4" % (name, isa): e["over_memcpy"]["median"] >= 0.4
                        for name in ("quantize_2bit", "quantize_2bit_fp16")
                        for isa, e in results.get(name, {}).items()})
    return out
