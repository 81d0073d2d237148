"""Compression operators: C++ vs NDArray reference vs memcpy, side by side.

For each operator the figure is gradient GB/s: bytes of the dense float32
gradient the call stands for (4 * size) divided by the median wall time of
the call (mx.nd.waitall() before and after each timed call). memcpy GB/s is
numpy's np.copyto of a float32 array of the same size, timed right before
each timed C++ call (the machine may be shared: interleaving makes both see
the same load, so the ratio stays meaningful). The C++ path is timed for
each --threads value (0 = OpenMP's default: OMP_NUM_THREADS, else MXNet's
choice), and where the library has AVX-512 kernels (quantize, l1_stats,
select_kernels) also with them switched off (cpp_portable_gbps: the
auto-vectorised loops).
The ratios use the best C++ figure.

Operators and data: gradient ~ N(0, scale) float32 of --size elements
(default 16M), viewed as (size / F, F) filters for the kernel operators with
F = --filter (default 2304 = 256x3x3). quantize_2bit's threshold is the mean
|g| (as the kvstore's adaptive threshold); select_kernels keeps --topk of the
filters. dequantize_2bit writes into a preallocated `out` (as the server does)
and its accumulate variant adds into it; scatter_kernels accumulate adds k
filters into a dense array, so its "gradient GB/s" counts the whole dense
array it stands for, not the k rows it touches.
"""
import os
import statistics
import time

import numpy as np


# Operators with an AVX-512 kernel beside the portable loop: both are timed.
SIMD_OPS = ("quantize_2bit", "quantize_2bit_fp16", "l1_stats", "select_kernels")


def add_arguments(parser):
    parser.add_argument("--size", type=int, default=16 * 2 ** 20,
                        help="gradient elements (default 16M = 64 MB of float32)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per figure (median)")
    parser.add_argument("--ref-repeats", type=int, default=3,
                        help="timed calls for the (slow) reference path")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated C++ thread counts; 0 = OpenMP default")
    parser.add_argument("--scale", type=float, default=0.01, help="gradient std")
    parser.add_argument("--filter", type=int, default=2304,
                        help="F, elements per filter for the kernel operators")
    parser.add_argument("--topk", type=float, default=0.1,
                        help="fraction of filters select_kernels keeps")
    parser.add_argument("--ops", default="all", help="comma-separated subset of operators")


def _timed(fn, sync):
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _median_seconds(fn, repeats, sync, interleave=None):
    """Median seconds of fn() over `repeats` calls after one warm-up call.

    With `interleave`, that function is timed right before each call too and
    its median returned as well: on a shared machine both then see the same
    load, which keeps their ratio meaningful.
    """
    fn()  # warm-up: allocations, first-call costs
    sync()
    times, other = [], []
    for _ in range(repeats):
        if interleave is not None:
            other.append(_timed(interleave, lambda: None))
        times.append(_timed(fn, sync))
    if interleave is None:
        return statistics.median(times)
    return statistics.median(times), statistics.median(other)


