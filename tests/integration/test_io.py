"""mxhylo.io and python -m mxhylo.im2rec: round trip, sharding, last batch, errors, threads.

Correctness only; speed is measured by ``python -m mxhylo.bench io``.
"""
import collections
import os
import subprocess
import sys
import threading
import time

import mxnet as mx
import numpy as np
import pytest

from mxhylo import im2rec
from mxhylo.io import RecordDecodeError, RecordFileError, RecordLoader, packing, recfile
from mxhylo.io.digits_sample import digit_image, digits_arrays, split_indices
from mxhylo.io.pipeline import Prefetcher

SIZE = 32  # digits upscaled to 32x32
# 1348 records in 3 parts of 64-image batches give 8, 8 and 7 batches: warned about once
# in test_unequal_batch_counts_are_warned, expected everywhere else.
pytestmark = pytest.mark.filterwarnings("ignore:the 3 parts of")


def _cli(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mxhylo.im2rec", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def digits():
    images, labels = digits_arrays()
    return images, labels


@pytest.fixture(scope="module")
def png_sample(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("digits_png"))
    assert im2rec.main(["--digits", out, "--size", str(SIZE), "--encoding", ".png",
                        "--no-progress", "--num-workers", "2"]) == 0
    return out


@pytest.fixture(scope="module")
def id_rec(png_sample, tmp_path_factory):
    """The digits train split packed from a .lst whose labels are (class, sklearn index)."""
    out = str(tmp_path_factory.mktemp("digits_ids"))
    items = packing.read_list(os.path.join(png_sample, "digits_train.lst"))
    lst = os.path.join(out, "ids.lst")
    packing.write_list(lst, [(i, [labels[0], float(i)], rel) for i, labels, rel in items])
    assert im2rec.main([os.path.join(out, "ids"), lst, "--root",
                        os.path.join(png_sample, "images"), "--encoding", ".png",
                        "--color", "0", "--no-progress", "--num-workers", "1"]) == 0
    prefix = os.path.join(out, "ids")
    return prefix + ".rec", prefix + ".idx", [i for i, _, _ in items]


def _ids(loader):
    """Sample ids of one epoch (second label column), padding rows excluded."""
    ids = []
    for batch in loader:
        rows = np.concatenate([y.asnumpy() for y in batch.label])
        ids.extend(rows[:len(rows) - batch.pad, 1].astype(int).tolist())
    return ids


# ----------------------------------------------------------------------------- round trip
def test_digits_png_round_trip_is_exact(png_sample, digits):
    images, labels = digits
    prefix = os.path.join(png_sample, "digits_val")
    order = [i for i, _, _ in packing.read_list(prefix + ".lst")]
    train, val = split_indices(len(labels))
    assert sorted(order) == sorted(val.tolist())  # the split of mxhylo.data.load_digits
    loader = RecordLoader(prefix + ".rec", prefix + ".idx", 64, (1, SIZE, SIZE))
    seen = 0
    for data, label in loader:
        x, y = data[0].asnumpy(), label[0].asnumpy()
        for row in range(len(y)):
            i = order[seen + row]
            assert y[row] == labels[i]
            np.testing.assert_array_equal(x[row, 0], digit_image(images, i, SIZE))
        seen += len(y)
    assert seen == len(val)


def test_digits_jpeg_round_trip_within_tolerance(tmp_path, digits):
    images, labels = digits
    assert im2rec.main(["--digits", str(tmp_path), "--size", str(SIZE), "--quality", "95",
                        "--no-progress", "--num-workers", "1"]) == 0
    prefix = str(tmp_path / "digits_train")
    order = [i for i, _, _ in packing.read_list(prefix + ".lst")]
    loader = RecordLoader(prefix + ".rec", prefix + ".idx", 128, (3, SIZE, SIZE), shuffle=False)
    errors, seen = [], 0
    for data, label in loader:
        x, y = data[0].asnumpy(), label[0].asnumpy()
        for row in range(len(y)):
            i = order[seen + row]
            assert y[row] == labels[i]
            assert np.all(x[row, 0] == x[row, 2])  # grey JPEG read as 3 equal channels
            errors.append(np.abs(x[row, 0] - digit_image(images, i, SIZE)).mean())
        seen += len(y)
    assert seen == len(order)
    assert np.mean(errors) < 2.0 and np.max(errors) < 5.0  # 0..255 scale, quality 95


def test_records_readable_by_mxnet_record_dataset(png_sample, digits):
    """gluoncv's classification scripts read .rec files through this dataset class."""
    images, labels = digits
    prefix = os.path.join(png_sample, "digits_val")
    ds = mx.gluon.data.vision.ImageRecordDataset(prefix + ".rec", flag=0)
    order = [i for i, _, _ in packing.read_list(prefix + ".lst")]
    assert len(ds) == len(order)
    for pos in (0, 7, len(ds) - 1):
        img, label = ds[pos]
        assert label == labels[order[pos]]
        np.testing.assert_array_equal(img.asnumpy()[:, :, 0], digit_image(images, order[pos], SIZE))


def test_im2rec_folder_cli_split_resize_and_workers(png_sample, tmp_path):
    prefix = str(tmp_path / "fold")
    res = _cli(prefix, os.path.join(png_sample, "images"), "--val-fraction", "0.2",
               "--resize", "16", "--num-workers", "2", "--no-progress")
    assert res.returncode == 0, res.stderr
    train = packing.read_list(prefix + "_train.lst")
    val = packing.read_list(prefix + "_val.lst")
    assert len(train) + len(val) == 1797
    per_class = collections.Counter(int(lab[0]) for _, lab, _ in val)
    assert set(per_class) == set(range(10)) and min(per_class.values()) >= 30  # stratified
    assert [l for _, l, _ in train[:20]] != sorted(l for _, l, _ in train[:20])  # shuffled
    loader = RecordLoader(prefix + "_val.rec", prefix + "_val.idx", 50, (1, 16, 16))
    assert sum(b.size for b in loader) == len(val)


def test_im2rec_bad_image_names_the_file(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "broken.png").write_bytes(b"not a png")
    res = _cli(str(tmp_path / "out"), str(tmp_path / "src"), "--no-progress")
    assert res.returncode != 0 and "broken.png" in res.stderr


# ----------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("shuffle,iter_ctx", [(False, "cpu"), (True, "cpu"), (True, "gpu")])
def test_three_parts_cover_the_data_once_every_epoch(id_rec, shuffle, iter_ctx):
    """iter_ctx='gpu' is ImageRecordIter's prefetching backend (plain CPU memory here)."""
    rec, idx, all_ids = id_rec
    loaders = [RecordLoader(rec, idx, 64, (1, SIZE, SIZE), shuffle=shuffle, num_parts=3,
                            part_index=p, last_batch="keep", iter_ctx=iter_ctx)
               for p in range(3)]
    assert [l.part_size for l in loaders] == [450, 450, 448]  # ceil(1348 / 3) per part
    orders = []
    for epoch in range(3):
        shards = [_ids(l) for l in loaders]
        union = [i for s in shards for i in s]
        assert sorted(union) == sorted(all_ids), "epoch %d: not every sample exactly once" % epoch
        orders.append(shards[0])
    if shuffle:
        assert orders[0] != orders[1] != orders[2]
    else:
        assert orders[0] == orders[1] == all_ids[:450]


def test_part_formula_matches_imagerecorditer(id_rec):
    """The facts RecordLoader relies on, checked against ImageRecordIter itself."""
    rec, idx, all_ids = id_rec
    n = len(all_ids)
    for k, bs in [(3, 100), (4, 500), (5, 7), (7, 1000)]:
        for p in range(k):
            lo, hi = recfile.part_range(n, k, p)
            it = mx.io.ImageRecordIter(path_imgrec=rec, path_imgidx=idx, data_shape=(1, SIZE, SIZE),
                                       batch_size=bs, label_width=2, round_batch=False, ctx="cpu",
                                       num_parts=k, part_index=p, verbose=False)
            batches = [b.label[0].asnumpy()[:, 1].astype(int) for b in it]
            assert len(batches) == -(-(hi - lo) // bs)
            real = np.concatenate(batches)[:hi - lo]  # round_batch=False: pad=0, stale rows after
            assert real.tolist() == all_ids[lo:hi]


def test_round_batch_true_shortens_the_next_epoch(id_rec):
    """Why RecordLoader does not use round_batch=True: epoch 2 starts late and is short."""
    rec, idx, all_ids = id_rec
    it = mx.io.ImageRecordIter(path_imgrec=rec, path_imgidx=idx, data_shape=(1, SIZE, SIZE),
                               batch_size=100, label_width=2, round_batch=True, ctx="cpu",
                               verbose=False)
    counts = []
    for _ in range(2):
        counts.append(sum(1 for _ in it))
        it.reset()
    assert counts == [14, 13]


def test_default_parts_come_from_a_distributed_kvstore(id_rec, monkeypatch):
    from mxhylo.kvstore import active

    rec, idx, _ = id_rec

    class FakeKV:
        type, num_workers, rank = "dist_sync_hylo", 3, 1

    monkeypatch.setattr(active, "_ACTIVE", lambda: FakeKV)   # (a weak reference)
    loader = RecordLoader(rec, idx, 64, (1, SIZE, SIZE))
    assert (loader.num_parts, loader.part_index, loader.part) == (3, 1, (450, 900))
    FakeKV.type = "local"
    loader = RecordLoader(rec, idx, 64, (1, SIZE, SIZE))
    assert (loader.num_parts, loader.part_index) == (1, 0)


def test_unequal_batch_counts_are_warned(id_rec):
    rec, idx, _ = id_rec
    with pytest.warns(UserWarning, match=r"\[7, 8\] batches per epoch"):
        RecordLoader(rec, idx, 64, (1, SIZE, SIZE), num_parts=3, part_index=0)


def test_empty_part_is_refused_not_a_segfault(png_sample, tmp_path):
    items = packing.read_list(os.path.join(png_sample, "digits_val.lst"))[:9]
    packing.pack_items(items, os.path.join(png_sample, "images"), str(tmp_path / "nine"),
                       color=0, progress=False)
    with pytest.raises(ValueError, match="empty"):
        RecordLoader(str(tmp_path / "nine.rec"), str(tmp_path / "nine.idx"), 2, (1, SIZE, SIZE),
                     num_parts=4, part_index=3)


# ----------------------------------------------------------------------------- batches
def test_last_batch_modes_and_context_split(id_rec):
    rec, idx, all_ids = id_rec
    ctxs = [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
    keep = RecordLoader(rec, idx, 64, (1, SIZE, SIZE), ctx=ctxs, num_parts=3, part_index=0)
    batches = list(keep)
    assert len(batches) == len(keep) == 8  # 450 = 7 * 64 + 2
    assert [x.shape[0] for x in batches[0].data] == [21, 22, 21]
    assert [x.context for x in batches[0].data] == ctxs
    last = batches[-1]
    assert last.size == 2 and [x.shape[0] for x in last.data] == [1, 1] and last.ctx == ctxs[:2]
    drop = RecordLoader(rec, idx, 64, (1, SIZE, SIZE), num_parts=3, part_index=0, last_batch="drop")
    assert len(drop) == 7 and all(b.size == 64 for b in drop)
    pad = RecordLoader(rec, idx, 64, (1, SIZE, SIZE), num_parts=3, part_index=0, last_batch="pad")
    batches = list(pad)
    last = batches[-1]
    assert last.data[0].shape[0] == 64 and (last.size, last.pad) == (2, 62)
    y = last.label[0].asnumpy()[:, 1]
    assert y[2:].tolist() == np.resize(y[:2], 62).tolist()  # repeats of the real rows
    assert sorted(_ids(pad)) == sorted(all_ids[:450])


def test_float16_and_augmentations(png_sample):
    prefix = os.path.join(png_sample, "digits_train")
    loader = RecordLoader(prefix + ".rec", prefix + ".idx", 32, (3, 24, 24), dtype="float16",
                          shuffle=True, random_resized_crop=True, rand_mirror=True,
                          brightness=0.2, contrast=0.2, saturation=0.2, mean=(123.7, 116.3, 103.5),
                          std=(58.4, 57.1, 57.4))
    batch = next(iter(loader))
    x = batch.data[0]
    assert x.dtype == np.float16 and x.shape == (32, 3, 24, 24)
    assert np.isfinite(x.asnumpy()).all() and -2.5 < float(x.asnumpy().mean()) < 2.5
    loader.close()
    plain = RecordLoader(prefix + ".rec", prefix + ".idx", 8, (1, SIZE, SIZE), mean=100, std=2)
    raw = RecordLoader(prefix + ".rec", prefix + ".idx", 8, (1, SIZE, SIZE))
    np.testing.assert_allclose(next(iter(plain)).data[0].asnumpy(),
                               (next(iter(raw)).data[0].asnumpy() - 100) / 2, atol=1e-4)


def test_early_break_and_reset_restart_the_epoch(id_rec):
    rec, idx, all_ids = id_rec
    for prefetch in (0, 2):
        loader = RecordLoader(rec, idx, 100, (1, SIZE, SIZE), prefetch=prefetch)
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert _ids(loader) == all_ids  # a new for: a whole epoch from the start
        it = iter(loader)
        next(it)
        loader.reset()
        assert _ids(loader) == all_ids
        assert _ids(loader) == all_ids  # consecutive epochs, no reset needed
        time.sleep(0.1)  # the thread runs on into the next epoch...
        loader.close()  # ...and close() must rewind it
        assert _ids(loader) == all_ids
        stats = loader.stats()
        assert stats["epochs"] == 4 and stats["images"] >= 4 * len(all_ids)
        assert 0 <= stats["wait_fraction"] <= 1 and stats["decode_images_per_s"] > 0
        loader.close()


# ----------------------------------------------------------------------------- errors
def test_missing_and_corrupt_files(id_rec, tmp_path):
    rec, idx, _ = id_rec
    shape = (1, SIZE, SIZE)
    with pytest.raises(FileNotFoundError, match="nope.rec"):
        RecordLoader(str(tmp_path / "nope.rec"), idx, 8, shape)
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        RecordLoader(rec, str(tmp_path / "nope.idx"), 8, shape)
    garbage = tmp_path / "garbage.idx"
    garbage.write_text("hello world\n")
    with pytest.raises(RecordFileError, match="garbage.idx:1"):
        RecordLoader(rec, str(garbage), 8, shape)
    data = open(rec, "rb").read()
    (tmp_path / "trunc.rec").write_bytes(data[:len(data) // 2])
    with pytest.raises(RecordFileError, match="truncated"):
        RecordLoader(str(tmp_path / "trunc.rec"), idx, 8, shape)
    shifted = tmp_path / "shifted.idx"
    shifted.write_text("".join("%s\t%d\n" % (k, int(o) + 4) for k, o in
                               (line.split("\t") for line in open(idx))))
    with pytest.raises(RecordFileError, match="no record starts"):
        RecordLoader(rec, str(shifted), 8, shape)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_undecodable_record_is_named_in_the_training_loop(png_sample, tmp_path, prefetch):
    from mxnet.recordio import MXIndexedRecordIO

    items = packing.read_list(os.path.join(png_sample, "digits_val.lst"))[:40]
    writer = MXIndexedRecordIO(str(tmp_path / "bad.idx"), str(tmp_path / "bad.rec"), "w")
    for pos, (i, labels, rel) in enumerate(items):
        payload = open(os.path.join(png_sample, "images", rel), "rb").read()
        writer.write_idx(i, packing.pack_record(i, labels, b"garbage!" * 8 if pos == 25 else payload))
    writer.close()
    loader = RecordLoader(str(tmp_path / "bad.rec"), str(tmp_path / "bad.idx"), 10, (1, SIZE, SIZE),
                          prefetch=prefetch)
    got = []
    with pytest.raises(RecordDecodeError, match="record key %d " % items[25][0]) as info:
        for batch in loader:
            got.append(batch.size)
    assert got == [10, 10] and info.value.key == items[25][0]
    loader.close()


def test_data_shape_that_does_not_fit(png_sample):
    prefix = os.path.join(png_sample, "digits_val")
    rec, idx = prefix + ".rec", prefix + ".idx"
    with pytest.raises(ValueError, match="does not fit.*resize=64"):
        RecordLoader(rec, idx, 8, (1, 64, 64))
    for bad in [(2, SIZE, SIZE), (SIZE, SIZE), (1, 0, SIZE)]:
        with pytest.raises(ValueError, match="data_shape"):
            RecordLoader(rec, idx, 8, bad)
    loader = RecordLoader(rec, idx, 8, (1, 64, 64), resize=64)  # enlarging on purpose is fine
    assert next(iter(loader)).data[0].shape == (8, 1, 64, 64)
    loader.close()


# ----------------------------------------------------------------------------- threads
def test_worker_exception_surfaces_and_thread_stops():
    class Failing:
        def epoch(self):
            yield _Item()
            raise KeyError("boom in the worker")

        def reset(self):
            pass

    class _Item:
        size = 1

    p = Prefetcher(Failing(), depth=2)
    assert p.get()[0] == "batch"
    kind, err = p.get()
    assert kind == "error" and isinstance(err, KeyError)
    p.close()
    assert not p.alive


def test_close_stops_a_thread_blocked_on_a_full_queue(id_rec):
    rec, idx, _ = id_rec
    loader = RecordLoader(rec, idx, 16, (1, SIZE, SIZE), prefetch=1)
    next(iter(loader))
    time.sleep(0.2)  # the producer fills the queue and blocks
    names = {t.name for t in threading.enumerate()}
    assert "mxhylo-io" in names
    loader.close()
    assert "mxhylo-io" not in {t.name for t in threading.enumerate()}


def test_interpreter_exit_with_a_running_loader_does_not_hang(id_rec):
    rec, idx, _ = id_rec
    code = ("from mxhylo.io import RecordLoader\n"
            "l = RecordLoader(%r, %r, 16, (1, 32, 32), prefetch=4)\n"
            "it = iter(l); held = next(it); print('ok')\n" % (rec, idx))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert time.time() - t0 < 30


def test_pooled_buffers_are_not_reused_while_a_view_is_alive():
    from mxhylo.io.batches import HostBufferPool

    pool = HostBufferPool(per_shape=2)
    a = pool.take((4, 3), "float32")
    a[:] = 1
    view = a[1:2]
    del a
    b = pool.take((4, 3), "float32")  # the first buffer is still used by the view
    b[:] = 2
    assert view.asnumpy().tolist() == [[1, 1, 1]]
    del b, view
    c = pool.take((4, 3), "float32")
    assert len(pool._bufs[((4, 3), np.dtype("float32").str)]) == 2  # reused, not grown
    held = [c, pool.take((4, 3), "float32")]
    extra = pool.take((4, 3), "float32")  # both held: a plain array, not retained
    assert extra.shape == (4, 3) and len(pool._bufs[((4, 3), np.dtype("float32").str)]) == 2
    del held
