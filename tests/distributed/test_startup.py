"""A job starts every time, even when the script evaluates its net just before the
Trainer's first step (tests/distributed/jobs/eval_then_train.py, 2 workers + 2 servers).

That is where MXNet loses rank 0's initial value of a parameter: an inference forward
leaves a convolution's weight in oneDNN's own layout, MXNet's init push asks that array
for its plain data, the engine operation fails, the engine drops the error, nothing is
sent, and the first pull of the key ends its server ("init N first"). The script makes
the timing deterministic: its first training step waits behind a large matrix product,
so its initial push runs while the weights are still in oneDNN's layout.

The control runs the same script under plain MXNet (mxhylo not imported): it must end
that way, or the script no longer exercises what the fix is for.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "eval_then_train.py")
ABORT = "Check failed: !stored.is_none()"


def _launch(tmp_path, store, env=None):
    """Run the script as a 2-worker, 2-server job; (CompletedProcess, output prefix)."""
    out = str(tmp_path / store)
    cmd = [sys.executable, "-m", "mxhylo.launch", "--no-relaunch", "-n", "2", "-s", "2",
           "--timeout", "120", sys.executable, SCRIPT, store, out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, **(env or {})))
    return proc, out


@pytest.mark.parametrize("store", ["dist_sync", "hylo"])
def test_a_job_starts_after_an_evaluation_forward(tmp_path, store):
    proc, out = _launch(tmp_path, store)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert ABORT not in text
    first, second = (np.load("%s.%d.npz" % (out, rank)) for rank in (0, 1))
    assert sorted(first.files) == sorted(second.files)
    for name in first.files:        # both workers trained from rank 0's values
        assert np.array_equal(first[name], second[name]), name


# (the control: that the script still meets MXNet's failure, so the tests above
# exercise the fix; MXNet's behaviour, not mxhylo's)
@pytest.mark.slow
def test_plain_mxnet_loses_the_initial_value_in_this_script(tmp_path):
    proc, _ = _launch(tmp_path, "dist_sync", env={"NO_MXHYLO": "1"})
    text = proc.stdout + proc.stderr
    if proc.returncode == 0:
        # oneDNN picks its layouts by CPU: where it keeps these weights in MXNet's own,
        # plain MXNet starts too, and the tests above show nothing on this machine
        pytest.skip("this CPU's oneDNN kept the weights in MXNet's layout")
    assert ABORT in text and "first" in text, text[-4000:]
