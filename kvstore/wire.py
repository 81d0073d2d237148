"""Wire layout of hylo payloads in MXNet parameter-server keys (shared by workers and servers).

MXNet's parameter server moves float32 arrays and sums what workers push. Hylo's
payloads are laid out so that this sum does exactly what Hylo's server must do:

* ``dense`` chunks (uncompressed layers): a plain dense key; the server's sum is the
  aggregate.
* ``rows`` chunks (conv_topk: a codec whose ``wire`` is 'rows'): a row_sparse key of shape (filters, F); a worker
  pushes only the rows of the filters it selected, so the bytes on the wire are the
  compressed size, and the server's sum of row_sparse pushes is the scatter-add
  decode of all workers' payloads.
* ``slots`` chunks (fc_2bit, fp16: any codec whose ``wire`` is 'slots',
  kvstore.codec): encoded bytes cannot be summed, so each worker owns a slot of
  ``slot_rows`` rows (worker w: rows [w * slot_rows, (w + 1) * slot_rows)) and pushes
  only those rows; the slots do not overlap, so the server's sum gathers every
  worker's payload unchanged, and the server-side decoder (kvstore.server) decodes
  each slot with the chunk's codec: first the payload's header scalars (fc_2bit: the
  worker's own threshold), then its bytes. Bytes travel 30 bits per float32 value (15
  two-bit codes), each value a normal float32 (pack_bytes): a normal number plus zero
  is itself, bit for bit, so adding the zeros of other slots cannot alter a payload,
  which raw bit patterns (NaN, denormals) could not promise.

The server stores what the workers pull as a row_sparse array whose rows are listed
explicitly from row 0 (zero rows included: MXNet's dense-to-row_sparse conversion would
drop them, and its pull reads rows by position); a worker pulls rows [0, pull_rows):

* ``pull='none'``: the chunk's dense float32 aggregate, row-major (dense_rows rows);
* ``pull='gather'`` (exact, no server state): the workers' payloads as the server's
  sum gathered them. A ``slots`` chunk: every worker's slot unchanged (rows [0,
  W * slot_rows)), which each worker decodes in rank order, exactly as the server
  would; a ``rows`` chunk: a header row block with the count u of filters any worker
  sent, then their u indices, then those u summed filters (pull_k = min(filters,
  W * k) rows are pulled; rows past u are zeros). The decoded aggregate is bitwise
  the dense pull's.
* ``pull='sum'`` (every 'slots' chunk of a shared-scale codec, kvstore.codec_shared,
  whatever pull was asked for): the header scalars summed over the workers in rank order (first
  the shared value v, which every worker pushed alike), then the integer sums of the
  workers' codes packed in base 2W + 1 (mxhylo.ops.formats), as pack_bytes writes bytes.
  Its size does not grow with W past log2(2W + 1) bits per element, and its decode
  v * sum is exact whatever order the pushes came in.

Every layout has its writer next to its reader here: pushes (``push_*``, read by the
servers' sum and by :func:`slot_payload`), pulls (``gather_values`` /
``gather_payloads``), and whole payloads as self-delimiting bytes for
collectives that gather without summing (``payload_blob`` / ``blob_payloads``:
kvstore.transport_horovod); the transports and the servers only move them.
"""
import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, NDArrayHandle, c_array, check_call

from .compressors import CODEC_NAMES, Payload, make_compressors
from .. import ops
from ..ops.formats import carrier_values, packed_nbytes, unpack_bytes

# the dense aggregate, the payloads gathered, or a shared-scale codec's integer sums
PULL_CODECS = ("none", "gather", "sum")

