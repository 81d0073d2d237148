"""mxhylo.ops: Hylo's gradient-compression operators.

Two implementations with one contract:
  * C++ (ops/src/hylo_ops.cc), registered with MXNet through its extension
    library API and compiled on first use for the ISA level $MXHYLO_ISA
    (default native; every level gives bitwise the same results, see
    mxhylo.ops.build);
  * an NDArray reference (mxhylo.ops.reference), the test oracle and the
    fallback for non-CPU contexts, for MXHYLO_OPS=reference, and when the
    library cannot be built or loaded (then one warning says why).

Every function here validates its arguments (TypeError for types/dtypes,
ValueError for shapes and values; metadata only, no engine sync) and then
dispatches: C++ for CPU arrays when backend() == 'cpp', the reference
otherwise. Arrays are mx.nd.NDArray; calls are asynchronous like any MXNet
operator.

Shared semantics: a = float32(grad) + residual. An element whose `a` is NaN or
Inf is counted in stats[1], emitted as 0 (code 0 / value 0) and leaves its
residual element unchanged; the caller is expected to raise on stats[1] > 0.

MXHYLO_OPS: 'auto' (default; C++ with reference fallback), 'cpp' (raise if
the library cannot be built), 'reference'. Read once, at first use.
"""
import os
import threading
import warnings

import mxnet as mx
import numpy as np

from . import _checks, _cpp, build, formats, reference

__all__ = ["backend", "quantize_2bit", "encode_2bit", "split_sections", "settle_2bit", "l1_stats", "dequantize_2bit",
           "select_kernels", "scatter_kernels", "momentum_velocity", "momentum_correct",
           "bound_rows", "sum_2bit", "decode_sums", "unpack_bytes", "pack_bytes",
           "decode_carried_2bit", "decode_gathered_2bit", "decode_carried_sums",
           "sum_carried_2bit", "host_view",
           "set_num_threads", "formats", "reference", "build"]

_lock = threading.Lock()
_backend = []  # [name] once resolved


def backend():
    """'cpp' or 'reference': the implementation used for CPU arrays.

    The first call builds/loads the C++ library (seconds the first time on a
    machine, then cached). On failure it warns once and returns 'reference'.
    """
    if _backend:
        return _backend[0]
    with _lock:
        if _backend:
            return _backend[0]
        mode = os.environ.get("MXHYLO_OPS", "auto").strip().lower() or "auto"
        if mode not in ("auto", "cpp", "reference"):
            raise ValueError("MXHYLO_OPS must be 'auto', 'cpp' or 'reference', got %r" % mode)
        name = "reference"
        if mode != "reference":
            try:
                build.load()
                name = "cpp"
            except build.BuildError as err:
                if mode == "cpp":
                    raise
                warnings.warn("mxhylo.ops: C++ operators unavailable, using the slower NDArray "
                              "reference: %s" % err, RuntimeWarning, stacklevel=3)
        _backend.append(name)
        return name


def _use_cpp(x):
    # cpu_pinned / cpu_shared memory is host memory too (dev_mask kCPU)
    return x.context.device_type.startswith("cpu") and backend() == "cpp"


def set_num_threads(n):
    """Kept for compatibility: the C++ kernels run on the calling MXNet engine
    thread (the library has no threads of its own, so none waits or spins on
    cores that forward and backward need). Returns 1 (0 for the reference)."""
    if backend() != "cpp":
        return 0
    return build.set_num_threads(n)


