"""Pack images into MXNet's RecordIO image format (.lst / .rec / .idx).

The files are the ones MXNet's ImageRecordIter and gluoncv's record datasets read:

- ``.lst``: one line per image, tab separated: ``index<TAB>label[<TAB>label...]<TAB>path``.
- ``.rec``: RecordIO records; each payload is an image record header
  (struct ``'IfQQ'``: flag, label, id, id2; with ``flag = k > 0`` the header label is 0
  and k float32 labels follow) and then the encoded image bytes.
- ``.idx``: ``index<TAB>byte offset of the record in .rec`` per line.

Images are read, resized and encoded in worker processes (OpenCV releases the GIL,
but one Python process cannot encode and also write fast enough for a folder of JPEGs);
the parent writes the records in list order, so the output does not depend on the
number of workers.
"""
import multiprocessing
import os
import random
import struct
import sys

import numpy as np

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp")
_IR_FORMAT = "IfQQ"  # MXNet's image record header: flag, label, id, id2


class PackError(RuntimeError):
    """An image that could not be read or encoded (the message names the file)."""


# ----------------------------------------------------------------------------- lists
def list_folder(root, exts=IMAGE_EXTS):
    """Images of a class-per-sub-folder tree.

    Returns (items, classes): items is a list of (index, [label], relative path) with
    label = position of the class folder in ``classes`` (sorted folder names); files are
    searched recursively inside each class folder and sorted, so the list is stable.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError("image folder %r does not exist" % root)
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError("%r has no class sub-folders (expected ROOT/<class>/<image>)" % root)
    items = []
    for label, cls in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
            dirnames.sort()
            for fname in sorted(filenames):
                if os.path.splitext(fname)[1].lower() in exts:
                    rel = os.path.relpath(os.path.join(dirpath, fname), root)
                    items.append((len(items), [float(label)], rel))
    if not items:
        raise ValueError("no images with extensions %s under %r" % (", ".join(exts), root))
    return items, classes


def split_items(items, val_fraction, seed=0):
    """Stratified split: (train, val), ``round(n_class * val_fraction)`` of each class to val.

    Stratified because small folders would otherwise lose whole classes from val.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1), got %r" % val_fraction)
    by_class = {}
    for item in items:
        by_class.setdefault(item[1][0], []).append(item)
    rng = random.Random(seed)
    train, val = [], []
    for label in sorted(by_class):
        group = list(by_class[label])
        rng.shuffle(group)
        n_val = int(round(len(group) * val_fraction))
        val.extend(group[:n_val])
        train.extend(group[n_val:])
    return sorted(train), sorted(val)


def shuffle_items(items, seed=0):
    """The items in a seeded random order.

    The order of the .rec is the order ImageRecordIter reads without shuffle and the
    order its num_parts shards are cut from, so a class-sorted file would give each
    worker a few classes only.
    """
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def write_list(path, items):
    """Write items (index, labels, relative path) as a .lst file."""
    with open(path, "w") as f:
        for index, labels, rel in items:
            f.write("%d\t%s\t%s\n" % (index, "\t".join("%f" % x for x in labels), rel))


def read_list(path):
    """Read a .lst file into a list of (index, [labels], relative path)."""
    items = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            cols = line.split("\t")
            if len(cols) < 3:
                raise ValueError("%s:%d: expected 'index<TAB>label(s)<TAB>path', got %r"
                                 % (path, lineno, line))
            try:
                items.append((int(cols[0]), [float(x) for x in cols[1:-1]], cols[-1]))
            except ValueError:
                raise ValueError("%s:%d: index must be an int and labels numbers: %r"
                                 % (path, lineno, line)) from None
    return items


# ----------------------------------------------------------------------------- records
def pack_record(index, labels, image_bytes):
    """One record payload: image record header (+ labels when more than one) + image bytes."""
    if len(labels) == 1:
        header = struct.pack(_IR_FORMAT, 0, float(labels[0]), int(index), 0)
        return header + image_bytes
    label = np.asarray(labels, dtype=np.float32)
    return struct.pack(_IR_FORMAT, label.size, 0.0, int(index), 0) + label.tobytes() + image_bytes


def unpack_record(payload):
    """(flag, labels float32 array, id, image bytes) from one record payload."""
    size = struct.calcsize(_IR_FORMAT)
    flag, label, rec_id, _ = struct.unpack(_IR_FORMAT, payload[:size])
    if flag > 0:
        labels = np.frombuffer(payload[size:size + 4 * flag], dtype=np.float32).copy()
        return flag, labels, rec_id, payload[size + 4 * flag:]
    return flag, np.array([label], dtype=np.float32), rec_id, payload[size:]


