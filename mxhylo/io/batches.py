"""Turn one ImageRecordIter batch into per-context arrays: trim/pad, split, cast, copy.

Runs on the loader's background thread. The copies are not optional: ImageRecordIter's
CPU backend decodes the next batch into the very buffer it returned last time, and the
prefetching backend recycles its buffers after ``prefetch_buffer`` batches, so the
training loop must never hold views of them.

Copies to the CPU go into pooled buffers: MXNet 1.9 has no CPU memory pool, and a
fresh 38 MB array (64 x 3 x 224 x 224 float32) costs about 80 ms of page faults here
against 10 ms for the copy itself. A pooled buffer is numpy memory lent to MXNet
through DLPack; MXNet drops its reference only when the last NDArray using the memory
(views, autograd records and queued operations included) is gone, so a buffer whose
reference count is back to the pool's own is provably unused and safe to overwrite.
"""
import sys

import numpy as np

_ALIGN = 64  # bytes; what MXNet's own CPU allocator guarantees


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


class HostBufferPool:
    """Reusable cpu(0) NDArrays, reused only once nothing references their memory.

    At most ``per_shape`` buffers are kept per (shape, dtype); beyond that (a loop that
    holds on to many batches) arrays are allocated normally and not retained.
    Used from one thread (the producer).
    """

    def __init__(self, per_shape=8):
        self.per_shape = per_shape
        self._bufs = {}
        probe = [np.empty(1)]
        self._idle_refs = self._refs(probe, 0)  # pool list + call args: nobody else

    @staticmethod
    def _refs(bufs, i):
        return sys.getrefcount(bufs[i])

    def take(self, shape, dtype):
        """An NDArray of ``shape``/``dtype`` on cpu(0) whose contents may be overwritten."""
        import mxnet as mx

        key = (tuple(shape), np.dtype(dtype).str)
        bufs = self._bufs.setdefault(key, [])
        for i in range(len(bufs)):
            if self._refs(bufs, i) == self._idle_refs:
                return mx.nd.from_numpy(bufs[i], zero_copy=True)
        if len(bufs) >= self.per_shape:
            return mx.nd.empty(shape, ctx=mx.cpu(0), dtype=dtype)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        bufs.append(raw[start:start + nbytes].view(dtype).reshape(shape))
        return mx.nd.from_numpy(bufs[-1], zero_copy=True)


def _to_context(x, ctx, dtype, pool):
    """A fresh copy of NDArray ``x`` on ``ctx`` in ``dtype`` (cast on a GPU: faster there)."""
    import mxnet as mx

    if ctx.device_type == "gpu":
        out = x.copyto(ctx)
        return out if out.dtype == np.dtype(dtype) else out.astype(dtype, copy=False)
    if pool is not None and ctx == mx.cpu(0):
        out = pool.take(x.shape, dtype)
    else:
        out = mx.nd.empty(x.shape, ctx=ctx, dtype=dtype)
    if x.dtype == np.dtype(dtype):
        x.copyto(out)
    else:
        mx.nd.Cast(x, dtype=dtype, out=out)
    return out


def prepare(data, label, real, batch_size, last_batch, ctxs, dtype, pool=None, wait=True):
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
        out_data.append(_to_context(data[lo:hi], ctx, dtype, pool))
        out_label.append(label[lo:hi].copyto(ctx))  # small: a plain allocation is cheap
        used.append(ctx)
    if wait:
        for arr in out_data + out_label:
            arr.wait_to_read()
    return Batch(out_data, out_label, size=real, pad=pad, ctx=used)
