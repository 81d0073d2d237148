"""Checks and random access on .rec/.idx pairs, for clear errors before MXNet sees them.

MXNet's ImageRecordIter does not fail politely on bad files: a garbage .idx or a part
with no records segfaults the process, a truncated .rec aborts it from a C++ thread
(``terminate called ... Invalid RecordIO Format``), and an undecodable image surfaces
as an OpenCV assertion that names no record. This module checks what can be checked
cheaply up front and, after a failure, finds the record to blame.

RecordIO layout (dmlc): each record is ``uint32 magic 0xced7230a``, ``uint32 lrec``
(upper 3 bits: continuation flag, lower 29: length in bytes), the payload, padding
to 4 bytes. A payload that itself contains the magic at an aligned position is split
into parts (flag 1 = first, 2 = middle, 3 = last) and the magic is re-inserted on read.
"""
import os
import struct
from collections import namedtuple

import numpy as np

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LEN_MASK = (1 << 29) - 1


class RecordFileError(ValueError):
    """A .rec/.idx pair that ImageRecordIter cannot read (the message says where)."""


class RecordDecodeError(RecordFileError):
    """A record whose image cannot be decoded; ``.key`` / ``.offset`` name it."""

    def __init__(self, message, key=None, offset=None):
        super().__init__(message)
        self.key, self.offset = key, offset


RecordIndex = namedtuple("RecordIndex", "keys offsets rec_size")
RecordIndex.__doc__ = """The .idx of a .rec, sorted by byte offset (ImageRecordIter's order).

keys: int64 (N,) record keys; offsets: int64 (N,) byte offsets into the .rec;
rec_size: size of the .rec in bytes."""


