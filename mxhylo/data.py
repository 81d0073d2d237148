"""Built-in real data: scikit-learn's handwritten digits (1797 8x8 grey images, 10 classes).

No data set can be downloaded where mxhylo is tested, so every accuracy claim in
the project is made on these images.
"""
import numpy as np


def load_digits(test_fraction=0.25, seed=0, size=8, channels=1):
    """Return (x_train, y_train, x_test, y_test).

    x: float32 array (N, channels, size, size) scaled to [0, 1] (size > 8: bilinear
    upscaling; channels > 1: the grey image repeated); y: float32 array (N,) of class
    ids. The split is stratified-free but deterministic for a given ``seed``.
    """
    from sklearn.datasets import load_digits as _sk_digits

    digits = _sk_digits()
    images = digits.images.astype(np.float32) / 16.0
    if size != 8:
        import cv2
        images = np.stack([cv2.resize(im, (size, size), interpolation=cv2.INTER_LINEAR)
                           for im in images])
    x = np.repeat(images[:, None, :, :], channels, axis=1)
    y = digits.target.astype(np.float32)
    order = np.random.RandomState(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def shard(x, y, num_parts, part_index):
    """The part_index-th of num_parts contiguous, equal shards of (x, y): len(y) //
    num_parts samples each, the last len(y) % num_parts samples left out.

    Equal, so that every worker takes the same number of steps with the same batch
    sizes: where the optimizer runs on the workers, each scales the summed gradient by
    its own batch size (Gluon's ``trainer.step(batch_size)``), and a worker whose last
    batch were smaller would end with different weights.
    """
    if not 0 <= part_index < num_parts:
        raise ValueError("part_index %r is not one of the %d parts" % (part_index, num_parts))
    n = len(y) // num_parts
    if n == 0:
        raise ValueError("%d samples cannot give %d parts a sample each" % (len(y), num_parts))
    lo = part_index * n
    return x[lo:lo + n], y[lo:lo + n]
