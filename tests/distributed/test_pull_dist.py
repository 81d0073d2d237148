"""The gather pull over real parameter servers (2 workers, 2 servers) through
tests/distributed/jobs/dist_keys_worker.py: bitwise the dense pull, every worker alike,
no server state; its recorded digest beside those properties."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KEYS_WORKER = os.path.join(ROOT, "tests", "distributed", "jobs", "dist_keys_worker.py")


def launch_keys_worker(tmp_path, mode, timeout=120):
    out = str(tmp_path / (mode.replace(":", "_") + "-{rank}.json"))
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout",
           str(timeout), sys.executable, KEYS_WORKER, mode, out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    return proc, out


# what dist_keys_worker.py's pull() trains
DIST_SHAPES = {"conv": (64, 16, 3, 3), "fc": (96, 200), "fc_odd": (50, 333),
               "bias": (10,), "conv_small": (8, 4, 1, 1)}


# sha256 of rank 0's results (dist_keys_worker.py pull:MODE: every output, the sums and
# the worker's checkpoint), so that a change of the exchange that changes one bit fails
# here. The inputs are seeded numpy draws and every operator is bitwise the same at
# every ISA level (tests/unit/test_ops.py), so the digest does not depend on the CPU. A
# deliberate change of the arithmetic records new digests.
RECORDED_DIGESTS = {
    # the gather pull is bitwise the dense pull (the property beside it below; each
    # residual row's bound: tests/integration/test_bounded_residual.py)
    "gather": "9fc69e753a64d45f1e126a75cb74fee73bde5e3dc0ea88e0068daa34f6a2d097",
    "dense": "9fc69e753a64d45f1e126a75cb74fee73bde5e3dc0ea88e0068daa34f6a2d097"}


def results_digest(arrays):
    """sha256 (hex) of a dict of numpy arrays: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(("%s|%s|%s|" % (name, a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def assert_recorded_digest(mode, arrays):
    digest = results_digest(arrays)
    assert digest == RECORDED_DIGESTS[mode], (
        "pull:%s results changed bitwise: digest %s, recorded %s"
        % (mode, digest, RECORDED_DIGESTS[mode]))


def test_gather_pull_equals_the_dense_pull_bitwise(tmp_path):
    """'gather' returns the workers' payloads as the server summed them: what every
    worker decodes is bitwise the dense pull's aggregate, and no server keeps state."""
    runs = {}
    for mode in ("gather", "dense"):
        proc, out = launch_keys_worker(tmp_path, "pull:" + mode)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # the servers decode with the operator library, though MXNet runs a server
        # inside its own import, before mxnet.sym and mxnet.nd are bound
        assert "C++ operators unavailable" not in proc.stdout + proc.stderr, (
            proc.stdout[-3000:] + proc.stderr[-3000:])
        runs[mode] = ([dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)],
                      [json.load(open(out.format(rank=r))) for r in range(2)])
    (gather, g_reports), (dense, d_reports) = runs["gather"], runs["dense"]
    for name in DIST_SHAPES:
        for key in ("got/", "last/"):
            np.testing.assert_array_equal(gather[0][key + name], dense[0][key + name],
                                          err_msg=key + name)
            np.testing.assert_array_equal(gather[1][key + name], gather[0][key + name],
                                          err_msg=key + name)
    assert not any(k.startswith("state/server_") for k in gather[0])
    assert all(r["resumed"] for r in g_reports)
    for g, d in zip(g_reports, d_reports):
        # the same payloads (cut into chunks a little differently: placeholders differ)
        assert abs(g["bytes_pushed"] - d["bytes_pushed"]) < 0.01 * d["bytes_pushed"]
        # two workers' payloads come back: about twice the push, well under dense
        assert g["bytes_pulled"] < 2.5 * g["bytes_pushed"], g
        assert g["bytes_pulled"] < 0.6 * d["bytes_pulled"], (g, d)
    # last, once the properties above say what differs: any change of one bit
    assert_recorded_digest("gather", gather[0])
    assert_recorded_digest("dense", dense[0])


def test_workers_whose_gradients_come_in_crossed_orders_finish(tmp_path):
    """Each worker pushes the bucket the other pushes last, and encodes a 2-bit layer in
    between (jobs/crossed_buckets.py): neither may wait for the other in that encode
    (transport_ps's PULL_READERS_LAST); the buckets' sums come out exact."""
    script = os.path.join(ROOT, "tests", "distributed", "jobs", "crossed_buckets.py")
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout", "90",
           sys.executable, script]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rank in (0, 1):
        for step in range(3):
            assert "[worker %d] step %d ok" % (rank, step) in out, out[-3000:]
