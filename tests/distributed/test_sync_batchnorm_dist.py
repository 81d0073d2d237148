"""mxhylo.run's promise for BatchNorm nets: 2 workers with batch b train like one process
with batch 2b.

The script (tests/distributed/jobs/bn_whole_batch.py) is a BatchNorm conv net on the
digits whose Trainer gets no kvstore; each worker takes its b samples of each of one
process's batches of 2b. With --sync-batchnorm the workers' mean loss at every step is
one process's loss, and every worker's evaluation over the whole validation set is one
process's; without it, each worker normalizes over its own b samples and the curve
moves away (the case that says what the option changes). Launched as users launch:
``python -m mxhylo.launch -n 2 -s 1 python -m mxhylo.run ...``, MXNet's own launcher
(dmlc-tracker's local submit, as tools/launch.py calls it) and horovodrun. MXNet's
launcher and the case without the option run with --runslow.
"""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from test_quick_start import MXNET_LAUNCHER   # MXNet's tools/launch.py, local

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "bn_whole_batch.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
PY = sys.executable
TIMEOUT_S = 150
STEPS = 12
# float32 sums in another order (2 workers' gradients, 2 workers' moments) drift the
# curve by ~1e-6 a step; per-worker BatchNorm statistics move it by more than 1e-2
LOSS_TOLERANCE = 2e-3


def _run(cmd):
    """Run a job whose script writes one report per worker; the reports by rank."""
    report_dir = tempfile.mkdtemp(prefix="bn_whole_batch_")
    try:
        proc = subprocess.Popen(cmd + ["--report-dir", report_dir], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            pytest.fail("the job timed out:\n" + text[-3000:])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, text[-3000:]
        reports = []
        for name in sorted(os.listdir(report_dir)):
            with open(os.path.join(report_dir, name)) as f:
                reports.append(json.load(f))
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    return sorted(reports, key=lambda r: r["rank"]), text


@functools.lru_cache(maxsize=None)
def _one_process(hybridize):
    reports, _ = _run([PY, SCRIPT, "--steps", str(STEPS)] + list(hybridize))
    return reports[0]


def one_process(hybridize):
    """One process with the whole batch (run once per flag set in this session)."""
    return _one_process(tuple(hybridize))


def two_workers(kvstore, sync, hybridize, launcher="mxhylo"):
    run = [PY, "-m", "mxhylo.run", "--kvstore", kvstore] + \
        (["--sync-batchnorm"] if sync else []) + [SCRIPT, "--steps", str(STEPS)] + hybridize
    if launcher == "horovodrun":
        cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo"] + run
    elif launcher == "mxnet":
        cmd = [PY, "-c", MXNET_LAUNCHER] + run
    else:
        cmd = [PY, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
               str(TIMEOUT_S)] + run
    reports, text = _run(cmd)
    assert [r["rank"] for r in reports] == [0, 1], text[-3000:]
    return reports


def mean_curve(reports):
    return [sum(r["losses"][i] for r in reports) / len(reports) for i in range(STEPS)]


def curve_gap(reference, reports):
    return max(abs(a - b) for a, b in zip(reference["losses"], mean_curve(reports)))


CASES = [
    ("dist_sync", ["--hybridize"], "mxhylo"),
    # MXNet's launcher gives the workers the same DMLC_* variables as mxhylo.launch (the
    # sum service's address takes the same path); the launcher itself: test_quick_start
    pytest.param("dist_sync_hylo", [], "mxnet", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kvstore,hybridize,launcher", CASES,
                         ids=["dist_sync-hybridized-mxhylo.launch",
                              "hylo-imperative-mxnets-launcher"])
def test_two_workers_with_sync_batchnorm_train_like_one_process(kvstore, hybridize,
                                                                launcher):
    reference = one_process(hybridize)
    reports = two_workers(kvstore, True, hybridize, launcher)
    gap = curve_gap(reference, reports)
    print("one process:", reference["losses"], reference["accuracy"])
    print("2 workers, mean:", mean_curve(reports), [r["accuracy"] for r in reports])
    assert gap < LOSS_TOLERANCE, (gap, reference["losses"], mean_curve(reports))
    # the same running statistics on every worker: the same evaluation, one process's
    assert reports[0]["accuracy"] == reports[1]["accuracy"], reports
    assert abs(reports[0]["accuracy"] - reference["accuracy"]) <= 1 / 360 + 1e-9, (
        reports, reference)


@pytest.mark.slow   # what the option changes; the test above fails if it changes nothing
def test_without_sync_batchnorm_each_worker_normalizes_its_own_samples():
    reference = one_process(["--hybridize"])
    reports = two_workers("dist_sync", False, ["--hybridize"])
    gap = curve_gap(reference, reports)
    assert gap > 10 * LOSS_TOLERANCE, (gap, reference["losses"], mean_curve(reports))


@pytest.mark.skipif(not os.path.exists(HOROVODRUN), reason="horovod is not installed")
def test_sync_batchnorm_under_horovodrun():
    reference = one_process(["--hybridize"])
    reports = two_workers("dist_sync_hylo", True, ["--hybridize"], launcher="horovodrun")
    assert curve_gap(reference, reports) < LOSS_TOLERANCE
    assert reports[0]["accuracy"] == reports[1]["accuracy"] == reference["accuracy"]
