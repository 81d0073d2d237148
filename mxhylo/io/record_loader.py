"""RecordLoader: a pipelined, rank-aware ImageRecordIter for Gluon training loops.

Behaviour (every point checked in tests/integration/test_io.py):

- One ``for batch in loader`` is one epoch of this worker's part: every record of the
  part exactly once; with ``shuffle`` a new order each epoch (ImageRecordIter
  reshuffles inside the part at each reset).
- Parts: with an .idx, ImageRecordIter gives part p the records
  [p*s, min((p+1)*s, N)) of the .rec, s = ceil(N / num_parts). The parts together are
  the whole file, no record twice. The last part can be much smaller (N=9 in 4 parts:
  3, 3, 3, 0; an empty part would segfault ImageRecordIter, so it is refused here).
- Last partial batch: ImageRecordIter (round_batch=True, its default) fills it with
  the first records of the next epoch and then starts that epoch late (the following
  epoch is one batch short, and with shuffle some records are repeated and others
  skipped); with round_batch=False it fills the rest with stale rows of an earlier
  batch and still reports pad=0. RecordLoader always uses round_batch=False, knows
  the part size from the .idx, and applies ``last_batch``:
  'keep' (default) a smaller final batch; 'drop' no partial batch;
  'pad' a full batch whose last ``batch.pad`` rows repeat its first samples.
- Leaving a ``for`` early and starting a new one starts a new epoch at the beginning
  of the part (the rest is discarded), as does ``reset()``.
"""
import warnings

import mxnet as mx  # imported before .pipeline: its atexit hook must run after ours
import numpy as np

from . import recfile
from .batches import HostBufferPool, prepare
from .pipeline import BATCH, END, Prefetcher

LAST_BATCH = ("keep", "drop", "pad")
# ImageRecordIter options that change the image size before the crop: with any of them
# the data_shape fit check of the first record is skipped (it cannot predict the size)
_SIZE_OPTIONS = ("max_random_scale", "min_random_scale", "max_crop_size", "min_crop_size",
                 "pad", "min_img_size", "max_img_size", "rotate", "max_rotate_angle")
DTYPES = ("float32", "float16")


def default_part():
    """(num_parts, part_index) from the active distributed kvstore, else (1, 0)."""
    from mxhylo.kvstore.active import active

    kv = active()
    if kv is not None and "dist" in str(getattr(kv, "type", "")):
        return int(kv.num_workers), int(kv.rank)
    return 1, 0


def _contexts(ctx):
    if ctx is None:
        return [mx.cpu()]
    if isinstance(ctx, mx.Context):
        return [ctx]
    ctxs = list(ctx)
    if not ctxs or not all(isinstance(c, mx.Context) for c in ctxs):
        raise ValueError("ctx must be an mx.Context or a non-empty list of them, got %r" % (ctx,))
    return ctxs


def _channel_params(name, value, default):
    """ImageRecordIter's per-channel keywords (name_r/_g/_b) from a scalar or 3-sequence."""
    if value is None:
        return {}
    vals = [float(value)] * 3 if np.isscalar(value) else [float(v) for v in value]
    if len(vals) == 1:
        vals = vals * 3
    if len(vals) != 3:
        raise ValueError("%s must be a number or (r, g, b), got %r" % (name, value))
    if name == "std" and min(vals) <= 0:
        raise ValueError("std must be positive, got %r" % (value,))
    return {"%s_%s" % (name, c): v for c, v in zip("rgb", vals) if v != default}


