"""Convergence per step: the conv net over the parameter server (python -m pytest --runslow).

A short version of ``python -m mxhylo.bench accuracy`` (2 workers + 2 servers,
conv_net on the digits at 16 px, constant lr 0.02 (the study's first protocol: no
schedule to hide a slower start), seed 0, 6 epochs = 126 steps): hylo with every layer
compressed as its rule plans (mode hylo_rule: on loopback the cost model would keep the
layers dense) against MXNet's dist_sync. Measured (seed 0): dist_sync 97.1% (82.4% at
3 epochs); hylo's default 95.3% (76.2%). Plain error feedback without warm-up, with
the aggregate compressed a second time on its way back, reached 79.3%: the bound below
fails if convergence per step falls back to that. At 126 steps seeds differ by several
points (the accuracy study's spread), so the bound is not tighter.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# default run: the conv+dense digits net, hylo against dist_sync over 2 servers within
# 1 point (test_dist.py), and the default store against 'device' in one process within
# 1 point (test_kvstore.py)
@pytest.mark.slow
def test_compressed_store_converges_like_dist_sync_on_a_conv_net(tmp_path):
    out = str(tmp_path / "study.json")
    cmd = [sys.executable, "-m", "mxhylo.bench", "accuracy", "--nets", "conv_net",
           "--lrs", "0.02", "--lr-schedule", "constant",
           "--seeds", "1", "--epochs", "6", "--short-epochs", "3",
           "--modes", "dist_sync,hylo_rule", "--workers", "2", "--servers", "2",
           "--plot", "", "--json", out, "--job-timeout", "300"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.load(open(out))
    final = report["cells"]["conv_net lr=0.02 epochs=6"]
    dense = final["dist_sync"]["final_accuracy"]["mean"]
    hylo = final["hylo_rule"]["final_accuracy"]["mean"]
    assert hylo >= dense - 0.07 and hylo >= 0.85, (hylo, dense)
    assert all(final["hylo_rule"]["workers_identical"]), final["hylo_rule"]
    # per step over the whole run, whose first 30 of 126 steps are the dense warm-up:
    # 30/126 of dense plus about 1/11 of dense for the compressed steps, < 0.35
    assert report["bytes_per_step_pushed_pulled"]["conv_net"]["hylo_rule"][0] < \
        0.35 * report["bytes_per_step_pushed_pulled"]["conv_net"]["dist_sync"][0]
