"""Turn one ImageRecordIter batch into per-context arrays: trim/pad, split, cast, copy.

Runs on the loader's background thread. The copies are not optional: ImageRecordIter's
CPU backend decodes the next batch into the very buffer it returned last time, and the
prefetching backend recycles its buffers after ``prefetch_buffer`` batches, so the
training loop must never hold views of them.
"""
import numpy as np


class Batch(tuple):
    """``(data, label)``: lists with one NDArray per context, so ``for x, y in loader`` works.

    data[i]: (n_i, C, H, W) in the loader's dtype on ``ctx[i]``; label[i]: float32 (n_i,)
    or (n_i, label_width). Attributes: ``size`` real images in the batch (excluding
    padding), ``pad`` trailing padded samples (only with last_batch='pad'; they are
    repeats and should be masked out of the loss/metric), ``ctx`` the contexts used
    (fewer than the loader's when a last batch has fewer samples than contexts).
    """

    def __new__(cls, data, label, size, pad=0, ctx=()):
        self = tuple.__new__(cls, (data, label))
        self.size, self.pad, self.ctx = size, pad, list(ctx)
        return self

    @property
    def data(self):
        return self[0]

    @property
    def label(self):
        return self[1]


def split_bounds(rows, parts):
    """[(lo, hi)] of ``rows`` over at most ``parts`` slices, sizes differing by at most one.

    Slices are never empty: with fewer rows than parts only ``rows`` slices are returned.
    """
    parts = max(1, min(parts, rows))
    edges = np.linspace(0, rows, parts + 1).round().astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(parts)]


def prepare(data, label, real, batch_size, last_batch, ctxs, dtype):
    """A Batch from ImageRecordIter arrays ``data`` (B, C, H, W) and ``label`` (B, ...).

    real: how many leading rows are real samples (the rest are stale rows of an earlier
    batch: ImageRecordIter with round_batch=False fills the last batch that way and
    reports pad=0). last_batch 'keep' trims them, 'pad' overwrites them with repeats of
    the batch's first samples. Returns after the copies have completed.
    """
    import mxnet as mx

    pad = 0
    if real < batch_size:
        if last_batch == "pad":
            pad = batch_size - real
            rows = mx.nd.array(np.arange(batch_size) % real, ctx=data.context, dtype="int64")
            data, label = mx.nd.take(data, rows, axis=0), mx.nd.take(label, rows, axis=0)
        else:
            data, label = data[:real], label[:real]
    out_data, out_label, used = [], [], []
    for ctx, (lo, hi) in zip(ctxs, split_bounds(data.shape[0], len(ctxs))):
        x, y = data[lo:hi], label[lo:hi]
        if x.dtype == np.dtype(dtype):
            x = x.copyto(ctx)
        elif ctx.device_type == "gpu":
            x = x.copyto(ctx).astype(dtype, copy=False)  # cast on the device: it is faster there
        else:
            x = x.astype(dtype).as_in_context(ctx)  # astype already made a fresh array
        out_data.append(x)
        out_label.append(y.copyto(ctx))
        used.append(ctx)
    for arr in out_data + out_label:
        arr.wait_to_read()  # the source buffer may be overwritten by the next decode
    return Batch(out_data, out_label, size=real, pad=pad, ctx=used)
