"""A ready RecordIO sample from scikit-learn's digits (the only real images available here).

The 1797 8x8 grey digits (values 0..16) are scaled to 0..255 and upscaled to
``size`` x ``size`` so that decoding and cropping cost something. They are written as
an image folder (``images/<class>/<index>.png``) and packed with the same code path
as any folder, split exactly like :func:`mxhylo.data.load_digits` (its test set is
the val set here). The record id and the .lst index are the scikit-learn index, so a
reader can check every image against :func:`digit_image`.
"""
import os

import numpy as np

from . import packing


def digit_image(images, index, size):
    """uint8 (size, size) grey image of digit ``index`` (bilinear upscale of the 8x8)."""
    import cv2

    small = np.round(images[index] * (255.0 / 16.0)).astype(np.uint8)
    if size == small.shape[0]:
        return small
    return cv2.resize(small, (size, size), interpolation=cv2.INTER_LINEAR)


def digits_arrays():
    """(images float (1797, 8, 8) with values 0..16, labels int (1797,)) from scikit-learn."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def split_indices(n, test_fraction=0.25, seed=0):
    """(train, val) index arrays: the split of mxhylo.data.load_digits for the same args."""
    order = np.random.RandomState(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return order[n_test:], order[:n_test]


def write_digits(outdir, size=32, val_fraction=0.25, seed=0, encoding=".jpg", quality=None,
                 num_workers=1, progress=True):
    """Write the digits as ``outdir``/digits_{train,val}.{lst,rec,idx} plus the image folder.

    Images are stored grey (1 channel); ImageRecordIter reads them with data_shape
    (1, size, size), or (3, size, size) as three equal channels. The records are in the
    shuffled order of the split (a class-sorted .rec would make contiguous shards
    class-skewed). Returns {'train': prefix, 'val': prefix, 'classes': 10, 'size': size}.
    """
    import cv2

    if size < 8:
        raise ValueError("size must be >= 8 (the digits are 8x8), got %r" % size)
    images, labels = digits_arrays()
    folder = os.path.join(outdir, "images")
    items = []
    for i in range(len(labels)):
        rel = os.path.join(str(int(labels[i])), "%04d.png" % i)
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # PNG on disk: lossless, the packing step alone decides the encoding
        cv2.imwrite(path, digit_image(images, i, size))
        items.append((i, [float(labels[i])], rel))
    train, val = split_indices(len(labels), val_fraction, seed)
    prefixes = {}
    for name, order in (("train", train), ("val", val)):
        prefix = os.path.join(outdir, "digits_" + name)
        subset = [items[i] for i in order]
        packing.write_list(prefix + ".lst", subset)
        if subset:
            packing.pack_items(subset, folder, prefix, encoding=encoding, quality=quality,
                               color=0, num_workers=num_workers, progress=progress)
        prefixes[name] = prefix
    prefixes.update(classes=10, size=size)
    return prefixes