def quantize_2bit(grad, residual, threshold, value=None, pending=None, defer=False):
    """2-bit quantization with error feedback.

    grad: float32|float16, any shape, n elements. residual: float32, same
    shape, UPDATED IN PLACE. threshold: float > 0, rounded to float32 (t), decides
    which elements are sent. value: float > 0 rounded to float32 (v), the
    magnitude they are sent with; None (default): v = the mean |a| over the
    finite a with |a| >= t (t if there is none; float32 max if that sum
    overflows), so what is sent keeps those elements' L1 mass. value=threshold
    is Hylo's original code (v = t).
    a = grad + residual; q = +v if a >= t, -v if a <= -t, else 0; residual <- a - q.

    The default v is known only after every element has been read, and a
    residual <- a - q needs it: so by default the operator makes a second pass
    over the residual. defer=True leaves that subtraction owed instead
    (residual <- a, ONE pass over grad and residual: what a store that
    quantizes the same residual every step wants). Pay it with
    settle_2bit(codes, stats[2], residual), or, when that call saw no non-finite
    a (stats[1] == 0), let the next call on this residual pay it in its own pass:
    pending=(t, stats[2]) of that call. (Its sent elements are then exactly
    those with |residual| >= t, each owing +-v by its sign; where a was not
    finite the residual kept its old value, which owes nothing, so after such a
    call settle by the codes.) Either way the residual ends bitwise as the
    default's (r - q_prev, then + grad).
    pending: None, or (threshold, value) of an earlier defer=True call on this
    residual with stats[1] == 0: residual <- residual - q_prev first, in the same
    pass.

    Returns (codes, stats):
      codes int32 (ceil(n/16),): element i's code in bits 2*(i%16)..+1 of word
        i//16 (uint32 bits stored as int32); 0 -> 0, 1 -> +v, 2 -> -v, never 3;
        unused tail bits 0.
      stats float32 (3,): [sum of |a| over finite a, count of non-finite a, v];
        stats[0] / n is the mean |a| the caller adapts the next threshold from,
        stats[2] the value to decode with (dequantize_2bit). The C++ sums (of |a|,
        and of the sent |a| behind v) have one fixed order, the same in every ISA
        build (see kChunk in ops/src/hylo_ops.cc), so all builds return the same
        bits; the reference sums in another order (equal to ~1e-6 relative; with
        value=None its v, hence its residual, can differ from C++ by as much).
    A non-finite a keeps its (pending-paid) residual element and gets code 0.
    """
    t, text = _checks.threshold32(threshold, "quantize_2bit")
    v, vtext = (None, None) if value is None else _checks.threshold32(
        value, "quantize_2bit", what="value")
    _checks.grad_residual(grad, residual, "quantize_2bit")
    ptext = None
    if pending is not None:
        pending, ptext = _checks.pending(pending, "quantize_2bit")
    if _use_cpp(grad):
        return _cpp.quantize_2bit(grad, residual, text, vtext, ptext, bool(defer))
    return reference._quantize_2bit(grad, residual, float(t), None if v is None else float(v),
                                    pending, bool(defer))


def encode_2bit(grad, residual, threshold, value=None, velocity=None, momentum=None,
                velocity_out=None, bound=None):
    """A 2-bit layer's step of encoding as one operator: momentum correction's
    velocity, 2-bit quantization with error feedback, the residual's row bound.

    Bitwise the composition (one operator, two passes over memory instead of four
    operators and six or seven passes)::

        u = momentum_velocity(grad, velocity, momentum, out=velocity_out)  # if velocity
        codes, stats = quantize_2bit(u, residual, threshold, value)       # settled
        cut = bound_rows(residual, u, bound)   # if bound is given and stats[1] == 0

    grad: float32|float16, n elements. residual: float32, same shape, UPDATED IN
    PLACE. threshold, value: as quantize_2bit's (value None: the mean |a| of the
    elements sent). velocity: None (u = grad), or float32 of the shape (read only)
    with momentum a finite float (rounded to float32); velocity_out: where u goes
    (float32 of the shape, not ``velocity``; None: a new array). bound: None (no row
    bound) or a float >= 0 (rounded to float32): bound_rows's.

    Returns (codes, stats, u): codes int32 (ceil(n/16),) as quantize_2bit's; stats
    float32 (4,) = [sum |a| over finite a, count of non-finite a, the mean |a| of the
    elements sent (quantize_2bit's default value, reported also where ``value`` is
    given: the residual then owes ``value``), rows cut]; u the velocity (None without
    one). A non-finite a: the residual is settled as
    quantize_2bit leaves it and not bounded (stats[3] = 0).
    """
    a = _checks.encode_2bit(grad, residual, threshold, value, velocity, momentum,
                            velocity_out, bound)
    if _use_cpp(grad):
        return _cpp.encode_2bit(grad, residual, a.threshold_text, a.value_text, velocity,
                                a.momentum_text, velocity_out, a.bound_text)
    return reference._encode_2bit(grad, residual, a.threshold, a.value, velocity, a.momentum,
                                  velocity_out, a.bound)