def _cases(mx, ops, ref, n, args):
    """name -> (cpp callable, reference callable) on shared prepared inputs."""
    rng = np.random.RandomState(0)
    grad_np = (rng.randn(n) * args.scale).astype(np.float32)
    grad = mx.nd.array(grad_np)
    grad16 = grad.astype(np.float16)
    residual = mx.nd.zeros((n,))
    t = float(np.float32(np.abs(grad_np).mean()))
    codes, _ = ops.quantize_2bit(grad, mx.nd.zeros((n,)), t)
    out = mx.nd.zeros((n,))

    rows = n // args.filter
    shape = (rows, args.filter)
    k = max(1, int(rows * args.topk))
    grad2d = mx.nd.array(grad_np[:rows * args.filter].reshape(shape))
    res2d = mx.nd.zeros(shape)
    indices, values, _ = ops.select_kernels(grad2d, mx.nd.zeros(shape), k)
    out2d = mx.nd.zeros(shape)

    def pair(fn):
        return (lambda: fn(ops), lambda: fn(ref))

    return {
        "quantize_2bit": pair(lambda m: m.quantize_2bit(grad, residual, t)),
        "quantize_2bit_fp16": pair(lambda m: m.quantize_2bit(grad16, residual, t)),
        "l1_stats": pair(lambda m: m.l1_stats(grad, residual)),
        "dequantize_2bit": pair(lambda m: m.dequantize_2bit(codes, t, (n,), out=out)),
        "dequantize_2bit_accumulate": pair(
            lambda m: m.dequantize_2bit(codes, t, (n,), out=out, accumulate=True)),
        "select_kernels": pair(lambda m: m.select_kernels(grad2d, res2d, k)),
        "scatter_kernels_accumulate": pair(
            lambda m: m.scatter_kernels(indices, values, shape, out=out2d, accumulate=True)),
    }, {"threshold": t, "kernel_shape": list(shape), "k": k}


def run(args):
    import mxnet as mx
    import mxhylo.ops as ops
    from mxhylo.ops import reference as ref

    backend = ops.backend()
    if backend != "cpp":
        raise SystemExit("the C++ operators are unavailable (backend %r): nothing to compare"
                         % backend)
    n = int(args.size)
    threads = [int(x) for x in str(args.threads).split(",") if x.strip()]
    cases, setup = _cases(mx, ops, ref, n, args)
    wanted = list(cases) if args.ops == "all" else args.ops.split(",")
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        raise SystemExit("unknown operator(s) %s; choose from %s" % (unknown, sorted(cases)))
    src = np.random.RandomState(1).randn(n).astype(np.float32)
    dst = np.empty_like(src)
    gbytes = 4.0 * n / 1e9
    simd = ops.build.set_simd(True)  # True when the library has AVX-512 kernels

    results = {}
    for name in wanted:
        cpp_fn, ref_fn = cases[name]
        cpp, portable, memcpys = {}, {}, []
        for nt in threads:
            ops.set_num_threads(nt)
            seconds, memcpy_seconds = _median_seconds(
                cpp_fn, args.repeats, mx.nd.waitall, interleave=lambda: np.copyto(dst, src))
            cpp[str(nt)] = gbytes / seconds
            memcpys.append(gbytes / memcpy_seconds)
            if simd and name in SIMD_OPS:
                ops.build.set_simd(False)
                seconds, memcpy_seconds = _median_seconds(
                    cpp_fn, args.repeats, mx.nd.waitall, interleave=lambda: np.copyto(dst, src))
                ops.build.set_simd(True)
                portable[str(nt)] = gbytes / seconds
                memcpys.append(gbytes / memcpy_seconds)
        ops.set_num_threads(0)
        memcpy = statistics.median(memcpys)
        reference_gbps = gbytes / _median_seconds(ref_fn, args.ref_repeats, mx.nd.waitall)
        best = max(cpp.values())
        results[name] = {
            "cpp_gbps": {k: round(v, 3) for k, v in cpp.items()},
            "cpp_portable_gbps": {k: round(v, 3) for k, v in portable.items()} or None,
            "reference_gbps": round(reference_gbps, 4),
            "memcpy_gbps": round(memcpy, 3),
            "cpp_over_memcpy": round(best / memcpy, 3),
            "cpp_over_reference": round(best / reference_gbps, 1),
        }
    quant = results.get("quantize_2bit")
    return {
        "suite": "ops",
        "size": n,
        "repeats": args.repeats,
        "threads": threads,
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "library": ops.build.load(),
        "avx512_kernels": simd,
        "setup": setup,
        "results": results,
        "target_quantize_2bit": None if quant is None else {
            "cpp_over_memcpy>=0.4": quant["cpp_over_memcpy"] >= 0.4,
            "cpp_over_reference>=10": quant["cpp_over_reference"] >= 10,
        },
    }
