"""The shared_2bit codec in real jobs, over the parameter servers' 'sum' pull
(mxhylo.launch, 2 servers) and over Horovod's allgather (horovodrun): every worker
ends, bitwise, with what kvstore.simulate computes in one process for the same
gradients, and agrees on the same scale. And fc_2bit over Horovod, whose gathered
payloads are decoded in one pass where the allgather wrote them
(ops.decode_gathered_2bit), against the same simulation."""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mxhylo.kvstore.policy import LayerPlan
from mxhylo.kvstore.simulate import SimulatedWorkers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "shared_sum.py")


def _script():
    spec = importlib.util.spec_from_file_location("shared_sum", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def _launch(launcher, workers, out, codec):
    """The job's command: mxhylo.launch with 2 servers, or horovodrun (Gloo)."""
    if launcher == "ps":
        return [sys.executable, "-m", "mxhylo.launch", "-n", str(workers), "-s", "2",
                "--timeout", "150", sys.executable, SCRIPT, out, codec]
    return [HOROVODRUN, "-np", str(workers), "-H", "localhost:%d" % workers, "--gloo",
            sys.executable, SCRIPT, out, codec]


@pytest.mark.parametrize("launcher, workers, codec", [
    ("ps", 2, "shared_2bit"),
    # Horovod sums the allgathered payloads with the simulation's own functions
    # (kvstore.wire.sum_payloads, decode_sums)
    pytest.param("horovod", 2, "shared_2bit", marks=pytest.mark.slow),
    ("horovod", 2, "fc_2bit"),
    # 6 processes on the servers' sum: the same path as W = 2 with more slots
    pytest.param("ps", 4, "shared_2bit", marks=pytest.mark.slow)])
def test_real_jobs_sum_pull_is_the_simulation_bitwise(tmp_path, launcher, workers, codec):
    out = str(tmp_path / "shared-{rank}")
    proc = subprocess.Popen(_launch(launcher, workers, out, codec), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=210)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail("the job timed out:\n" + log[-3000:])
    assert proc.returncode == 0, log[-4000:]
    script = _script()
    plan = LayerPlan(name="fc", shape=script.SHAPE, strategy=codec)
    sim = SimulatedWorkers(workers)
    rngs = [np.random.RandomState(script.SEED + w) for w in range(workers)]
    got = [np.load(out.format(rank=w) + ".npz") for w in range(workers)]
    for step in range(script.STEPS):
        grads = [mx.nd.array(script.gradient(r)) for r in rngs]
        want = sim.exchange(plan, grads).asnumpy()
        for w in range(workers):
            np.testing.assert_array_equal(got[w]["aggregate/%d" % step], want,
                                          err_msg="rank %d, step %d" % (w, step))
            for agreed in ("threshold", "value"):
                assert float(got[w]["%s/%d" % (agreed, step)]) == \
                    (sim.memories[0].scalar("fc", "shared_" + agreed) or 0.0)
        if step == 0 and codec == "shared_2bit":
            assert not want.any()           # the first step agrees the scale, sends nothing
    assert np.abs(want).max() > 0
    info = json.load(open(out.format(rank=0)))
    assert info["policy"] == codec
    if launcher == "ps":
        assert info["transport"] == "ps" and info["pulls"] == ["sum"] * 3
        # what the transport counted is the layouts' pull: the sums, not W payloads
        from mxhylo.kvstore.wire import ROW_ID_BYTES, plan_chunks
        chunks = plan_chunks("shared_2bit", script.SHAPE, workers, 2, 32768, 1 << 30,
                             pull="gather")
        per_step = sum(c.pull_rows * (4 * c.cols + ROW_ID_BYTES) for c in chunks)
        assert info["bytes_pulled"] == per_step * info["steps"]
        gathered = sum(c.pull_rows * (4 * c.cols + ROW_ID_BYTES) for c in plan_chunks(
            "fc_2bit", script.SHAPE, workers, 2, 32768, 1 << 30, pull="gather"))
        assert per_step < 0.7 * gathered      # log2(2W + 1) bits against 2W
    else:
        assert info["transport"] == "horovod"
