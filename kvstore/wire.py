"""Wire layout of hylo payloads in MXNet parameter-server keys (shared by workers and servers).

MXNet's parameter server moves float32 arrays and sums what workers push. Hylo's
payloads are laid out so that this sum does exactly what Hylo's server must do:

* ``dense`` chunks (uncompressed layers): a plain dense key; the server's sum is the
  aggregate.
* ``topk`` chunks (conv_topk): a row_sparse key of shape (filters, F); a worker
  pushes only the rows of the filters it selected, so the bytes on the wire are the
  compressed size, and the server's sum of row_sparse pushes is the scatter-add
  decode of all workers' payloads.
* ``2bit`` chunks (fc_2bit): 2-bit codes cannot be summed, so each worker owns a slot
  of ``slot_rows`` rows (worker w: rows [w * slot_rows, (w + 1) * slot_rows)) and
  pushes only those rows; the slots do not overlap, so the server's sum gathers every
  worker's payload unchanged, and the server-side decoder (kvstore.server) decodes
  each slot with that worker's own threshold (the slot's first value).
  Codes travel as 24-bit integers in float32 values (12 two-bit codes per value):
  every integer below 2**24 is exact in float32, so adding the zeros of other slots
  cannot alter a payload, which raw bit patterns (NaN, denormals) could not promise.

The server stores the aggregate as a row_sparse array that lists every row explicitly
(zero rows included: MXNet's dense-to-row_sparse conversion would drop them, and its
pull reads rows by position); a worker pulls rows [0, dense_rows), which are the
chunk's dense float32 aggregate, row-major.
"""
from dataclasses import dataclass

import numpy as np

# Largest chunk, in gradient elements. MXNet splits keys of 1e6 elements or more over
# all servers by row ranges, which would cut workers' slots apart; hylo cuts large
# layers itself, into chunks it places on servers one by one (load balance).
ROW_DATA = 1024                          # columns of a 2-bit chunk's rows
DEFAULT_CHUNK_ELEMENTS = 976 * ROW_DATA  # a whole number of rows, under 1e6
# Layers of at least this many elements are spread evenly over all servers.
DEFAULT_SPLIT_MIN = 1 << 18
CODES_PER_VALUE = 12          # 24 bits per float32 value


@dataclass(frozen=True)
class ChunkLayout:
    """One parameter-server key carrying a piece of one layer.

    kind: 'dense' | 'topk' | '2bit' ('probe': the start-up check that a server
    decodes); lo, hi: the piece, in elements of the flat layer
    for dense and 2bit, in filters for topk; size: elements of the piece; cols: row
    width; rows: rows of the key; slot_rows: rows per worker's slot
    (2bit); dense_rows: rows of the pulled aggregate; server: index of the server.
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

    @property
    def offset(self):
        """First element of the piece in the flat layer."""
        return self.lo * self.cols if self.kind == "topk" else self.lo

    @property
    def key_shape(self):
        return (self.size,) if self.kind in ("dense", "probe") else (self.rows, self.cols)


def two_bit_values(n_elements):
    """float32 values of one worker's 24-bit-packed codes for n_elements."""
    words = -(-n_elements // 16)
    return -(-words * 32 // 24)


def _pieces(n, chunk_elements, num_servers, split_min, unit):
    """Cut n units-aligned elements into near-equal pieces [(lo, hi)].

    At least ceil(n / chunk_elements) pieces; a layer of split_min elements or more
    is cut into a multiple of num_servers pieces, so that placing them one by one on
    the least-loaded server gives every server the same share of it.
    """
    count = -(-n // chunk_elements)
    if n >= split_min and num_servers > 1:
        count = -(-count // num_servers) * num_servers
    step = -(-n // count)
    step = -(-step // unit) * unit
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def plan_chunks(strategy, shape, num_workers, num_servers=1,
                chunk_elements=DEFAULT_CHUNK_ELEMENTS, split_min=DEFAULT_SPLIT_MIN):
    """Split a layer into ChunkLayouts (server not yet assigned)."""
    n = int(np.prod(shape)) if shape else 1
    if strategy == "conv_topk":
        per_filter = n // shape[0]
        return [ChunkLayout("topk", lo // per_filter, hi // per_filter, hi - lo,
                            cols=per_filter, rows=(hi - lo) // per_filter,
                            dense_rows=(hi - lo) // per_filter)
                for lo, hi in _pieces(n, max(chunk_elements, per_filter), num_servers,
                                      split_min, per_filter)]
    # 2-bit pieces start on a code word (16 elements)
    pieces = _pieces(n, chunk_elements, num_servers, split_min, 16)
    if strategy == "none":
        return [ChunkLayout("dense", lo, hi, hi - lo) for lo, hi in pieces]
    layouts = []
    for lo, hi in pieces:
        size = hi - lo
        cols = min(ROW_DATA, size)
        slot_rows = -(-(1 + two_bit_values(size)) // cols)     # threshold, then codes
        dense_rows = -(-size // cols)
        layouts.append(ChunkLayout("2bit", lo, hi, size, cols=cols,
                                   rows=max(num_workers * slot_rows, dense_rows),
                                   slot_rows=slot_rows, dense_rows=dense_rows))
    return layouts


def pack_codes(codes_u8):
    """2-bit code bytes (uint8, little-endian words) -> float32 24-bit integers."""
    pad = (-len(codes_u8)) % 3
    if pad:
        codes_u8 = np.concatenate([codes_u8, np.zeros(pad, np.uint8)])
    b = codes_u8.reshape(-1, 3).astype(np.uint32)
    return (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)).astype(np.float32)


def unpack_codes(values, n_words):
    """Inverse of pack_codes: float32 24-bit integers -> int32 code words (n_words,)."""
    v = values.astype(np.uint32)
    b = np.empty((len(v), 3), np.uint8)
    b[:, 0], b[:, 1], b[:, 2] = v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF
    return b.reshape(-1)[:4 * n_words].view(np.int32)
