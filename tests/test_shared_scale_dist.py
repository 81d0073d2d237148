"""The shared_2bit codec's 'sum' pull over real parameter servers (mxhylo.launch, 2
servers): every worker pulls, bitwise, what kvstore.simulate computes in one process
for the same gradients, and agrees on the same scale."""
import importlib.util
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mxhylo.kvstore.policy import LayerPlan
from mxhylo.kvstore.simulate import SimulatedWorkers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "shared_sum.py")


def _script():
    spec = importlib.util.spec_from_file_location("shared_sum", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workers", [2, 4])
def test_real_servers_sum_pull_is_the_simulation_bitwise(tmp_path, workers):
    out = str(tmp_path / "shared-{rank}")
    proc = subprocess.run(
        [sys.executable, "-m", "mxhylo.launch", "-n", str(workers), "-s", "2", "--timeout",
         "150", sys.executable, SCRIPT, out],
        cwd=ROOT, capture_output=True, text=True, timeout=210)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    script = _script()
    plan = LayerPlan(name="fc", shape=script.SHAPE, strategy="shared_2bit")
    sim = SimulatedWorkers(workers)
    rngs = [np.random.RandomState(script.SEED + w) for w in range(workers)]
    got = [np.load(out.format(rank=w) + ".npz") for w in range(workers)]
    for step in range(script.STEPS):
        grads = [mx.nd.array(script.gradient(r)) for r in rngs]
        want = sim.exchange(plan, grads).asnumpy()
        for w in range(workers):
            np.testing.assert_array_equal(got[w]["aggregate/%d" % step], want,
                                          err_msg="rank %d, step %d" % (w, step))
            assert float(got[w]["threshold/%d" % step]) == \
                sim.memories[0].scalar("fc", "shared_threshold")
        if step == 0:
            assert not want.any()           # the first step agrees the scale, sends nothing
    assert np.abs(want).max() > 0
    info = json.load(open(out.format(rank=0)))
    assert info["policy"] == "shared_2bit" and info["pulls"] == ["sum"] * 3
