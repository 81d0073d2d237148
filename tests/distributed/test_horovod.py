"""The hylo store over Horovod (kvstore.transport_horovod), with 2 processes started by
``horovodrun -np 2 -H localhost:2 --gloo`` (tests/distributed/jobs/hvd_worker.py), plus the blob layout
(kvstore.wire) and the traffic formulas against numpy and a step-by-step ring."""
import json
import os
import re
import signal
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from proc_helpers import processes_mentioning

import mxhylo
from mxhylo.kvstore.compressors import make_compressors
from mxhylo.kvstore.memory import ResidualMemory
from mxhylo.kvstore.policy import LayerPlan
from mxhylo.kvstore.transport_horovod import (HorovodTransport, launched_by_horovodrun,
                                              ring_allgather_bytes, ring_allreduce_bytes)
from mxhylo.kvstore.wire import blob_payloads, payload_blob

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(ROOT, "tests", "distributed", "jobs", "hvd_worker.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


# -- the blob layout ----------------------------------------------------------------------

def _plan(strategy, shape, k=None):
    return LayerPlan("layer", tuple(shape), strategy, k=k)


@pytest.mark.parametrize("strategy, shape", [("conv_topk", (24, 3, 3, 3)),
                                             ("fc_2bit", (37, 29)), ("fp16", (5, 13)),
                                             ("none", (7, 3))])
def test_blobs_of_every_worker_decode_to_the_numpy_sum(strategy, shape):
    """Three workers' payloads (conv_topk: a different k each, so blobs of different
    sizes) concatenated as an allgather returns them: read back one by one, each
    decodes to what its worker sent, and their sum equals numpy's."""
    rng = np.random.RandomState(3)
    codecs = make_compressors()
    blobs, sent = [], []
    for w in range(3):
        grad = rng.randn(*shape).astype(np.float32)
        plan = _plan(strategy, shape, k=2 + 3 * w if strategy == "conv_topk" else None)
        payload = codecs[strategy].encode(plan, mx.nd.array(grad), ResidualMemory())
        blobs.append(payload_blob(payload))
        # what was sent, by numpy (the residual starts at zero)
        if strategy == "conv_topk":
            idx = payload.arrays[0].asnumpy()
            expect = np.zeros_like(grad)
            expect[idx] = grad[idx]
        elif strategy == "fc_2bit":
            t = np.float32(np.abs(grad).mean())             # the first step's threshold
            v = np.float32(payload.scalars[0])              # the mean |grad| sent
            assert v == pytest.approx(np.abs(grad[np.abs(grad) >= t]).mean(), rel=1e-6)
            expect = np.where(grad >= t, v, np.where(grad <= -t, -v, 0)).astype(np.float32)
        elif strategy == "fp16":
            expect = grad.astype(np.float16).astype(np.float32)
        else:
            expect = grad
        sent.append(expect)
    assert len(set(len(b) for b in blobs)) == (3 if strategy == "conv_topk" else 1)
    read = blob_payloads(np.concatenate(blobs), shape)
    assert [b.nbytes for b in read] == [len(b) for b in blobs]
    total = mx.nd.zeros(shape)
    for b, expect in zip(read, sent):
        one = mx.nd.zeros(shape)
        codecs[b.payload.strategy].decode(b.payload, one.reshape(b.payload.shape))
        np.testing.assert_array_equal(one.asnumpy(), expect)
        codecs[b.payload.strategy].decode(b.payload, total.reshape(b.payload.shape),
                                          accumulate=True)
    np.testing.assert_allclose(total.asnumpy(), sum(sent), rtol=1e-6, atol=1e-6)


def test_a_truncated_or_corrupt_blob_is_an_error():
    payload = make_compressors()["fc_2bit"].encode(
        _plan("fc_2bit", (40, 40)), mx.nd.ones((40, 40)), ResidualMemory())
    blob = payload_blob(payload)
    with pytest.raises(ValueError, match="truncated header"):
        blob_payloads(np.concatenate([blob, blob[:7]]), (40, 40))
    with pytest.raises(ValueError, match="corrupt header"):
        blob_payloads(blob[:-4], (40, 40))
    with pytest.raises(ValueError, match="needs"):
        blob_payloads(blob, (80, 40))       # another layer's shape


# -- traffic: the formulas against a step-by-step ring -----------------------------------

def _ring_allgather(sizes, rank):
    """Gloo's allgatherv loop: at step i worker r sends block (r - i) mod W to r + 1."""
    w = len(sizes)
    sent = sum(sizes[(rank - i) % w] for i in range(w - 1))
    received = sum(sizes[(rank - i - 1) % w] for i in range(w - 1))
    return sent, received


@pytest.mark.parametrize("sizes", [[100], [100, 40], [8, 16, 24, 32], [5, 5, 5, 5, 5, 7]])
def test_allgather_traffic_is_the_rings(sizes):
    for rank in range(len(sizes)):
        assert ring_allgather_bytes(sizes, rank) == _ring_allgather(sizes, rank)


def test_allreduce_traffic_is_the_rings():
    # reduce-scatter then allgather: W - 1 segments of n / W bytes each way, twice
    for w in (1, 2, 4, 8):
        n = 4 * 1000 * w
        assert ring_allreduce_bytes(n, w) == 2 * (w - 1) * (n // w)


# -- choosing the transport, and its errors ------------------------------------------------

def test_auto_picks_horovod_only_under_horovodrun():
    assert launched_by_horovodrun({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"})
    assert not launched_by_horovodrun({"HOROVOD_RANK": "0"})
    assert not launched_by_horovodrun({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2",
                                       "DMLC_ROLE": "worker"})
    assert not launched_by_horovodrun({})


def test_missing_horovod_is_a_clear_error(monkeypatch):
    # None in sys.modules makes `import horovod.mxnet` raise ImportError
    monkeypatch.setitem(sys.modules, "horovod.mxnet", None)
    with pytest.raises(ImportError, match="no-build-isolation horovod==0.28.1"):
        mxhylo.create(transport="horovod")
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    monkeypatch.delenv("DMLC_ROLE", raising=False)
    with pytest.raises(ImportError, match="needs horovod.mxnet"):
        mxhylo.create()                     # 'auto' under horovodrun


def test_a_compressed_pull_and_the_servers_options_are_refused():
    """The store gives Horovod no compressed pull (its allgather already returns every
    worker's payload: compress_pull True and 'gather' mean the allgather there); the
    transport refuses one, and the parameter servers' key sizes are no options."""
    with pytest.raises(ValueError, match="has none"):
        HorovodTransport(compress_pull="gather")
    with pytest.raises(TypeError, match="bucket_bytes"):
        mxhylo.create(transport="horovod", bucket_bytes=1 << 20)


# -- two Horovod processes ---------------------------------------------------------------

def horovodrun(mode, out_dir, timeout=120, prefix=()):
    """Run [prefix...] tests/distributed/jobs/hvd_worker.py MODE in 2 Horovod processes; returns the
    output. horovodrun picks its own free port; the whole process group is killed on
    timeout, and no process of the job may outlive it."""
    cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable] + \
        list(prefix) + [WORKER, mode, str(out_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("horovodrun %s timed out after %d s:\n%s" % (mode, timeout, out[-4000:]))
    if proc.returncode != 0:
        # every rank's first error lines, then the tail (a rank that aborts first is
        # otherwise hidden behind the others' "Horovod has been shut down")
        errors = [line for line in out.splitlines() if re.search(
            r"terminate|what\(\)|Error|error|Abort|enforce|Traceback", line)]
        pytest.fail("horovodrun %s exited with %d; error lines:\n%s\n--- tail:\n%s"
                    % (mode, proc.returncode, "\n".join(errors[:40]), out[-3000:]))
    assert processes_mentioning(str(out_dir)) == [], "processes of the job outlived it"
    return out


def test_hylo_over_horovod_keeps_workers_bitwise_identical(tmp_path):
    """Two warm-up steps (dense, allreduce) then compressed ones (allgather): every
    parameter is bitwise equal on both workers, which started from different values."""
    horovodrun("hylo", tmp_path)
    a, b = (np.load(tmp_path / ("hylo-%d.npz" % r)) for r in (0, 1))
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 8
    for name in a.files:
        assert np.array_equal(a[name], b[name]), name
    stats = [json.load(open(tmp_path / ("hylo-%d.json" % r))) for r in (0, 1)]
    assert [s["num_workers"] for s in stats] == [2, 2]
    assert [s["rank"] for s in stats] == [0, 1]
    assert [s["shared"] for s in stats] == [[0.0, 1.0, 2.0]] * 2     # rank 0's values
    layers = stats[0]["layers"]
    policies = sorted(v["policy"] for v in layers.values())
    assert policies.count("conv_topk") == 1 and policies.count("fc_2bit") == 1
    for entry in layers.values():
        assert entry["steps"] == 5
        if entry["policy"] == "none":           # ring allreduce, W = 2: n each way
            assert entry["bytes_pushed"] == entry["bytes_pulled"] == entry["dense_bytes"]
        else:                                   # 3 compressed steps of 5
            assert entry["bytes_pushed"] < 0.5 * entry["dense_bytes"]


# default run: the cost model on over Horovod with workers bitwise equal
# (test_user_scripts.py, horovod-auto-cost_auto), rank 0's plan on every worker over
# the servers (test_dist.py)
@pytest.mark.slow
def test_cost_model_over_horovod_every_worker_takes_rank0s_plan(tmp_path):
    """With every default the cost model runs over Horovod too ('allgather' form: W/2
    payloads per ring byte, W decodes): the workers time their own probes, take rank
    0's numbers, reach the same per-layer choices and stay bitwise identical."""
    horovodrun("cost", tmp_path)
    a, b = (np.load(tmp_path / ("cost-%d.npz" % r)) for r in (0, 1))
    for name in a.files:
        assert np.array_equal(a[name], b[name]), name
    costs = [json.load(open(tmp_path / ("cost-%d.json" % r)))["cost_model"] for r in (0, 1)]
    measured = [{n: p.pop("measured_s") for n, p in c["layers"].items()} for c in costs]
    assert costs[0] == costs[1] and costs[0]["per_byte_s"] > 0
    assert set(costs[0]["layers"]) and all(s > 0 for m in measured for s in m.values())
    for name, p in costs[0]["layers"].items():
        assert p["strategy"] == "none" or p["codec_s"] < 0.9 * p["dense_s"], (name, p)


# default run: LARSTrainer with the hylo store in a real job (test_examples.py,
# train_imagenet.py over the servers), the store over Horovod (the test above)
@pytest.mark.slow
def test_lars_trainer_over_horovod_keeps_workers_bitwise_identical(tmp_path):
    """LARSTrainer (dynamic loss scaling, no momentum correction: LARS is not MXNet's
    SGD) with the hylo store over Horovod: compressed steps, workers bitwise equal,
    and the parameters moved from rank 0's initial values."""
    horovodrun("lars", tmp_path)
    a, b = (np.load(tmp_path / ("lars-%d.npz" % r)) for r in (0, 1))
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 8
    for name in a.files:
        assert np.isfinite(a[name]).all(), name
        assert np.array_equal(a[name], b[name]), name
    stats = [json.load(open(tmp_path / ("lars-%d.json" % r))) for r in (0, 1)]
    assert stats[0]["loss_scale"] == stats[1]["loss_scale"] > 1
    assert stats[0]["options"]["momentum_correction"] == "auto"
    compressed = [v for v in stats[0]["layers"].values() if v["policy"] != "none"]
    assert len(compressed) == 2
    for entry in compressed:                    # 3 compressed steps of 5
        assert entry["bytes_pushed"] < 0.5 * entry["dense_bytes"]


def test_uncompressed_hylo_over_horovod_equals_distributed_trainer(tmp_path):
    horovodrun("none", tmp_path)
    runs = [np.load(tmp_path / ("none-%d.npz" % r)) for r in (0, 1)]
    for run in runs:
        names = [n[len("hylo/"):] for n in run.files if n.startswith("hylo/")]
        assert len(names) == 8
        for name in names:
            np.testing.assert_allclose(run["hylo/" + name], run["horovod/" + name],
                                       rtol=1e-5, atol=1e-6, err_msg=name)
            # training moved them: the comparison is not of initial values
            assert np.abs(run["hylo/" + name] - run["init/" + name]).max() > 1e-4, name
    for name in runs[0].files:
        assert np.array_equal(runs[0][name], runs[1][name]), name


def test_mxhylo_run_under_horovodrun(tmp_path):
    """python -m mxhylo.run under horovodrun: a script's Trainer without a kvstore
    trains with the job's hylo store over Horovod, in step on both workers."""
    horovodrun("run", tmp_path, prefix=["-m", "mxhylo.run", "--kvstore", "dist_sync_hylo"])
    for r in (0, 1):
        info = json.load(open(tmp_path / ("run-%d.json" % r)))
        assert info == {"transport": "HorovodTransport", "type": "dist_sync_hylo"}
    a, b = (np.load(tmp_path / ("run-%d.npz" % r)) for r in (0, 1))
    for name in a.files:
        assert np.array_equal(a[name], b[name]), name


def test_mxhylo_run_refuses_a_parameter_server_store_under_horovodrun(tmp_path):
    # what horovodrun's environment says (one process: the check comes before any job)
    env = dict(os.environ, HOROVOD_RANK="0", HOROVOD_SIZE="1")
    env.pop("DMLC_ROLE", None)
    proc = subprocess.run([sys.executable, "-m", "mxhylo.run", "--kvstore", "dist_sync",
                           WORKER, "run", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert "needs python -m mxhylo.launch" in proc.stderr
