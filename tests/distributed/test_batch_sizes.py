"""Workers whose batch sizes differ, with the optimizer on the workers: each scales the
summed gradient by its own batch size, so their weights part. The store compares what
the workers' optimizers applied every kvstore.hylo.SCALE_CHECK_STEPS steps and ends the
job on every worker with an error that says so (tests/distributed/jobs/uneven_batches.py:
500 and 501 samples, batch 32: the first last batches, 20 and 21, differ at step 16;
the check at step 20 ends the job)."""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "uneven_batches.py")
TIMEOUT_S = 120


def test_workers_with_different_batch_sizes_end_the_job_saying_so(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
         str(TIMEOUT_S), sys.executable, SCRIPT],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S + 60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "trained" not in out, out[-3000:]
    said = re.findall(r"the workers stepped with different batch sizes: over the 20 steps "
                      r"so far their optimizers' rescale_grad sums to ([0-9.e+-]+), "
                      r"([0-9.e+-]+) \(by rank\)", out)
    assert said, out[-3000:]
    first, second = map(float, said[0])
    # 15 steps of 1/32 each, then 1/20 and 1/21, then 4 more of 1/32
    assert abs(first - (19 / 32 + 1 / 20)) < 1e-5 and abs(second - (19 / 32 + 1 / 21)) < 1e-5
    assert "job FAILED" in out