def resize_image(img, resize=0, center_crop=False):
    """Shorter side to ``resize`` pixels (0: keep), then optionally the central square.

    img: uint8 array (H, W) or (H, W, C). INTER_AREA when shrinking (no aliasing),
    bilinear when enlarging.
    """
    import cv2

    if center_crop:
        h, w = img.shape[:2]
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        img = img[top:top + side, left:left + side]
    if resize > 0:
        h, w = img.shape[:2]
        if h < w:
            size = (int(round(w * resize / h)), resize)
        else:
            size = (resize, int(round(h * resize / w)))
        interp = cv2.INTER_AREA if min(h, w) > resize else cv2.INTER_LINEAR
        img = cv2.resize(img, size, interpolation=interp)
    return img


def encode_image(img, encoding=".jpg", quality=None):
    """Encoded bytes of a uint8 image. quality: JPEG 0-100 (default 95), PNG 0-9 (default 3)."""
    import cv2

    if encoding in (".jpg", ".jpeg"):
        params = [cv2.IMWRITE_JPEG_QUALITY, 95 if quality is None else int(quality)]
    elif encoding == ".png":
        params = [cv2.IMWRITE_PNG_COMPRESSION, 3 if quality is None else int(quality)]
    else:
        raise ValueError("encoding must be .jpg or .png, got %r" % encoding)
    ok, buf = cv2.imencode(encoding, img, params)
    if not ok:
        raise PackError("OpenCV could not encode an image of shape %s as %s" % (img.shape, encoding))
    return buf.tobytes()


# The worker processes get their options once (Pool initializer), not with every item.
_OPTS = {}


def _init_worker(opts):
    import cv2

    cv2.setNumThreads(1)  # parallelism comes from the processes; no oversubscription
    _OPTS.clear()
    _OPTS.update(opts)


def _encode_item(item):
    """(index, record payload or None, error message or None) for one list item."""
    import cv2

    index, labels, rel = item
    path = os.path.join(_OPTS["root"], rel)
    try:
        if _OPTS["passthrough"]:
            # No re-encoding asked for: store the file's bytes unchanged (fast, lossless).
            with open(path, "rb") as f:
                data = f.read()
            if cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED) is None:
                return index, None, "%s: not a decodable image" % path
            return index, pack_record(index, labels, data), None
        img = cv2.imread(path, _OPTS["color"])
        if img is None:
            return index, None, "%s: missing or not a decodable image" % path
        img = resize_image(img, _OPTS["resize"], _OPTS["center_crop"])
        data = encode_image(img, _OPTS["encoding"], _OPTS["quality"])
        return index, pack_record(index, labels, data), None
    except Exception as err:  # report, do not kill the pool: the parent decides
        return index, None, "%s: %s" % (path, err)


def _progress(total, desc, enabled):
    """A tqdm bar on stderr when tqdm is installed and enabled, else a no-op counter."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="img", file=sys.stderr)
        except ImportError:
            pass

    class _Silent:
        def update(self, n=1):
            pass

        def close(self):
            pass

    return _Silent()


def pack_items(items, root, prefix, resize=0, center_crop=False, encoding=".jpg",
               quality=None, color=1, num_workers=1, skip_bad=False, progress=True,
               passthrough=False):
    """Write ``prefix``.rec and ``prefix``.idx from list items (index, labels, rel path).

    color: OpenCV read flag (1 colour BGR, 0 grey, -1 unchanged). passthrough: copy the
    file bytes as they are (resize/encoding/quality/color ignored). An unreadable image
    raises PackError naming it, or is skipped with a warning when skip_bad.
    Returns the number of records written.
    """
    from mxnet.recordio import MXIndexedRecordIO

    opts = dict(root=root, resize=int(resize), center_crop=bool(center_crop),
                encoding=encoding, quality=quality, color=int(color),
                passthrough=bool(passthrough))
    rec_path, idx_path = prefix + ".rec", prefix + ".idx"
    writer = MXIndexedRecordIO(idx_path, rec_path, "w")
    bar = _progress(len(items), os.path.basename(prefix), progress)
    written, bad = 0, []
    try:
        if num_workers > 1:
            # fork: the workers only need cv2/numpy and the options above.
            ctx = multiprocessing.get_context("fork")
            pool = ctx.Pool(num_workers, initializer=_init_worker, initargs=(opts,))
            results = pool.imap(_encode_item, items, chunksize=16)  # ordered
        else:
            pool = None
            _init_worker(opts)
            results = map(_encode_item, items)
        try:
            for index, payload, error in results:
                bar.update(1)
                if error is not None:
                    if not skip_bad:
                        raise PackError("cannot pack record %d: %s" % (index, error))
                    bad.append(error)
                    continue
                writer.write_idx(index, payload)
                written += 1
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    finally:
        bar.close()
        writer.close()
    for error in bad:
        print("warning: skipped %s" % error, file=sys.stderr)
    return written