class _RecordSource:
    """One part of a .rec through ImageRecordIter: ``epoch()`` yields prepared Batches."""

    def __init__(self, iter_kwargs, index, part, batch_size, num_batches, last_batch, ctxs,
                 dtype, path_imgrec, channels):
        self._index, self._part, self._rec = index, part, path_imgrec
        self._bs, self._nb, self._last = batch_size, num_batches, last_batch
        self._ctxs, self._dtype, self._channels = ctxs, dtype, channels
        self._part_size = part[1] - part[0]
        self._pool = HostBufferPool()
        # The CPU backend decodes the next batch straight into the buffer it returned
        # (behind the engine's back): copies must finish before next(). The prefetching
        # backend calls WaitToWrite on a buffer before reusing it, which waits for our
        # queued copies, so they can overlap the next decode.
        self._wait = iter_kwargs.get("ctx") == "cpu"
        try:
            self._iter = mx.io.ImageRecordIter(**iter_kwargs)  # decodes the first batch now
        except mx.base.MXNetError as err:
            raise self._diagnose(err, 0) from err

    def epoch(self):
        for i in range(self._nb):
            try:
                b = self._iter.next()
            except StopIteration:
                raise RuntimeError("ImageRecordIter ended after %d of %d batches of part %s"
                                   % (i, self._nb, self._part)) from None
            except mx.base.MXNetError as err:
                raise self._diagnose(err, i) from err
            real = min(self._bs, self._part_size - i * self._bs)
            yield prepare(b.data[0], b.label[0], real, self._bs, self._last, self._ctxs,
                          self._dtype, self._pool, wait=self._wait)

    def reset(self):
        self._iter.reset()

    def _diagnose(self, err, batch_no):
        """The record to blame for ``err``: a RecordDecodeError, else ``err`` itself.

        Looks at the positions of batch ``batch_no`` first (right without shuffle),
        then at the whole part.
        """
        lo, hi = self._part
        first = range(min(lo + batch_no * self._bs, hi), min(lo + (batch_no + 1) * self._bs, hi))
        for positions in (first, range(lo, hi)):
            found = recfile.find_undecodable(self._rec, self._index, positions, self._channels)
            if found:
                pos, key, offset, reason = found[0]
                return recfile.RecordDecodeError(
                    "record key %d (byte offset %d of %s, record %d of %d in the file) cannot "
                    "be decoded: %s. ImageRecordIter said: %s"
                    % (key, offset, self._rec, pos, len(self._index.keys), reason,
                       str(err).strip().splitlines()[-1]), key=key, offset=offset)
        return err


