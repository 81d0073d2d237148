"""Gradient accumulation (mxhylo.schedules) in real 2-worker jobs over the parameter
server (and under horovodrun): k micro-batches per update give one process's step on
the whole batch, under MXNet's dist_sync, the hylo store with compression off and
Horovod's DistributedTrainer
(tests/distributed/jobs/accumulate.py checks it inside each worker).

Each job has the launcher's timeout and one on the whole command; the launcher picks
free ports; no process of a job may outlive it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from proc_helpers import processes_mentioning

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "accumulate.py")
TIMEOUT_S = 120


HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def run(tmp_path, kvstore):
    out = str(tmp_path / "r-{rank}.json")
    if kvstore == "horovod":
        cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
               SCRIPT, "--kvstore", kvstore, "--out", out]
    else:
        cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
               str(TIMEOUT_S), sys.executable, SCRIPT, "--kvstore", kvstore, "--out", out]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text = proc.communicate()[0] + "\n[test] timed out"
    deadline = time.time() + 10
    while processes_mentioning(SCRIPT + " --kvstore " + kvstore + " --out " + out) and \
            time.time() < deadline:
        time.sleep(0.2)
    leftover = processes_mentioning(out)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover, "processes of the job outlived it: %s" % leftover
    assert proc.returncode == 0, text[-3000:]
    return [json.load(open(out.format(rank=r))) for r in (0, 1)]


# (MXNet's dist_sync: the same accumulation as under the hylo store; --runslow)
@pytest.mark.parametrize("kvstore", [pytest.param("dist_sync", marks=pytest.mark.slow),
                                     "dist_sync_hylo", "horovod"])
def test_accumulated_updates_equal_one_process_on_the_whole_batch(tmp_path, kvstore):
    reports = run(tmp_path, kvstore)
    for r in reports:
        assert r["workers"] == 2 and r["updates"] == 4 and r["num_update"] == 4, r
        assert r["k"] == 4, r
        assert r["max_rel_diff"] < 1e-4, r
    if kvstore == "dist_sync_hylo":
        # a schedule puts the optimizer on the workers
        assert [r["route"] for r in reports] == ["workers", "workers"], reports