def split_sections(x, offsets, outs):
    """Write the sections of a 1-D float32 array into ``outs``: outs[i] <- x[offsets[i]
    : offsets[i + 1]] (the last to the end), one asynchronous operator (MXNet's
    _split_v2 costs n times the number of sections). offsets: ascending ints from 0;
    outs: float32 1-D arrays of those sizes on x's device. Returns outs."""
    if not _use_cpp(x):
        return reference.split_sections(x, offsets, outs)
    # (the outputs are checked one by one only when MXNet's own check refuses them: a
    # bucket has a hundred, and their checks cost four times the copy)
    offsets = _checks.sections(x, offsets, outs, "split_sections", outputs=False)
    try:
        return _cpp.split_sections(x, offsets, outs)
    except mx.base.MXNetError:
        _checks.sections(x, offsets, outs, "split_sections")
        raise


def settle_2bit(codes, value, residual):
    """residual <- residual - q in place, q the decoded codes (0, +v, -v): what a
    quantize_2bit(..., defer=True) call left owed (any such call, non-finite a
    included). codes: int32 (ceil(n/16),);
    value: its stats[2]; residual: float32 of n elements. Bitwise the residual the
    call would have left without defer. Returns residual."""
    t, text = _checks.threshold32(value, "settle_2bit", what="value")
    _checks.codes(codes, residual.size, "settle_2bit")
    _checks.ndarray(residual, "residual", (np.float32,), "settle_2bit")
    if _use_cpp(codes):
        return _cpp.settle_2bit(codes, text, residual)
    return reference._settle_2bit(codes, float(t), residual)


def l1_stats(grad, residual):
    """float32 (2,) [sum |a| over finite a, count non-finite a] for a = grad + residual.

    Same as quantize_2bit's stats, without writing anything (first step's threshold).
    """
    _checks.grad_residual(grad, residual, "l1_stats")
    if _use_cpp(grad):
        return _cpp.l1_stats(grad, residual)
    return reference._l1_stats(grad, residual)


def dequantize_2bit(codes, value, shape, out=None, accumulate=False):
    """Decode quantize_2bit's codes to float32 of `shape` (values 0, +v, -v).

    codes: int32 (ceil(n/16),), n = prod(shape). value: the magnitude the codes
    were sent with (quantize_2bit's stats[2]; rounded to float32 the same way).
    shape: tuple of ints.
    out: optional float32 NDArray of `shape`: out[:] = decoded, or, with
    accumulate=True, out += decoded (a server sums several workers' payloads,
    each with its own threshold). Returns out, or a new array.
    """
    t, text = _checks.threshold32(value, "dequantize_2bit", what="value")
    shape = _checks.shape_tuple(shape, "dequantize_2bit")
    n = int(np.prod(shape))
    _checks.codes(codes, n, "dequantize_2bit")
    _checks.out_array(out, shape, codes.context, "dequantize_2bit")
    if _use_cpp(codes):
        return _cpp.dequantize_2bit(codes, text, shape, out, accumulate)
    return reference._dequantize_2bit(codes, float(t), shape, out, accumulate)


def select_kernels(grad, residual, k):
    """Top-k convolution kernels by norm, with error feedback.

    A kernel is one OUTPUT FILTER: row o of the weight viewed as (O, F),
    F = prod(shape[1:]) (1-D arrays: F = 1). MXNet's OIHW layout makes a filter
    one contiguous row, so selection is a row gather; and one int32 index per
    F values stays cheap even for 1x1 convolutions (most of resnet50's
    parameters), where per-(o, i) 2-D kernels would make the index as big as
    the values themselves.

    grad: float32|float16 (O, ...). residual: float32, same shape, UPDATED IN
    PLACE. k: int in [0, O].
    a = grad + residual; norm_o = L2 norm of row o of a (non-finite elements
    count 0); the k rows of largest norm are chosen, ties to the lower index.

    Returns (indices, values, stats):
      indices int32 (k,), ascending;
      values float32 (k, F): rows of a at indices (non-finite elements as 0);
      stats float32 (2,): [sum over all rows of norm_o^2, count of non-finite a].
    residual <- a with the chosen rows set to 0 (non-finite elements of a keep
    their old residual, chosen or not).
    """
    _checks.grad_residual(grad, residual, "select_kernels")
    k = _checks.k_in_range(k, grad.shape[0], "select_kernels")
    if _use_cpp(grad):
        return _cpp.select_kernels(grad, residual, k)
    return reference._select_kernels(grad, residual, k)


