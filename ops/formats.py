"""The byte formats the operators write, in numpy: the oracle of their C++ kernels.

* Integer sums of W workers' 2-bit codes and their packing for the way back
  (ops.sum_2bit, ops.decode_sums), below.
* Bytes in float32 carriers (ops.pack_bytes, ops.unpack_bytes): how the parameter
  server, which moves and sums float32 values, carries payload bytes
  (:func:`pack_bytes`).

A shared-scale codec (mxhylo.kvstore.codec_shared) quantizes a layer on every worker with
the same value v, so each worker's element is c * v with c in {-1, 0, +1}, and the
aggregate of W workers is v times an integer in [-W, W]. The servers add the codes as
integers (:func:`sum_codes`) and hand the workers the sums packed in base B = 2W + 1
(:func:`pack_sums`, read by :func:`unpack_sums`): ``digits_per_group(W)`` sums per
little-endian uint16, the largest d with B ** d <= 2 ** 16. Bits per element of the
pull: W = 1: 1.6, 2: 2.67, 4: 3.2, 16: 5.33, 64 and 127: 8 (float32: 32), whatever the
gradient. A 16-bit group keeps both directions table lookups (numpy takes ~1 ns an
element, where dividing 64-bit groups took ~10): wider groups would save a fraction
of a bit only at W = 2 and W >= 41.

Codes are ops.quantize_2bit's: int32 words, 16 codes of 2 bits LSB first, 0 -> 0,
1 -> +1, 2 -> -1 (3 is never written; read as 0, as the decoder reads it).
"""
import functools

import numpy as np

MAX_WORKERS = 127       # 2W + 1 <= 255: a group holds at least 2 sums


def digits_per_group(num_workers):
    """Sums of ``num_workers`` workers one uint16 group carries: the largest d with
    (2W + 1) ** d <= 2 ** 16."""
    _check_workers(num_workers)
    base, d = 2 * num_workers + 1, 0
    while base ** (d + 1) <= 1 << 16:
        d += 1
    return d