# Largest chunk, in gradient elements. MXNet splits keys of 1e6 elements or more over
# all servers by row ranges, which would cut workers' slots apart; hylo cuts large
# layers itself, into chunks it places on servers one by one (load balance), and lifts
# that bound for its own store (BIGARRAY_BOUND; kvstore.transport_ps) so that a
# 'gather' rows chunk of any size stays one key. Dense and slots chunks stay under
# 1e6 elements all the same: many pieces spread a large layer over the servers.
ROW_DATA = 1024                          # columns of a 2-bit chunk's rows
DEFAULT_CHUNK_ELEMENTS = 976 * ROW_DATA  # a whole number of rows, under 1e6
# Layers of at least this many elements are spread evenly over all servers.
DEFAULT_SPLIT_MIN = 1 << 18
BIGARRAY_BOUND = (1 << 31) - 1  # MXNET_KVSTORE_BIGARRAY_BOUND of hylo's store (an int): no split
PIECE_UNIT = 16               # pieces of a layer start at multiples of this (a 2-bit word)
# the codecs' layout facts (wire, scalars, byte spans; kvstore.codec), by strategy name
_CODECS = make_compressors()
CODEC_INDEX = {name: i for i, name in enumerate(CODEC_NAMES)}
ROW_ID_BYTES = 8              # row_sparse pushes and pulls carry int64 row ids


# kinds of key that hold the piece's float32 values as they are, flat
FLAT_KINDS = ("dense", "probe", "update", "mailbox", "load")