def scatter_kernels(indices, values, shape, out=None, accumulate=False):
    """Dense float32 array of `shape` from select_kernels' (indices, values).

    indices: int32 (k,), strictly increasing in [0, O) (as select_kernels
    emits them; the C++ op fails the call otherwise, before writing).
    values: float32 (k, F), F = prod(shape[1:]).
    out=None: new array, rows `indices` = values, others 0. out given:
    out[:] = that dense array, or, with accumulate=True, out[indices] += values
    (other rows untouched). Returns out, or the new array.
    """
    shape = _checks.shape_tuple(shape, "scatter_kernels")
    _checks.kernels(indices, values, shape, "scatter_kernels")
    _checks.out_array(out, shape, indices.context, "scatter_kernels")
    if _use_cpp(values):
        return _cpp.scatter_kernels(indices, values, shape, out, accumulate)
    return reference._scatter_kernels(indices, values, shape, out, accumulate)


def momentum_velocity(grad, velocity, momentum, out=None):
    """The momentum-corrected gradient of DGC: v = velocity * m + float32(grad).

    grad: float32|float16, any shape. velocity: float32, same shape (read
    only). momentum: finite float, rounded to float32 (m). out: optional
    float32 NDArray of the shape (may be `velocity` itself). One IEEE multiply
    then one add per element, never fused, so the bits equal MXNet's
    ``velocity * m + grad``; NaN and Inf propagate (which NaN, when both
    operands are NaN, is not specified). Returns out or a new array.
    """
    m, text = _checks.finite32(momentum, "momentum", "momentum_velocity")
    _checks.grad_residual(grad, velocity, "momentum_velocity", "velocity")
    _checks.out_array(out, grad.shape, grad.context, "momentum_velocity")
    if _use_cpp(grad):
        return _cpp.momentum_velocity(grad, velocity, text, out)
    return reference._momentum_velocity(grad, velocity, float(m), out)


def momentum_correct(aggregate, previous, factor):
    """What a momentum optimizer must receive after momentum-corrected sends.

    aggregate: float32, any shape, UPDATED IN PLACE to aggregate - previous * f.
    previous: float32, same shape, UPDATED IN PLACE to the old aggregate.
    factor: finite float, rounded to float32 (f). One IEEE multiply then one
    subtract per element, never fused (the bits of MXNet's ``a - p * f``);
    NaN and Inf propagate. Returns aggregate.
    """
    f, text = _checks.finite32(factor, "factor", "momentum_correct")
    _checks.ndarray(aggregate, "aggregate", (np.float32,), "momentum_correct")
    _checks.ndarray(previous, "previous", (np.float32,), "momentum_correct")
    _checks.same_shape("momentum_correct", ("aggregate", aggregate), ("previous", previous))
    if _use_cpp(aggregate):
        return _cpp.momentum_correct(aggregate, previous, text)
    return reference._momentum_correct(aggregate, previous, float(f))


