"""Integer sums of W workers' 2-bit codes, and their packing for the way back.

A shared-scale codec (kvstore.codec_shared) quantizes a layer on every worker with
the same value v, so each worker's element is c * v with c in {-1, 0, +1}, and the
aggregate of W workers is v times an integer in [-W, W]. The servers add the codes as
integers (:func:`sum_codes`) and hand the workers the sums packed in base B = 2W + 1
(:func:`pack_sums`, read by :func:`unpack_sums`): ``digits_per_group(W)`` sums per
little-endian uint64 group, so log2(B) bits per element rounded up only once per
group. Bits per element of the pull: W = 1: 1.6, 4: 3.2, 16: 5.33, 64: 7.11, 127: 8
(float32: 32), whatever the gradient.

Codes are ops.quantize_2bit's: int32 words, 16 codes of 2 bits LSB first, 0 -> 0,
1 -> +1, 2 -> -1 (3 is never written; read as 0, as the decoder reads it).
"""
import numpy as np

MAX_WORKERS = 127       # sums fit int8, and a group holds at least 8 of them


def digits_per_group(num_workers):
    """Sums of ``num_workers`` workers one uint64 group carries: the largest d with
    (2W + 1) ** d <= 2 ** 64."""
    _check_workers(num_workers)
    base, d, value = 2 * num_workers + 1, 0, 1
    while value * base <= 1 << 64:
        value *= base
        d += 1
    return d


def packed_nbytes(n, num_workers):
    """Bytes :func:`pack_sums` writes for ``n`` sums of ``num_workers`` workers."""
    return 8 * -(-n // digits_per_group(num_workers))


def unpack_codes(words, n):
    """int32 code words (numpy, ceil(n/16),) -> int8 (n,) in {-1, 0, +1}."""
    w = np.ascontiguousarray(words).view(np.uint32)
    if w.size * 16 < n:
        raise ValueError("%d code words carry %d codes, fewer than the %d elements"
                         % (w.size, 16 * w.size, n))
    shifts = np.arange(0, 32, 2, dtype=np.uint32)
    code = ((w[:, None] >> shifts) & 3).astype(np.int8).reshape(-1)[:n]
    # 1 -> +1, 2 -> -1, 0 and 3 -> 0
    return (code == 1).astype(np.int8) - (code == 2).astype(np.int8)


def sum_codes(code_words, n):
    """The workers' code words (a list, in rank order, each int32 numpy) of a piece of n
    elements -> int8 (n,): each element's sum of codes, in [-W, W]."""
    _check_workers(len(code_words))
    total = np.zeros(n, np.int8)
    for words in code_words:
        total += unpack_codes(words, n)
    return total


def pack_sums(sums, num_workers):
    """int sums in [-W, W] (numpy, n,) -> uint8 bytes (packed_nbytes(n, W),): each
    group of digits_per_group(W) sums s_i as sum_i (s_i + W) * B**i, little-endian
    uint64 (a short last group padded with sums of 0). Read by :func:`unpack_sums`."""
    d = digits_per_group(num_workers)
    base = 2 * num_workers + 1
    s = np.asarray(sums).reshape(-1)
    if s.size and (s.min() < -num_workers or s.max() > num_workers):
        raise ValueError("a sum of %d workers' codes lies in [-%d, %d]; got [%d, %d]"
                         % (num_workers, num_workers, num_workers, s.min(), s.max()))
    groups = -(-s.size // d)
    digits = np.full(groups * d, num_workers, np.uint64)     # padding: sums of 0
    digits[:s.size] = (s.astype(np.int64) + num_workers).astype(np.uint64)
    digits = digits.reshape(groups, d)
    value = np.zeros(groups, np.uint64)
    for i in range(d - 1, -1, -1):      # Horner: exact in uint64 since B**d <= 2**64
        value = value * np.uint64(base) + digits[:, i]
    return value.astype("<u8").view(np.uint8)


def unpack_sums(data, n, num_workers):
    """Inverse of :func:`pack_sums`: uint8 bytes -> int16 (n,) sums in [-W, W]."""
    d = digits_per_group(num_workers)
    base = np.uint64(2 * num_workers + 1)
    groups = -(-n // d)
    if len(data) < 8 * groups:
        raise ValueError("%d bytes of packed sums, %d sums of %d workers need %d"
                         % (len(data), n, num_workers, 8 * groups))
    value = np.ascontiguousarray(data[:8 * groups]).view("<u8").astype(np.uint64)
    digits = np.empty((groups, d), np.int16)
    for i in range(d):
        digits[:, i] = (value % base).astype(np.int16)
        value //= base
    if value.any():
        raise ValueError("packed sums of %d workers hold a group past %d digits of base "
                         "%d: not what pack_sums writes" % (num_workers, d, int(base)))
    return digits.reshape(-1)[:n] - np.int16(num_workers)


def _check_workers(num_workers):
    if not 1 <= num_workers <= MAX_WORKERS:
        raise ValueError("integer sums of codes take 1 to %d workers, got %d"
                         % (MAX_WORKERS, num_workers))