@dataclass(frozen=True)
class ChunkLayout:
    """One parameter-server key carrying a piece of one layer.

    kind: the codec's wire form, 'dense' | 'rows' | 'slots' (kvstore.codec); 'probe':
    the start-up check that a server decodes; 'update': a dense piece of a parameter
    whose optimizer runs on the servers (kvstore.server_route); 'mailbox' and 'load':
    windows of a server's optimizer state, read and loaded (kvstore.server).
    lo, hi: the piece, in elements of the flat layer for dense and slots, in filters
    for rows; size: elements of the piece; cols: row width; rows: rows of the key;
    slot_rows: rows per worker's slot (slots); slots: workers' slots (slots); codec:
    the codec of a slots chunk; dense_rows: rows of the dense aggregate; server: index
    of the server; pull: how the aggregate comes back (PULL_CODECS); pull_k: filters
    pulled per step at most (pull='gather' of a rows chunk); push_rows: rows a worker
    pushes per step at most (rows: its k filters that can fall in the chunk; slots:
    its slot).
    """
    kind: str
    lo: int
    hi: int
    size: int
    cols: int = 0
    rows: int = 0
    slot_rows: int = 0
    dense_rows: int = 0
    server: int = 0
    pull: str = "none"
    pull_k: int = 0
    slots: int = 0
    codec: str = ""
    push_rows: int = 0

    @property
    def offset(self):
        """First element of the piece in the flat layer."""
        return self.lo * self.cols if self.kind == "rows" else self.lo

    @property
    def key_shape(self):
        return (self.size,) if self.kind in FLAT_KINDS else (self.rows, self.cols)

    @property
    def rows_filters(self):
        """Filters in a rows chunk."""
        return self.hi - self.lo

    @property
    def pull_rows(self):
        """Rows a worker pulls: the payloads gathered, or the dense aggregate."""
        if self.pull == "sum":
            return -(-(_CODECS[self.codec].scalars
                       + carrier_values(packed_nbytes(self.size, self.slots))) // self.cols)
        if self.pull == "gather":
            if self.kind == "slots":
                return self.slots * self.slot_rows
            return -(-(1 + self.pull_k) // self.cols) + self.pull_k
        return self.dense_rows

    @property
    def wire_nbytes(self):
        """Bytes of this chunk one worker and its server exchange per step at most, both
        ways (what placing balances)."""
        if self.kind in FLAT_KINDS:
            return 8 * self.size
        pull_rows = self.dense_rows if self.pull == "none" else self.pull_rows
        return 4 * self.cols * (self.push_rows + pull_rows)


def _pieces(n, chunk_elements, num_servers, split_min, unit, wire_fraction=1.0):
    """Cut n units-aligned elements into near-equal pieces [(lo, hi)].

    At least ceil(n / chunk_elements) pieces; a layer that puts split_min elements or
    more on the wire per step (n * wire_fraction) is cut into a multiple of num_servers
    pieces, so that placing them one by one on the least-loaded server gives every
    server the same share of it. Smaller ones stay whole: every key costs a message
    each way per worker, and on few cores messages, not bytes, bound a small layer.
    """
    count = -(-n // chunk_elements)
    if n * wire_fraction >= split_min and num_servers > 1:
        count = -(-count // num_servers) * num_servers
    step = -(-n // count)
    step = -(-step // unit) * unit
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def plan_chunks(strategy, shape, num_workers, num_servers=1,
                chunk_elements=DEFAULT_CHUNK_ELEMENTS, split_min=DEFAULT_SPLIT_MIN,
                pull="none", pull_rate=None, push_k=None):
    """Split a layer into ChunkLayouts (server not yet assigned).

    pull: the way back (PULL_CODECS; 'none': the dense float32 aggregate);
    pull_rate: fraction of a conv_topk layer's filters each worker pushes per step;
    push_k: filters each worker pushes per step (conv_topk), which bounds a 'gather'
    pull to num_workers * push_k filters. A chunk whose gathered pull would not be
    smaller than its dense aggregate pulls dense.
    """
    if pull not in PULL_CODECS:
        raise ValueError("pull codec must be one of %s, got %r" % (PULL_CODECS, pull))
    n = int(np.prod(shape)) if shape else 1
    if _CODECS[strategy].wire == "rows":
        per_filter = n // shape[0]
        # the larger direction on the wire: pushes carry about ``rate`` of the filters
        # (up to the maximum rate, 0.1); pulls everything, or W times the pushes
        pull_fraction = {"none": 1.0,
                         "gather": min(1.0, num_workers * (pull_rate or 0.1))}[pull]
        wire_fraction = max(pull_fraction, pull_rate or 0.1)
        if pull == "gather":
            # one key: a gather pull carries at most W * push_k filters per key, so
            # every piece would pull that many (rows past the count are zeros) and p
            # pieces would pull p times the bound. Whole layers balance the servers well
            # enough, and the store's keys are never split by MXNet (its big-array
            # bound is lifted, kvstore.transport_ps).
            pieces = [(0, n)]
        else:
            pieces = _pieces(n, max(chunk_elements, per_filter), num_servers, split_min,
                             per_filter, wire_fraction)
        layouts = [ChunkLayout("rows", lo // per_filter, hi // per_filter, hi - lo,
                               cols=per_filter, rows=(hi - lo) // per_filter,
                               dense_rows=(hi - lo) // per_filter,
                               push_rows=min((hi - lo) // per_filter,
                                             push_k or (hi - lo) // per_filter))
                   for lo, hi in pieces]
    else:
        pieces = _pieces(n, chunk_elements, num_servers, split_min, PIECE_UNIT)
        codec = _CODECS[strategy]
        if codec.wire == "dense":
            return [ChunkLayout("dense", lo, hi, hi - lo) for lo, hi in pieces]
        layouts = []
        for lo, hi in pieces:
            size = hi - lo
            cols = min(ROW_DATA, size)
            # the header scalars, then the bytes
            slot_rows = -(-(codec.scalars + carrier_values(codec.byte_span(0, size)[1])) // cols)
            dense_rows = -(-size // cols)
            layouts.append(ChunkLayout("slots", lo, hi, size, cols=cols,
                                       rows=max(num_workers * slot_rows, dense_rows),
                                       slot_rows=slot_rows, dense_rows=dense_rows,
                                       slots=num_workers, codec=strategy,
                                       push_rows=slot_rows))
    return [_with_pull(c, pull, num_workers * (push_k or 0)) for c in layouts]


def _with_pull(chunk, pull, gather_k=0):
    if chunk.kind == "slots" and getattr(_CODECS[chunk.codec], "summable", False):
        # the servers add the codes: smaller than any gather, exact, and the one pull
        # that tells every worker the totals its shared scale comes from
        pull = "sum"
    if pull == "none":
        return chunk
    filters = chunk.hi - chunk.lo
    pull_k = 0
    if chunk.kind == "rows":
        # every worker sends at most push_k filters, all of which may fall in one chunk
        pull_k = min(filters, max(1, gather_k))
    compressed = dataclasses.replace(chunk, pull=pull, pull_k=pull_k)
    if compressed.pull_rows >= chunk.dense_rows:
        return chunk
    if chunk.kind == "slots":
        # the key holds the W slots and nothing else (no dense aggregate, no server
        # state): a key of the dense rows would keep a dense copy of the layer on its
        # server (rows are fixed by the key's initial value) and, until the key's first
        # push, on rank 0 (MXNet's store keeps the value it initialised a key with)
        return dataclasses.replace(
            compressed, rows=max(compressed.slots * compressed.slot_rows, compressed.pull_rows))
    return compressed


def flat(array):
    """A dense NDArray as 1-D: a view of the same memory, as array.reshape((-1,)), made
    without NDArray.reshape's Python checks (two np.prod each, 72 us against 8: a worker
    flattens about 380 arrays a step of resnet50's exchange)."""
    handle = NDArrayHandle()
    check_call(_LIB.MXNDArrayReshape64(array.handle, 1, _MINUS_ONE, False,
                                       ctypes.byref(handle)))
    return mx.nd.NDArray(handle=handle, writable=array.writable)


_MINUS_ONE = c_array(ctypes.c_int64, [-1])


# -- pushes: what one worker puts in a key; the servers' sum is their first reader ----

def row_sparse_push(layout, data, rows):
    """(row_sparse NDArray of the key, bytes on the wire) of float32 ``data`` (numpy or
    NDArray, len(rows) * cols values) in rows ``rows`` (numpy or NDArray, integers) of
    ``layout``'s key."""
    if isinstance(data, np.ndarray):
        data = mx.nd.array(data.reshape(len(rows), layout.cols))
    else:
        data = data.reshape((len(rows), layout.cols))
    if isinstance(rows, np.ndarray):
        rows = mx.nd.array(rows, dtype=np.int64)
    elif rows.dtype != np.int64:
        rows = rows.astype(np.int64)
    value = mx.nd.sparse.row_sparse_array((data, rows), shape=layout.key_shape)
    return value, len(rows) * (4 * layout.cols + ROW_ID_BYTES)


@functools.lru_cache(maxsize=4096)
def row_range(first, count):
    """int64 NDArray [first, first + count): a slot's (or an empty push's) row ids, the
    same at every step. Only read (row_sparse_array copies them), so one array serves
    every push: saves an NDArray made from numpy per push, 0.4 -> 0.23 ms a slot."""
    return mx.nd.arange(first, first + count, dtype=np.int64, ctx=mx.cpu())


def empty_push(layout):
    """A push that adds nothing: one all-zero row. Sync mode waits for every worker's
    push of a key, so a worker with nothing for it (no filter in this chunk; a
    checkpoint's trigger) pushes this."""
    return row_sparse_push(layout, np.zeros(layout.cols, np.float32), row_range(0, 1))


def push_slot(layout, rank, data, scalars, into=None):
    """Worker ``rank``'s push of a 'slots' chunk: its slot (rows [rank * slot_rows,
    (rank + 1) * slot_rows)) holding the payload's header ``scalars``, then the chunk's
    bytes ``data`` (uint8 numpy, the codec's byte_span of the chunk) as
    ops.formats.pack_bytes writes them (ops.pack_bytes: in C, straight into the slot).
    Read by :func:`slot_payload`. Returns (row_sparse NDArray, bytes on the wire).

    into: the array a previous push_slot of the same layout and rank returned, reused:
    the slot is written in its memory (ops.host_view waits until the last push has
    read it) instead of a new array made from numpy and copied twice (resnet50: 1.7 MB
    of slots a step per worker, in 90 keys)."""
    count = layout.slot_rows * layout.cols
    values = None if into is None else ops.host_view(into, write=True, shape=(count,))
    if values is None:              # (nothing to reuse, or no host memory: a new array)
        into, values = None, np.zeros(count, np.float32)
    values[:len(scalars)] = scalars
    ops.pack_bytes(data, out=values[len(scalars):])
    nbytes = layout.slot_rows * (4 * layout.cols + ROW_ID_BYTES)
    if into is not None:
        return into, nbytes
    return row_sparse_push(layout, values, row_range(rank * layout.slot_rows, layout.slot_rows))


def slot_payload(layout, slot):
    """One worker's slot of a 'slots' chunk (float32 values, slot_rows * cols or fewer:
    header scalars, then bytes) -> its Payload of the chunk's codec."""
    codec = _CODECS[layout.codec]
    n = codec.scalars
    data = unpack_bytes(slot[n:], codec.byte_span(0, layout.size)[1])
    return codec.piece_payload(data, slot[:n], layout.size)


def push_rows(layout, indices, values):
    """A worker's push of a 'rows' chunk: ``indices`` (int32 NDArray, ascending, the
    chunk's filters in layer numbering) and their rows ``values`` (float32 NDArray,
    (len, ...)) -> rows of the key; the servers' sum is the scatter-add decode."""
    if not indices.shape[0]:
        return empty_push(layout)
    rows = indices if layout.lo == 0 else indices - layout.lo
    return row_sparse_push(layout, values.reshape((values.shape[0], -1)), rows)


def rows_from_zero(layout, values):
    """``values`` (NDArray or numpy, row-major; a whole key or fewer rows, the last one
    padded with zeros) as a row_sparse array of ``layout``'s key whose rows are listed
    explicitly from row 0, zero rows included: MXNet's dense-to-row_sparse conversion
    would drop them, and a pull reads rows by position. What a server stores for the
    workers to pull, and a key's initial value."""
    cols = layout.cols
    n_rows = -(-int(np.prod(values.shape)) // cols)
    if isinstance(values, np.ndarray):
        padded = np.zeros(n_rows * cols, np.float32)
        padded[:values.size] = values.reshape(-1)
        values = mx.nd.array(padded)
    return mx.nd.sparse.row_sparse_array(
        (values.reshape((n_rows, cols)), mx.nd.arange(n_rows, dtype=np.int64)),
        shape=layout.key_shape)


# -- pulls: what the servers store for the workers to pull, and its reader -----------

def gather_values(layout, received):
    """The server's side of a 'gather' pull: the summed pushes (row_sparse NDArray of
    the key) -> what the workers pull, as an NDArray or numpy array of pull_rows rows."""
    if layout.kind == "slots":
        # every worker pushed all rows of its slot: the sum lists rows 0 .. W*slot_rows-1
        return received.data
    indices = received.indices.asnumpy()
    rows = received.data.asnumpy()
    used = np.abs(rows).sum(axis=1) != 0  # a worker with no filter here pushed a zero row
    indices, rows = indices[used], rows[used]
    if len(indices) > layout.pull_k:
        raise ValueError("key of %s: %d filters pushed, more than the %d a gather pull "
                         "carries" % (layout, len(indices), layout.pull_k))
    out = np.zeros(layout.pull_rows * layout.cols, np.float32)
    out[0] = len(indices)
    out[1:1 + len(indices)] = indices
    head = -(-(1 + layout.pull_k) // layout.cols) * layout.cols
    out[head:head + rows.size] = rows.reshape(-1)
    return out


def sum_payloads(payloads, size):
    """The workers' Payloads of a shared-scale codec (rank order), ``size`` elements ->
    (header: their scalars summed in rank order and rounded to float32, but the first,
    the shared value v, which they all carry; uint8 NDArray: the sums of their codes,
    packed as ops.sum_2bit packs them). What a 'sum' pull carries, on the servers and
    in Horovod's gathered payloads alike. Raises ValueError if the workers' shared
    values differ."""
    header = sum_headers([p.scalars for p in payloads])
    codes = mx.nd.stack(*[p.arrays[0] for p in payloads]) if len(payloads) > 1 \
        else payloads[0].arrays[0].reshape((1, -1))
    return header, ops.sum_2bit(codes, size)


def sum_headers(scalars):
    """The header of a 'sum' pull from the workers' header ``scalars`` (rank order):
    each summed in rank order in float64, rounded to float32, but the first, the
    shared value v, which every worker must carry alike (ValueError otherwise)."""
    values = {s[0] for s in scalars}
    if len(values) != 1:
        raise ValueError("the workers quantized with different shared values %s: their "
                         "codes cannot be summed" % sorted(values))
    header = np.zeros(len(scalars[0]), np.float64)
    for s in scalars:
        header += s
    header[0] = scalars[0][0]
    return tuple(float(v) for v in header.astype(np.float32))


def decode_sums(header, packed, shape, num_workers, out=None):
    """The aggregate of a 'sum' pull from its header (a tuple, v first) and its packed
    sums (uint8 NDArray): float32 v * sum of each element, rounded once
    (ops.decode_sums), of ``shape``, into ``out`` if given."""
    scale = mx.nd.array(header[:1], ctx=packed.context, dtype=np.float32)
    return ops.decode_sums(packed, scale, shape, num_workers, out=out)


def sum_values(layout, received):
    """The server's side of a 'sum' pull: the summed pushes (row_sparse NDArray of the
    key, whose rows the server checked are every worker's whole slot in order) -> what
    the workers pull (float32 numpy (pull_rows * cols,), see the module docstring).
    Read by :func:`summed_aggregate`. ValueError naming the worker whose slot holds a
    value pack_bytes never writes, or if the shared values differ."""
    n = _CODECS[layout.codec].scalars
    # every worker pushed all rows of its slot: the sum stores rows 0 .. W*slot_rows-1,
    # read in place (a row_sparse array's .data is a copy)
    slots = ops.host_view(received, shape=(layout.slots * layout.slot_rows, layout.cols))
    if slots is None:
        slots = received.data.asnumpy()
    slots = slots.reshape(layout.slots, layout.slot_rows * layout.cols)
    header = sum_headers([tuple(float(v) for v in row[:n]) for row in slots])
    # every worker's code bytes unpacked, summed and packed in one C++ pass
    carried, bad = ops.sum_carried_2bit(slots, n, layout.size)
    if bad.any():
        raise ValueError("worker rank %d's payload: a slot payload value is not one "
                         "pack_bytes writes (%d of them): the payload was altered on the way"
                         % (int(np.flatnonzero(bad)[0]), int(bad.max())))
    out = np.zeros(layout.pull_rows * layout.cols, np.float32)
    out[:n] = header
    out[n:n + len(carried)] = carried
    return out


def summed_aggregate(layout, values, out=None):
    """The workers' side of a 'sum' pull: pulled float32 values (pull_rows * cols,) ->
    (the aggregate, float32 NDArray (size,), written into ``out`` if given; the header,
    v first, (scalars,); how many pulled values pack_bytes never writes, which must be
    0). Read the header and the count with :func:`agreed_header`.

    Values in host memory (numpy, a host_view of the pull) are decoded on the calling
    thread in one pass (ops.decode_carried_sums; header numpy, count int). An NDArray's
    are decoded by operators in MXNet's engine once the pull has landed: nothing waits
    here (header and count NDArrays)."""
    n = _CODECS[layout.codec].scalars
    nbytes = packed_nbytes(layout.size, layout.slots)
    if isinstance(values, np.ndarray):
        if out is None:
            out = mx.nd.zeros((layout.size,), dtype=np.float32)
        header = np.array(values[:n], np.float32)
        view = ops.host_view(out, write=True)
        decoded, bad = ops.decode_carried_sums(values[n:], header[0], layout.size,
                                               layout.slots, out=view)
        if view is None:                        # a GPU's array: one copy through MXNet
            out[:] = decoded
        return out, header, bad
    header = values[:n]
    packed, bad = ops.unpack_bytes(values[n:n + carrier_values(nbytes)], nbytes)
    aggregate = ops.decode_sums(packed, header, (layout.size,), layout.slots, out=out)
    return aggregate, header, bad


def agreed_header(name, header, bad):
    """summed_aggregate's header and count, read once the pull has landed -> the header
    as a tuple of floats. ValueError naming layer ``name`` if a pulled value was not
    one pack_bytes writes (its aggregate would be garbage)."""
    if isinstance(bad, mx.nd.NDArray):
        header, bad = header.asnumpy(), bad.asscalar()
    if bad:
        raise ValueError("layer %r: %d pulled values of its 'sum' pull are not ones "
                         "pack_bytes writes: the pull was altered on the way" % (name, bad))
    return tuple(float(v) for v in header)


def gathered_slots(layout, values):
    """A 'slots' chunk's 'gather' pull: pulled float32 values (pull_rows * cols,),
    numpy or NDArray -> float32 numpy (W, slot_rows * cols), row w worker w's slot
    (read by the codec's decode_slots, or slot by slot by :func:`slot_payload`). A CPU
    NDArray's values are read in place (ops.host_view): the view is valid until the next
    pull into them."""
    if isinstance(values, mx.nd.NDArray):
        view = ops.host_view(values)
        values = values.asnumpy() if view is None else view
    per_slot = layout.slot_rows * layout.cols
    return values[:layout.slots * per_slot].reshape(layout.slots, per_slot)


def gather_payloads(layout, values):
    """The workers' side of a 'gather' pull: pulled float32 values (pull_rows * cols,),
    numpy or NDArray -> the Payloads whose decodes, accumulated in order, are the
    chunk's aggregate. From an NDArray, a 'rows' chunk reads only its header (count and
    filter indices) to the host; the filters' values stay where they were pulled (the
    payload's values are a view of ``values``)."""
    if layout.kind == "slots":
        return [slot_payload(layout, slot) for slot in gathered_slots(layout, values)]
    head = -(-(1 + layout.pull_k) // layout.cols) * layout.cols
    header = values[:head]
    if isinstance(header, mx.nd.NDArray):
        header = header.asnumpy()
    count = int(header[0])
    if count == 0:
        return []
    indices = mx.nd.array(header[1:1 + count], dtype=np.int32)
    rows = values[head:head + count * layout.cols]
    rows = rows.reshape((count, layout.cols)) if isinstance(rows, mx.nd.NDArray) \
        else mx.nd.array(rows.reshape(count, layout.cols))
    return [Payload("conv_topk", (layout.rows_filters, layout.cols), (indices, rows))]


# -- blobs: a whole payload as bytes, for collectives that gather bytes unsummed -------
#
# Horovod's allgather (kvstore.transport_horovod) concatenates every worker's uint8
# array in rank order, whatever their lengths. A blob is self-delimiting, so the
# concatenation is read back blob by blob without knowing the workers' sizes:
#
#   4 uint32 (little-endian): blob bytes (header included, a multiple of 4), the
#   codec's index in CODEC_NAMES, header scalars s, rows k ('rows' codecs, else 0);
#   s float32 scalars; then the codec's body: 'dense' the float32 values; 'rows' the
#   k int32 indices, then the k rows of float32 values; 'slots' the codec's to_bytes;
#   zero bytes up to a multiple of 4.

BLOB_HEADER_BYTES = 16


@dataclass
class Blob:
    """One worker's payload read back from a concatenation of blobs, and the bytes
    its blob took there (header and padding included)."""
    payload: Payload
    nbytes: int


def payload_blob(payload):
    """One worker's Payload -> its blob (uint8 numpy, a multiple of 4 bytes). Read by
    :func:`blob_payloads`."""
    codec = _CODECS[payload.strategy]
    k = 0
    if codec.wire == "dense":
        body = [payload.arrays[0].asnumpy().astype(np.float32, copy=False).reshape(-1)]
    elif codec.wire == "rows":
        indices, values = (a.asnumpy() for a in payload.arrays)
        k = len(indices)
        body = [indices.astype(np.int32, copy=False),
                values.astype(np.float32, copy=False).reshape(-1)]
    else:
        body = [np.asarray(codec.to_bytes(payload), np.uint8)]
    parts = [np.asarray(payload.scalars, np.float32)] + body
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in parts]
    n = BLOB_HEADER_BYTES + sum(len(a) for a in parts)
    total = n + (-n) % 4
    header = np.array([total, CODEC_INDEX[payload.strategy], len(payload.scalars), k],
                      "<u4").view(np.uint8)
    blob = np.zeros(total, np.uint8)
    blob[:n] = np.concatenate([header] + parts)
    return blob


@dataclass
class BlobSpan:
    """Where one worker's blob lies in a concatenation: its codec (a name of
    CODEC_NAMES), header scalars (floats), rows k ('rows' codecs, else 0), the byte
    offset of its body (after the scalars; a multiple of 4) and the blob's bytes."""
    strategy: str
    scalars: tuple
    k: int
    body_at: int
    nbytes: int


def blob_spans(data, shape):
    """The blobs of one layer of ``shape``, concatenated (uint8 numpy, as an allgather
    returns them) -> a BlobSpan per worker, in order, each body checked to hold what
    its codec needs for the layer; nothing copied. ValueError naming the byte of a
    truncated or corrupt blob."""
    data = np.asarray(data, np.uint8).reshape(-1)
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape)) if shape else 1
    spans, at = [], 0
    while at < len(data):
        if len(data) - at < BLOB_HEADER_BYTES:
            raise ValueError("blob at byte %d of %d: truncated header" % (at, len(data)))
        total, index, s, k = (int(v) for v in data[at:at + BLOB_HEADER_BYTES].view("<u4"))
        if total < BLOB_HEADER_BYTES or total % 4 or at + total > len(data) \
                or index >= len(CODEC_NAMES):
            raise ValueError("blob at byte %d of %d: corrupt header (%d bytes, codec %d)"
                             % (at, len(data), total, index))
        codec = _CODECS[CODEC_NAMES[index]]
        body_at = at + BLOB_HEADER_BYTES + 4 * s
        scalars = tuple(float(v) for v in data[at + BLOB_HEADER_BYTES:body_at].view(np.float32))
        if codec.wire == "dense":
            need = 4 * n
        elif codec.wire == "rows":
            need = 4 * k * (1 + n // shape[0])     # indices, then rows
        else:
            need = codec.byte_span(0, n)[1]
        if body_at + need > at + total:
            raise ValueError("blob at byte %d: %s body of %d bytes, a layer of shape %s "
                             "needs %d" % (at, codec.name, at + total - body_at, shape, need))
        spans.append(BlobSpan(codec.name, scalars, k, body_at, total))
        at += total
    return spans


def blob_payloads(data, shape):
    """The blobs of one layer of ``shape``, concatenated (uint8 numpy, as an allgather
    returns them) -> a Blob per worker, in order. Each Payload's ``shape`` is the flat
    form its codec decodes into: (O, F) for a 'rows' codec (O filters of F elements),
    (n,) otherwise; decode into ``out.reshape(payload.shape)``."""
    data = np.ascontiguousarray(np.asarray(data, np.uint8).reshape(-1))
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape)) if shape else 1
    payloads = []
    for span in blob_spans(data, shape):
        codec, body = _CODECS[span.strategy], data[span.body_at:]
        cols = n // shape[0] if codec.wire == "rows" else 0
        k = span.k
        if codec.wire == "dense":
            values = body[:4 * n].view(np.float32)
            payload = Payload(codec.name, (n,), (mx.nd.array(values),))
        elif codec.wire == "rows":
            indices = body[:4 * k].view(np.int32)
            values = body[4 * k:4 * k + 4 * k * cols].view(np.float32).reshape(k, cols)
            payload = Payload(codec.name, (shape[0], cols),
                              (mx.nd.array(indices, dtype=np.int32), mx.nd.array(values)))
        else:
            payload = codec.piece_payload(body, np.asarray(span.scalars, np.float32), n)
        payloads.append(Blob(payload, span.nbytes))
    return payloads