def bound_rows(residual, grad, bound):
    """Cut each row of a residual to a bound set by the step's input, in place.

    residual: float32 (O, ...) (a 1-D array is one row), UPDATED IN PLACE: each row
    i over the bound is multiplied by float32(sqrt(b * b * su) / sqrt(sr)), where sr
    and su are the sums of squares of row i of residual and of grad, in double,
    element by element in order (every ISA build gives the same bits), and b is
    ``bound`` rounded to float32; a row whose grad row is zero is emptied, a row
    holding a NaN is left as it is. grad: float32|float16, the same shape (read
    only). Returns a (1,) float32 NDArray: the number of rows cut.
    """
    b, text = _checks.finite32(bound, "bound", "bound_rows")
    if b < 0:
        raise ValueError("bound_rows: bound must be >= 0, got %r" % (bound,))
    _checks.grad_residual(grad, residual, "bound_rows")
    if _use_cpp(residual):
        return _cpp.bound_rows(residual, grad, text)
    return reference._bound_rows(residual, grad, float(b))


def sum_2bit(codes, size):
    """The integer sums of W workers' 2-bit codes, packed for the way back (the
    servers' side of a shared-scale codec's 'sum' pull; format: mxhylo.ops.formats).

    codes: int32 (W, ceil(size/16)), row w the code words quantize_2bit gave worker
    w; 1 <= W <= 127. Code 1 counts +1, 2 counts -1, 0 and 3 count 0.
    size: the elements n the codes stand for.
    Returns uint8 (formats.packed_nbytes(size, W),): each element's sum in [-W, W],
    packed in base 2W + 1, digits_per_group(W) to a little-endian uint16; bitwise
    formats.pack_sums(formats.sum_codes(rows, size), W).
    """
    size = _checks.sum_codes(codes, size, "sum_2bit")
    if _use_cpp(codes):
        return _cpp.sum_2bit(codes, size)
    return reference._sum_2bit(codes, size)


def decode_sums(packed, scale, shape, num_workers, out=None):
    """float32 of `shape`: element i = float32(s_i) * v, rounded once, s_i the sums
    sum_2bit packed for ``num_workers`` workers.

    packed: uint8 (formats.packed_nbytes(n, W),), n = prod(shape). scale: float32
    NDArray whose first value is v (a pulled header, read where the op runs: no
    wait for it here). A uint16 group of (2W + 1) ** d or more is never written by
    sum_2bit: its elements decode as NaN. out: optional float32 NDArray of `shape`.
    Returns out, or a new array.
    """
    shape, w = _checks.decode_sums(packed, scale, shape, num_workers, out)
    if _use_cpp(packed):
        return _cpp.decode_sums(packed, scale, shape, w, out)
    return reference._decode_sums(packed, scale, shape, w, out)


def unpack_bytes(values, nbytes):
    """Bytes out of their float32 carriers (format: mxhylo.ops.formats.pack_bytes), row
    by row: float32 (m,) or (R, m), each row's first 4 * ceil(nbytes/15) values
    carrying nbytes bytes -> (uint8 (nbytes,) or
    (R, nbytes); float32 (R,) (R = 1 for 1-D values): per row, the values no
    pack_bytes writes (exponent field outside 1..64), whose bytes are garbage: the
    caller refuses a row that has any)."""
    nbytes = _checks.unpack_bytes(values, nbytes)
    if _use_cpp(values):
        return _cpp.unpack_bytes(values, nbytes)
    return reference._unpack_bytes(values, nbytes)


def pack_bytes(data, out=None):
    """formats.pack_bytes on the host, in C, on the calling thread: uint8 numpy (n,) ->
    float32 numpy carriers (formats.carrier_values(n),), 15 bytes in 4 values, written
    into ``out`` (a float32 numpy view of at least that many values) if given. Bitwise
    formats.pack_bytes (the reference backend calls it). Returns the carriers."""
    data = np.ascontiguousarray(data)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError("pack_bytes: data must be 1-D uint8, got %s %s"
                        % (data.dtype, data.shape))
    need = formats.carrier_values(len(data))
    if out is None:
        out = np.empty(need, np.float32)
    if out.dtype != np.float32 or out.ndim != 1 or len(out) < need \
            or not out.flags.c_contiguous:
        raise ValueError("pack_bytes: out must be contiguous float32 of at least %d values "
                         "to carry %d bytes" % (need, len(data)))
    if backend() != "cpp":
        out[:need] = formats.pack_bytes(data)
    elif len(data):
        build.pack_carriers(data, out)
    return out[:need]