def read_index(path_imgidx):
    """(keys, offsets) int64 arrays from a .idx file, in file order; RecordFileError if malformed."""
    if not os.path.isfile(path_imgidx):
        raise FileNotFoundError("index file %r does not exist (make it with python -m "
                                "mxhylo.im2rec)" % path_imgidx)
    keys, offsets = [], []
    with open(path_imgidx, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            cols = line.split(b"\t")
            try:
                if len(cols) != 2:
                    raise ValueError
                keys.append(int(cols[0]))
                offsets.append(int(cols[1]))
            except ValueError:
                raise RecordFileError("%s:%d: not a .idx line 'key<TAB>offset': %r"
                                      % (path_imgidx, lineno, line[:80])) from None
    if not keys:
        raise RecordFileError("index file %r is empty" % path_imgidx)
    return np.asarray(keys, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def check_record_files(path_imgrec, path_imgidx):
    """Check that every .idx entry points at a whole record of the .rec; return a RecordIndex.

    Checked for every entry, vectorised over a memory map (about a second per million
    records): offset inside the file and 4-byte aligned, the RecordIO magic there, the
    record's length inside the file, offsets unique and, for single-part records, the
    next indexed record starting right after it (otherwise ImageRecordIter's
    indexed reader would read unindexed records as part of a chunk). Raises
    FileNotFoundError or RecordFileError. Image payloads are not decoded here.
    """
    if not os.path.isfile(path_imgrec):
        raise FileNotFoundError("record file %r does not exist (make it with python -m "
                                "mxhylo.im2rec)" % path_imgrec)
    keys, offsets = read_index(path_imgidx)
    rec_size = os.path.getsize(path_imgrec)
    where = "%s (indexed by %s)" % (path_imgrec, path_imgidx)
    if rec_size < 8:
        raise RecordFileError("%s is empty or truncated (%d bytes)" % (where, rec_size))
    order = np.argsort(offsets, kind="stable")
    keys, offsets = keys[order], offsets[order]
    bad = np.flatnonzero((offsets < 0) | (offsets + 8 > rec_size) | (offsets % 4 != 0))
    if bad.size:
        i = bad[0]
        raise RecordFileError("%s: key %d has offset %d outside the %d-byte file or not "
                              "4-byte aligned: the .idx does not belong to this .rec or the "
                              ".rec is truncated" % (where, keys[i], offsets[i], rec_size))
    dup = np.flatnonzero(np.diff(offsets) == 0)
    if dup.size:
        raise RecordFileError("%s: keys %d and %d share offset %d"
                              % (where, keys[dup[0]], keys[dup[0] + 1], offsets[dup[0]]))
    words = np.memmap(path_imgrec, dtype="<u4", mode="r", shape=(rec_size // 4,))
    magic = np.asarray(words[offsets // 4])
    lrec = np.asarray(words[offsets // 4 + 1]).astype(np.int64)
    del words
    bad = np.flatnonzero(magic != MAGIC)
    if bad.size:
        i = bad[0]
        raise RecordFileError("%s: no record starts at offset %d (key %d; %d of %d entries "
                              "bad): the .idx does not belong to this .rec or the .rec is "
                              "corrupt" % (where, offsets[i], keys[i], bad.size, len(keys)))
    cflag, length = lrec >> 29, lrec & _LEN_MASK
    end = offsets + 8 + ((length + 3) // 4) * 4
    bad = np.flatnonzero(end > rec_size)
    if bad.size:
        i = bad[0]
        raise RecordFileError("%s: record key %d at offset %d needs %d bytes but the file "
                              "ends at %d: the .rec is truncated"
                              % (where, keys[i], offsets[i], end[i] - offsets[i], rec_size))
    gap = np.flatnonzero((cflag[:-1] == 0) & (end[:-1] != offsets[1:]))
    if gap.size:
        i = gap[0]
        raise RecordFileError("%s: bytes %d..%d after record key %d are not indexed: the .idx "
                              "must list every record of the .rec"
                              % (where, end[i], offsets[i + 1], keys[i]))
    return RecordIndex(keys, offsets, rec_size)


def read_payload(f, offset):
    """The payload of the record at ``offset`` of open binary file ``f`` (parts re-joined)."""
    parts, pos = [], offset
    while True:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            raise RecordFileError("record at offset %d runs past the end of the file" % offset)
        magic, lrec = struct.unpack("<II", head)
        if magic != MAGIC:
            raise RecordFileError("no RecordIO magic at offset %d" % pos)
        length = lrec & _LEN_MASK
        parts.append(f.read(length))
        pos += 8 + ((length + 3) // 4) * 4
        if (lrec >> 29) in (0, 3):  # whole record, or the last part of a split one
            return _MAGIC_BYTES.join(parts)


def decode_payload(payload, flag=-1):
    """(header flag, labels float32 (k,), record id, image uint8 array or None) of a payload."""
    import cv2

    from .packing import unpack_record

    rec_flag, labels, rec_id, image_bytes = unpack_record(payload)
    img = None
    if image_bytes:
        img = cv2.imdecode(np.frombuffer(image_bytes, np.uint8), flag)
    return rec_flag, labels, rec_id, img


def find_undecodable(path_imgrec, index, positions, channels=3, limit=1):
    """Records among ``positions`` (into the offset-sorted index) that OpenCV cannot decode.

    Decodes with the colour flag ImageRecordIter uses for ``channels`` (1 grey, 3 colour,
    4 unchanged). Returns up to ``limit`` tuples (position, key, offset, reason).
    """
    flag = {1: 0, 3: 1}.get(channels, -1)
    found = []
    with open(path_imgrec, "rb") as f:
        for pos in positions:
            key, offset = int(index.keys[pos]), int(index.offsets[pos])
            try:
                _, _, _, img = decode_payload(read_payload(f, offset), flag)
                reason = None if img is not None else "OpenCV cannot decode the image bytes"
            except (RecordFileError, struct.error) as err:
                reason = str(err)
            if reason is not None:
                found.append((int(pos), key, offset, reason))
                if len(found) >= limit:
                    break
    return found


def part_range(num_records, num_parts, part_index):
    """[begin, end) positions (offset order) of ImageRecordIter's part ``part_index``.

    With an .idx, ImageRecordIter (dmlc's indexed_recordio split) gives part p the
    records [p*s, min((p+1)*s, N)) with s = ceil(N / num_parts): every part but the
    last has s records and the last may have far fewer, or none (for example N=9 in 4
    parts: 3, 3, 3, 0). Checked against ImageRecordIter in tests/integration/test_io.py.
    """
    step = -(-num_records // num_parts)
    begin = min(part_index * step, num_records)
    return begin, min(begin + step, num_records)