def packed_nbytes(n, num_workers):
    """Bytes :func:`pack_sums` writes for ``n`` sums of ``num_workers`` workers."""
    return 2 * -(-n // digits_per_group(num_workers))


@functools.lru_cache(maxsize=None)
def _code_table():
    """int8 (256, 4): the values {-1, 0, +1} of the 4 codes of each byte, LSB first."""
    b = np.arange(256)
    codes = (b[:, None] >> np.arange(0, 8, 2)) & 3
    return ((codes == 1).astype(np.int8) - (codes == 2).astype(np.int8))


@functools.lru_cache(maxsize=None)
def _sum_table(num_workers):
    """int8 (2 ** 16, d): the sums in [-W, W] each uint16 group stands for (groups of
    B ** d or more are never written)."""
    d, base = digits_per_group(num_workers), 2 * num_workers + 1
    g = np.arange(1 << 16)
    return np.stack([(g // base ** i) % base - num_workers for i in range(d)],
                    axis=1).astype(np.int8)


def unpack_codes(words, n):
    """int32 code words (numpy, ceil(n/16),) -> int8 (n,) in {-1, 0, +1}."""
    w = np.ascontiguousarray(words)
    if w.size * 16 < n:
        raise ValueError("%d code words carry %d codes, fewer than the %d elements"
                         % (w.size, 16 * w.size, n))
    return _code_table()[w.view(np.uint8)].reshape(-1)[:n]


def sum_codes(code_words, n):
    """The workers' code words (a list, in rank order, each int32 numpy) of a piece of n
    elements -> int8 (n,): each element's sum of codes, in [-W, W]."""
    _check_workers(len(code_words))
    total = unpack_codes(code_words[0], n).copy()
    for words in code_words[1:]:
        total += unpack_codes(words, n)
    return total


def pack_sums(sums, num_workers):
    """int sums in [-W, W] (numpy, n,) -> uint8 bytes (packed_nbytes(n, W),): each
    group of digits_per_group(W) sums s_i as sum_i (s_i + W) * B**i, a little-endian
    uint16 (a short last group padded with sums of 0). Read by :func:`unpack_sums`."""
    d = digits_per_group(num_workers)
    base = 2 * num_workers + 1
    s = np.asarray(sums).reshape(-1)
    if s.size and (s.min() < -num_workers or s.max() > num_workers):
        raise ValueError("a sum of %d workers' codes lies in [-%d, %d]; got [%d, %d]"
                         % (num_workers, num_workers, num_workers, s.min(), s.max()))
    groups = -(-s.size // d)
    digits = np.full(groups * d, num_workers, np.uint16)      # padding: sums of 0
    digits[:s.size] = s.astype(np.int16) + num_workers
    digits = digits.reshape(groups, d).T.copy()               # digit i of every group
    value = digits[d - 1].copy()
    for i in range(d - 2, -1, -1):      # Horner: below B ** d <= 2 ** 16 throughout
        value *= np.uint16(base)
        value += digits[i]
    return value.astype("<u2").view(np.uint8)


def unpack_sums(data, n, num_workers):
    """Inverse of :func:`pack_sums`: uint8 bytes -> int16 (n,) sums in [-W, W]."""
    value = check_packed(data, n, num_workers)
    return _sum_table(num_workers)[value].reshape(-1)[:n].astype(np.int16)


def check_packed(data, n, num_workers):
    """Raise ValueError unless uint8 ``data`` holds n sums of ``num_workers`` workers
    as :func:`pack_sums` writes them (enough bytes, every group below B ** d); return
    the groups (little-endian uint16 numpy)."""
    d, base = digits_per_group(num_workers), 2 * num_workers + 1
    groups = -(-n // d)
    if len(data) < 2 * groups:
        raise ValueError("%d bytes of packed sums, %d sums of %d workers need %d"
                         % (len(data), n, num_workers, 2 * groups))
    value = np.ascontiguousarray(data[:2 * groups]).view("<u2")
    if value.size and int(value.max()) >= base ** d:
        raise ValueError("packed sums of %d workers hold a group of %d or more (%d digits "
                         "of base %d): not what pack_sums writes"
                         % (num_workers, base ** d, d, base))
    return value


def _check_workers(num_workers):
    if not 1 <= num_workers <= MAX_WORKERS:
        raise ValueError("integer sums of codes take 1 to %d workers, got %d"
                         % (MAX_WORKERS, num_workers))


_WORD_MASK = (1 << 30) - 1    # pack_bytes: 30 payload bits per float32 value


def pack_bytes(data):
    """Payload bytes (uint8) -> float32 values, 30 bits each (15 bytes in 4 values).

    Each value is a *normal* float32: bit 29 of the 30 goes to the sign, bits 23-28 to
    the exponent field plus one (1..64: never zero, Inf or NaN), bits 0-22 to the
    mantissa. A normal number plus zero is that number, bit for bit, in every rounding
    and flush-to-zero mode, so the servers' sum of other workers' empty slots cannot
    alter a payload; zeros, denormals, Inf and NaN, which raw bit patterns would
    produce, could be altered or canonicalised. 3.75 payload bytes per value (24-bit
    integers carried 3). Read by :func:`unpack_bytes`.
    """
    pad = (-len(data)) % 15
    groups = np.zeros((-(-len(data) // 15), 16), np.uint8)
    flat = np.concatenate([data, np.zeros(pad, np.uint8)]) if pad else data
    groups[:, :15] = flat.reshape(-1, 15)
    lo, hi = groups.view("<u8").T                     # bits 0-63 and 64-119 of a group
    mask = np.uint64(_WORD_MASK)
    words = np.empty((len(lo), 4), np.uint64)
    words[:, 0] = lo & mask
    words[:, 1] = (lo >> np.uint64(30)) & mask
    words[:, 2] = ((lo >> np.uint64(60)) | (hi << np.uint64(4))) & mask
    words[:, 3] = (hi >> np.uint64(26)) & mask
    w = words.reshape(-1).astype(np.uint32)
    bits = ((w >> 29) << 31) | ((((w >> 23) & 0x3F) + 1) << 23) | (w & 0x7FFFFF)
    return bits.view(np.float32)


def carrier_values(n_bytes):
    """float32 values that carry n_bytes (pack_bytes: 15 bytes in 4)."""
    return 4 * -(-n_bytes // 15)


def unpack_bytes(values, n_bytes, check=True):
    """Inverse of pack_bytes: float32 values (a multiple of 4 of them, or the first of
    a slot's values) -> the first n_bytes (uint8). ValueError if a value is not one
    pack_bytes writes (check=False: its bytes are decoded all the same)."""
    n_values = carrier_values(n_bytes)
    bits = np.ascontiguousarray(values[:n_values], np.float32).view(np.uint32)
    exponent = (bits >> 23) & 0xFF
    if check and bits.size and (exponent.min() < 1 or exponent.max() > 64):
        raise ValueError("a slot payload value is not one pack_bytes writes (exponent "
                         "field %d..%d): the payload was altered on the way"
                         % (exponent.min(), exponent.max()))
    w = ((bits >> 31) << 29) | (((exponent - 1) & 0x3F) << 23) | (bits & 0x7FFFFF)
    w = w.astype(np.uint64).reshape(-1, 4)
    groups = np.empty((len(w), 2), np.uint64)
    groups[:, 0] = w[:, 0] | (w[:, 1] << np.uint64(30)) | (w[:, 2] << np.uint64(60))
    groups[:, 1] = (w[:, 2] >> np.uint64(4)) | (w[:, 3] << np.uint64(26))
    return groups.view(np.uint8).reshape(-1, 16)[:, :15].reshape(-1)[:n_bytes]