class _HostMemory:
    """Memory at an address as numpy sees it (__array_interface__), holding its owner
    (an NDArray) alive as long as any array made from it."""
    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address, shape, dtype, owner):
        self.__array_interface__ = {"data": (address, False), "shape": tuple(shape),
                                    "typestr": dtype.str, "version": 3}
        self.owner = owner


def host_view(array, write=False, shape=None):
    """A CPU NDArray's own memory as a numpy array, no copy; None for an array elsewhere
    (a GPU's: the caller copies through the engine).

    A dense array: its elements, in its shape. A row_sparse array: its stored rows'
    values, in ``shape`` (the caller made it, so knows how many rows it stores).
    Waits first for the engine's pending writes of the array (with ``write``, its reads
    too), so that this thread may read (write) the view at once. The view is valid until
    the next engine operation on the array is issued, and keeps the NDArray alive. It is
    how the host-side functions below read a pulled buffer and write an aggregate or a
    push without asnumpy()'s copy and a fresh array (a worker's 2-bit decode wrote each
    of resnet50's 100 MB a step twice, the second time through newly faulted pages).
    """
    import ctypes
    from mxnet.base import _LIB, check_call
    if not array.context.device_type.startswith("cpu"):
        return None
    if array.stype == "default":
        shape = array.shape
    elif array.stype != "row_sparse" or shape is None:
        raise TypeError("host_view: a dense NDArray, or a row_sparse one with the shape of "
                        "its stored values, is needed; got storage %r" % array.stype)
    # (MXNet's Python API has no wait_to_write; its C API does)
    check_call((_LIB.MXNDArrayWaitToWrite if write else _LIB.MXNDArrayWaitToRead)(
        array.handle))
    address = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(address)))
    return np.asarray(_HostMemory(address.value, shape, np.dtype(array.dtype), array))


def decode_carried_2bit(slots, offset, size, out=None):
    """The workers' side of a 2-bit chunk's 'gather' pull, on host (numpy) arrays, on
    the calling thread: every worker's payload decoded and summed in rank order.

    slots: float32 numpy (W, m), row w worker w's slot as mxhylo.kvstore.wire.push_slot
    writes it: column 0 the value v_w its codes were sent with (quantize_2bit's
    stats[2]: finite and > 0), from column ``offset`` on the bytes of its 2-bit code
    words for ``size`` elements (4 * ceil(size/16) bytes) in float32 carriers
    (formats.pack_bytes). W >= 1.
    Returns (float32 numpy (size,): bitwise zeros, then dequantize_2bit(codes_w, v_w,
    accumulate=True) for w = 0 .. W-1, written into ``out`` if given (contiguous float32
    numpy (size,), for example a host_view); int64 numpy (W,): per row, the carrier
    values no pack_bytes writes: a row with any was altered on the way, and the sum is
    garbage). ValueError names a row whose v_w is not finite and > 0.
    One C++ pass, block by block, where the per-payload route took W unpackings,
    W copies into NDArrays and W engine operations.
    """
    slots = np.ascontiguousarray(slots, np.float32)
    size = _checks.positive_int(size, "size", "decode_carried_2bit")
    if slots.ndim != 2 or slots.shape[0] < 1:
        raise ValueError("decode_carried_2bit: slots must be (W, m) with W >= 1, got shape %s"
                         % (slots.shape,))
    code_bytes = 4 * _checks.num_words(size)
    if not 1 <= offset or offset + formats.carrier_values(code_bytes) > slots.shape[1]:
        raise ValueError("decode_carried_2bit: %d values from column %d (>= 1) carry the "
                         "codes of %d elements; the slots have %d columns"
                         % (formats.carrier_values(code_bytes), offset, size, slots.shape[1]))
    value = np.ascontiguousarray(slots[:, 0])
    for w, v in enumerate(value):
        if not (np.isfinite(v) and v > 0):
            raise ValueError("decode_carried_2bit: row %d was sent with value %r; a "
                             "2-bit payload's value is finite and > 0" % (w, float(v)))
    out = _checks.host_out(out, size, "decode_carried_2bit")
    bad = np.zeros(slots.shape[0], np.int64)
    if backend() != "cpp":
        total = out
        total[:] = 0
        rows = slots[:, offset:offset + formats.carrier_values(code_bytes)]
        for w, row in enumerate(rows):
            exponent = (row.view(np.uint32) >> 23) & 0xFF
            bad[w] = int(((exponent < 1) | (exponent > 64)).sum())
            words = formats.unpack_bytes(row, code_bytes, check=False).view(np.int32)
            total += formats.unpack_codes(words, size).astype(np.float32) * value[w]
        return total, bad
    build.decode_carried_2bit(slots, offset, value, size, out, bad)
    return out, bad