class RecordLoader:
    """Pipelined, rank-aware image batches from a .rec/.idx pair, split onto contexts.

    Parameters
    ----------
    path_imgrec, path_imgidx : str
        RecordIO files (``python -m mxhylo.im2rec`` writes them). Checked up front.
    batch_size : int
        Images per batch over all contexts of this worker.
    data_shape : (C, H, W)
        Output image shape, C in {1, 3}. Images are resized (``resize``) and cropped
        to H x W; an image smaller than H x W is refused (ImageRecordIter would stretch it).
    ctx : mx.Context or list of them (default cpu)
        Each batch is split along axis 0 into near-equal slices, one per context.
    shuffle, seed : record order, reshuffled each epoch within this worker's part.
    resize : int, shorter side in pixels before cropping (-1: keep).
    rand_crop : random instead of centre H x W crop.
    random_resized_crop, min_random_area, max_random_area, min_aspect_ratio,
    max_aspect_ratio : Inception-style crop of a random area fraction / aspect ratio,
        resized to H x W.
    rand_mirror : horizontal flip with probability 0.5.
    brightness, contrast, saturation, pca_noise : colour jitter strengths (0: off).
    mean, std : per-channel (R, G, B) or scalar, in 0..255 pixel units:
        output = (pixel - mean) / std.
    dtype : 'float32' or 'float16' (cast on the background thread, on the device for GPUs).
    num_parts, part_index : this worker's shard; default: the active distributed
        kvstore's num_workers / rank (mxhylo.kvstore.active), else 1 / 0.
    last_batch : 'keep' | 'drop' | 'pad' (see the module docstring).
    preprocess_threads : decoding threads of ImageRecordIter's prefetching backend.
    prefetch : batches prepared ahead on the background thread (queue bound);
        0: no thread, each batch is decoded when the loop asks (for comparison).
    iter_ctx : ImageRecordIter backend: 'cpu' (decodes inside next(), with MXNet's
        OpenMP threads, no prefetch; fastest here) or 'gpu' (its own prefetch thread,
        ``preprocess_threads`` decoders, pinned memory for GPU copies). Default: 'gpu'
        when any ctx is a GPU, else 'cpu'.
    label_width : labels per record; default: read from the first record.
    **iter_kwargs : further ImageRecordIter options (e.g. inter_method, max_rotate_angle).

    Iterating yields :class:`mxhylo.io.batches.Batch` tuples ``(data_list, label_list)``.
    ``len(loader)`` is the number of batches per epoch of this part.
    """

    def __init__(self, path_imgrec, path_imgidx, batch_size, data_shape, ctx=None,
                 shuffle=False, seed=0, resize=-1, rand_crop=False,
                 random_resized_crop=False, min_random_area=0.08, max_random_area=1.0,
                 min_aspect_ratio=3.0 / 4.0, max_aspect_ratio=4.0 / 3.0, rand_mirror=False,
                 brightness=0.0, contrast=0.0, saturation=0.0, pca_noise=0.0,
                 mean=None, std=None, dtype="float32", num_parts=None, part_index=None,
                 last_batch="keep", preprocess_threads=4, prefetch=2, iter_ctx=None,
                 label_width=None, **iter_kwargs):
        data_shape = self._check_shape(data_shape)
        if int(batch_size) < 1:
            raise ValueError("batch_size must be >= 1, got %r" % batch_size)
        if dtype not in DTYPES:
            raise ValueError("dtype must be one of %s, got %r" % (DTYPES, dtype))
        if last_batch not in LAST_BATCH:
            raise ValueError("last_batch must be one of %s, got %r" % (LAST_BATCH, last_batch))
        if int(prefetch) < 0:
            raise ValueError("prefetch must be >= 0, got %r" % prefetch)
        self.batch_size, self.data_shape, self.dtype = int(batch_size), data_shape, dtype
        self.last_batch, self.prefetch = last_batch, int(prefetch)
        self.ctx = _contexts(ctx)

        self.index = recfile.check_record_files(path_imgrec, path_imgidx)
        if num_parts is None and part_index is None:
            num_parts, part_index = default_part()
        elif num_parts is None or part_index is None:
            if num_parts not in (None, 1) or part_index not in (None, 0):
                raise ValueError("give both num_parts and part_index, or neither (then they "
                                 "come from the distributed kvstore)")
            num_parts, part_index = 1, 0
        self.num_parts, self.part_index = int(num_parts), int(part_index)
        if not 0 <= self.part_index < self.num_parts:
            raise ValueError("part_index must be in [0, %d), got %d" % (self.num_parts, self.part_index))
        n = len(self.index.keys)
        self.part = recfile.part_range(n, self.num_parts, self.part_index)
        self.part_size = self.part[1] - self.part[0]
        if self.part_size == 0:
            raise ValueError("part %d of %d of %s is empty: ImageRecordIter cuts parts of "
                             "ceil(%d/%d) records; use fewer parts"
                             % (self.part_index, self.num_parts, path_imgrec, n, self.num_parts))
        self.num_batches = self._batches(self.part_size)
        if self.num_batches == 0:
            raise ValueError("last_batch='drop' and the part has only %d records < batch_size %d"
                             % (self.part_size, self.batch_size))
        self._warn_unequal_parts(n)
        free_size = random_resized_crop or any(k in iter_kwargs for k in _SIZE_OPTIONS)
        first_width = self._first_record_check(path_imgrec, resize, free_size)
        label_width = first_width if label_width is None else label_width

        if iter_ctx is None:
            iter_ctx = "gpu" if any(c.device_type == "gpu" for c in self.ctx) else "cpu"
        if iter_ctx not in ("cpu", "gpu"):
            raise ValueError("iter_ctx must be 'cpu' or 'gpu', got %r" % iter_ctx)
        gpus = [c for c in self.ctx if c.device_type == "gpu"]
        kwargs = dict(
            path_imgrec=path_imgrec, path_imgidx=path_imgidx, data_shape=data_shape,
            batch_size=self.batch_size, label_width=int(label_width), shuffle=bool(shuffle),
            seed=int(seed), num_parts=self.num_parts, part_index=self.part_index,
            round_batch=False,  # see the module docstring: we handle the last batch
            preprocess_threads=int(preprocess_threads), ctx=iter_ctx,
            # device_id -1: plain CPU memory; a GPU id: pinned memory for fast copies there
            device_id=gpus[0].device_id if (iter_ctx == "gpu" and gpus) else -1,
            resize=int(resize), rand_crop=bool(rand_crop), rand_mirror=bool(rand_mirror),
            brightness=float(brightness), contrast=float(contrast),
            saturation=float(saturation), pca_noise=float(pca_noise), verbose=False)
        if random_resized_crop:
            kwargs.update(random_resized_crop=True, min_random_area=float(min_random_area),
                          max_random_area=float(max_random_area),
                          min_aspect_ratio=float(min_aspect_ratio),
                          max_aspect_ratio=float(max_aspect_ratio))
        kwargs.update(_channel_params("mean", mean, 0.0))
        kwargs.update(_channel_params("std", std, 1.0))
        kwargs.update(iter_kwargs)
        self.iter_kwargs = kwargs
        self._source = _RecordSource(kwargs, self.index, self.part, self.batch_size,
                                     self.num_batches, last_batch, self.ctx, dtype,
                                     path_imgrec, data_shape[0])
        self._prefetcher = None
        self._fresh = True  # the source is at the start of an epoch nobody has consumed
        self.reset_stats()
        self._start()

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_shape(data_shape):
        try:
            shape = tuple(int(d) for d in data_shape)
        except (TypeError, ValueError):
            raise ValueError("data_shape must be (C, H, W), got %r" % (data_shape,)) from None
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError("data_shape must be (C, H, W) of positive ints, got %r" % (data_shape,))
        if shape[0] not in (1, 3):
            raise ValueError("data_shape channels must be 1 (grey) or 3 (RGB), got %d" % shape[0])
        return shape

    def _batches(self, size):
        full, rest = divmod(size, self.batch_size)
        return full + (1 if rest and self.last_batch != "drop" else 0)

    def _warn_unequal_parts(self, n):
        counts = {self._batches(max(0, e - b)) for b, e in
                  (recfile.part_range(n, self.num_parts, p) for p in range(self.num_parts))}
        if len(counts) > 1:
            warnings.warn("the %d parts of %d records give %s batches per epoch: synchronous "
                          "data-parallel workers would wait for each other at the end of an "
                          "epoch; stop each epoch after min(...) steps or change batch_size"
                          % (self.num_parts, n, sorted(counts)), stacklevel=3)

    def _first_record_check(self, path_imgrec, resize, free_size):
        """Decode the part's first record: label width, and whether data_shape fits it."""
        pos = self.part[0]
        key, offset = int(self.index.keys[pos]), int(self.index.offsets[pos])
        flag = 0 if self.data_shape[0] == 1 else 1
        with open(path_imgrec, "rb") as f:
            rec_flag, _, _, img = recfile.decode_payload(recfile.read_payload(f, offset), flag)
        if img is None:
            raise recfile.RecordDecodeError(
                "record key %d (byte offset %d of %s) cannot be decoded as an image"
                % (key, offset, path_imgrec), key=key, offset=offset)
        h, w = img.shape[:2]
        if resize > 0:
            s = float(resize) / min(h, w)
            h, w = int(round(h * s)), int(round(w * s))
        _, oh, ow = self.data_shape
        # 1 pixel of slack: rounding of the resize is ImageRecordIter's business
        if not free_size and (oh > h + 1 or ow > w + 1):
            raise ValueError(
                "data_shape %s does not fit: record key %d is %dx%d (HxW)%s, smaller than %dx%d; "
                "ImageRecordIter would stretch it. Use resize=%d or a smaller data_shape"
                % (self.data_shape, key, h, w, " after resize=%d" % resize if resize > 0 else "",
                   oh, ow, max(oh, ow)))
        return max(1, rec_flag)

    # ------------------------------------------------------------------ iteration
    def __len__(self):
        return self.num_batches

    def __iter__(self):
        if not self._fresh:
            self.reset()  # the previous epoch was left early (or failed): start over
        self._fresh = False
        return self._threaded() if self.prefetch > 0 else self._inline()

    def _start(self):
        # started eagerly (construction, reset): decoding overlaps whatever the program
        # does before its first step, e.g. building and initialising the network
        if self.prefetch > 0 and self._prefetcher is None:
            self._prefetcher = Prefetcher(self._source, self.prefetch)

    def _threaded(self):
        self._start()
        clock, stats = _Clock(self._stats), self._stats
        while True:
            kind, item = self._prefetcher.get()
            if kind == BATCH:
                clock.delivered(item)
                yield item
                clock.resumed()
            elif kind == END:
                # the thread is already decoding the next epoch: nothing to reset
                stats["epochs"] += 1
                self._fresh = True
                return
            else:
                self._stop_thread()
                raise item

    def _inline(self):
        clock, stats = _Clock(self._stats), self._stats
        counters = self._inline_counters
        gen = self._source.epoch()
        while True:
            t0 = _now()
            item = next(gen, None)
            counters["busy_s"] += _now() - t0
            if item is None:
                break
            counters["batches"] += 1
            counters["images"] += item.size
            clock.delivered(item)
            yield item
            clock.resumed()
        self._source.reset()
        stats["epochs"] += 1
        self._fresh = True

    def reset(self):
        """Discard prefetched batches; the next ``for`` starts an epoch at the part's start."""
        self._rewind()
        self._start()

    def close(self):
        """Stop the background thread (also done at garbage collection and interpreter exit).

        The loader stays usable: the next ``for`` restarts it at the start of an epoch.
        """
        self._rewind()

    def _rewind(self):
        # The producer may have gone on into the next epoch, so stopping it always
        # leaves the source somewhere unknown: rewind it to an epoch start.
        self._stop_thread()
        self._source.reset()
        self._fresh = True

    def _stop_thread(self):
        p, self._prefetcher = self._prefetcher, None
        if p is not None:
            self._producer_done = _add(self._producer_done, p.counters)
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._stop_thread()  # no rewind: MXNet may be shutting down
        except Exception:
            pass

    # ------------------------------------------------------------------ stats
    def reset_stats(self):
        """Zero the counters reported by :meth:`stats`."""
        self._stats = {"batches": 0, "images": 0, "epochs": 0, "wait_s": 0.0, "loop_s": 0.0}
        self._inline_counters = {"busy_s": 0.0, "batches": 0, "images": 0}
        self._producer_done = {"busy_s": 0.0, "batches": 0, "images": 0}
        if getattr(self, "_prefetcher", None) is not None:
            for k in self._prefetcher.counters:  # the live producer's counters restart too
                self._prefetcher.counters[k] = 0 if k != "busy_s" else 0.0

    def stats(self):
        """What the training loop saw since the last reset_stats().

        images_per_s: images delivered / loop_s. loop_s: wall time the loop spent in
        epochs (from asking for each batch to asking for the next, summed: waiting +
        the loop's own work). wait_s: time blocked waiting for a batch; wait_fraction
        = wait_s / loop_s. decode_images_per_s: images prepared / time the producer
        spent preparing them (decode, augment, split, cast, copy): the pipeline's own
        capacity, whether or not the loop was fast enough to use it.
        """
        s = dict(self._stats)
        prod = _add(self._producer_done, self._inline_counters)
        if self._prefetcher is not None:
            prod = _add(prod, self._prefetcher.counters)
        s["images_per_s"] = s["images"] / s["loop_s"] if s["loop_s"] > 0 else 0.0
        s["wait_fraction"] = s["wait_s"] / s["loop_s"] if s["loop_s"] > 0 else 0.0
        s["decode_s"] = prod["busy_s"]
        s["decode_images_per_s"] = prod["images"] / prod["busy_s"] if prod["busy_s"] > 0 else 0.0
        return s


def _add(a, b):
    return {k: a[k] + b[k] for k in a}


def _now():
    import time

    return time.perf_counter()


class _Clock:
    """Accumulates wait_s and loop_s for one epoch of iteration into ``stats``.

    loop_s gets each wait when the batch is delivered and each step when the loop asks
    again, so a loop that breaks early still has wait_s <= loop_s.
    """

    def __init__(self, stats):
        self.stats = stats
        self.t_ask = _now()  # the loop asked for a batch at this time
        self.t_delivered = self.t_ask

    def delivered(self, batch):
        now = _now()
        self.stats["wait_s"] += now - self.t_ask
        self.stats["loop_s"] += now - self.t_ask
        self.stats["batches"] += 1
        self.stats["images"] += batch.size
        self.t_delivered = now

    def resumed(self):
        now = _now()  # the loop is back for the next batch: its step took this long
        self.stats["loop_s"] += now - self.t_delivered
        self.t_ask = now