def decode_gathered_2bit(data, offsets, values, size, out=None):
    """The workers' side of an allgather of 2-bit payloads (the Horovod transport), on
    host (numpy) arrays, on the calling thread: every worker's payload decoded and
    summed in rank order, read where the gathered bytes hold it.

    data: uint8 numpy, the gathered bytes, its address a multiple of 4. offsets: ints
    (W,), W >= 1: worker w's 2-bit code words (quantize_2bit's, 16 codes a little-endian
    int32 word, 4 * ceil(size/16) bytes) start at data[offsets[w]], a multiple of 4.
    values: (W,), the value v_w each worker's codes were sent with (finite, > 0).
    Returns float32 numpy (size,): bitwise zeros, then dequantize_2bit(codes_w, v_w,
    accumulate=True) for w = 0 .. W-1, written into ``out`` if given (contiguous
    float32 numpy (size,), for example a host_view). ValueError names a misplaced
    offset or a value that is not finite and > 0.
    One C++ pass, block by block, where the per-payload route took W copies into
    NDArrays and W engine operations, each a pass over the layer.
    """
    data = np.asarray(data)
    size = _checks.positive_int(size, "size", "decode_gathered_2bit")
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous \
            or data.ctypes.data % 4:
        raise ValueError("decode_gathered_2bit: data must be contiguous 1-D uint8 at an "
                         "address that is a multiple of 4, got %s %s" % (data.dtype, data.shape))
    offsets = np.ascontiguousarray(offsets, np.int64).reshape(-1)
    value = np.ascontiguousarray(values, np.float32).reshape(-1)
    if len(offsets) < 1 or len(value) != len(offsets):
        raise ValueError("decode_gathered_2bit: one offset and one value per worker (W >= 1), "
                         "got %d and %d" % (len(offsets), len(value)))
    code_bytes = 4 * _checks.num_words(size)
    for w, (at, v) in enumerate(zip(offsets, value)):
        if at < 0 or at % 4 or at + code_bytes > len(data):
            raise ValueError("decode_gathered_2bit: worker %d's %d code bytes cannot start at "
                             "byte %d of %d (a multiple of 4 inside the data)"
                             % (w, code_bytes, at, len(data)))
        if not (np.isfinite(v) and v > 0):
            raise ValueError("decode_gathered_2bit: worker %d's codes were sent with value "
                             "%r; a 2-bit payload's value is finite and > 0" % (w, float(v)))
    out = _checks.host_out(out, size, "decode_gathered_2bit")
    if backend() != "cpp":
        out[:] = 0
        for at, v in zip(offsets, value):
            words = data[at:at + code_bytes].view(np.int32)
            out += formats.unpack_codes(words, size).astype(np.float32) * v
        return out
    build.decode_words_2bit(data, offsets, value, size, out)
    return out


def decode_carried_sums(values, scale, size, num_workers, out=None):
    """The workers' side of a 'sum' pull, on host (numpy) arrays, on the calling thread:
    what unpack_bytes then decode_sums compose to, bitwise, in one pass.

    values: float32 numpy (m,), the packed sums of ``size`` elements for
    ``num_workers`` workers (formats.packed_nbytes bytes) in float32 carriers
    (formats.pack_bytes) from values[0] on, as mxhylo.kvstore.wire.sum_values writes
    them after the header. scale: v, the shared value.
    Returns (float32 numpy (size,): float32(s_i) * v, one rounding, NaN for a group no
    sum_2bit writes, written into ``out`` if given (contiguous writable float32 numpy
    (size,), for example a host_view); int: the carrier values no pack_bytes writes, which
    must be 0: the sums are garbage otherwise).
    """
    values = np.ascontiguousarray(values, np.float32)
    size = _checks.positive_int(size, "size", "decode_carried_sums")
    workers = int(num_workers)
    if not 1 <= workers <= formats.MAX_WORKERS:
        raise ValueError("decode_carried_sums: num_workers must be in [1, %d], got %r"
                         % (formats.MAX_WORKERS, num_workers))
    nbytes = formats.packed_nbytes(size, workers)
    if values.ndim != 1 or len(values) < formats.carrier_values(nbytes):
        raise ValueError("decode_carried_sums: %d values carry the sums of %d elements of %d "
                         "workers; got shape %s" % (formats.carrier_values(nbytes), size,
                                                    workers, values.shape))
    out = _checks.host_out(out, size, "decode_carried_sums")
    v = np.float32(scale)
    if backend() == "cpp":
        return out, build.decode_carried_sums(values, size, workers, v, out)
    carriers = values[:formats.carrier_values(nbytes)]
    exponent = (carriers.view(np.uint32) >> 23) & 0xFF
    bad = int(((exponent < 1) | (exponent > 64)).sum())
    groups = formats.unpack_bytes(carriers, nbytes, check=False).view("<u2")
    d = formats.digits_per_group(workers)
    written = groups < (2 * workers + 1) ** d
    total = formats.unpack_sums(np.where(written, groups, 0).astype("<u2").view(np.uint8),
                                size, workers)
    out[:] = total.astype(np.float32) * v           # one rounding, as in C++
    out[~np.repeat(written, d)[:size]] = np.nan
    return out, bad


def sum_carried_2bit(slots, offset, size):
    """The servers' side of a 'sum' pull, on host (numpy) arrays, on the calling thread.

    slots: float32 numpy (W, m), row w worker w's slot: from column ``offset`` on, the
    bytes of its 2-bit code words for ``size`` elements (4 * ceil(size/16) bytes) in
    float32 carriers (formats.pack_bytes). 1 <= W <= 127.
    Returns (float32 numpy: sum_2bit's packed sums of the W rows' codes, carried as
    formats.pack_bytes carries them; int64 numpy (W,): per row, the carrier values no
    pack_bytes writes: a row with any was altered, and the sums are garbage).
    One C++ pass, block by block (no MXNet engine hand-off: a server calls it inside
    ps-lite's callback); formats' functions composed, bitwise, with the reference
    backend.
    """
    slots = np.ascontiguousarray(slots, np.float32)
    size = _checks.positive_int(size, "size", "sum_carried_2bit")
    if slots.ndim != 2 or not 1 <= slots.shape[0] <= formats.MAX_WORKERS:
        raise ValueError("sum_carried_2bit: slots must be (W, m), 1 <= W <= %d, got shape %s"
                         % (formats.MAX_WORKERS, slots.shape))
    code_bytes = 4 * _checks.num_words(size)
    if not 0 <= offset or offset + formats.carrier_values(code_bytes) > slots.shape[1]:
        raise ValueError("sum_carried_2bit: %d values from column %d carry the codes of %d "
                         "elements; the slots have %d columns"
                         % (formats.carrier_values(code_bytes), offset, size, slots.shape[1]))
    workers = slots.shape[0]
    if backend() != "cpp":
        rows = slots[:, offset:offset + formats.carrier_values(code_bytes)]
        exponent = (rows.view(np.uint32) >> 23) & 0xFF
        bad = ((exponent < 1) | (exponent > 64)).sum(axis=1).astype(np.int64)
        codes = [formats.unpack_bytes(r, code_bytes, check=False).view(np.int32)
                 for r in rows]
        packed = formats.pack_sums(formats.sum_codes(codes, size), workers)
        return formats.pack_bytes(packed), bad
    out = np.zeros(formats.carrier_values(formats.packed_nbytes(size, workers)), np.float32)
    bad = np.zeros(workers, np.int64)
    build.sum_carried_2bit(slots, offset, size, out, bad)
    return out, bad
