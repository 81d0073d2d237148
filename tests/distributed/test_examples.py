"""examples/train_imagenet.py and examples/train_schedules.py, run for real but small.

The distributed runs go through ``python -m mxhylo.launch`` on the digits packed by
``python -m mxhylo.im2rec --digits``; each has a launcher timeout below the test's own,
so a hung job fails with the launcher's message instead of hanging pytest.
"""
import json
import os
import sys

import pytest

from proc_helpers import run_quiet

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "train_imagenet.py")


def _run(cmd, timeout):
    return run_quiet(cmd, timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def digits_rec(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits_rec")
    rc, log = _run([sys.executable, "-m", "mxhylo.im2rec", "--digits", str(out),
                    "--no-progress", "--num-workers", "1"], timeout=120)
    assert rc == 0, log
    return {"train": str(out / "digits_train.rec"), "val": str(out / "digits_val.rec")}


def _data_args(digits_rec):
    return ["--rec-train", digits_rec["train"], "--rec-val", digits_rec["val"],
            "--classes", "10", "--input-size", "16", "-j", "1"]


# default run: scripts trained distributed under mxhylo.launch and mxhylo.run
# (test_quick_start.py, test_launch.py's stand-in of this script); this script's
# refusals below
@pytest.mark.slow
def test_resnet18_two_workers_one_server_finishes_an_epoch(digits_rec, tmp_path):
    """The issue's must-show: resnet18_v1b, 2 workers + 1 server, one epoch, logged
    accuracy and bytes, a checkpoint with each worker's residuals."""
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout", "150",
           sys.executable, SCRIPT, "--model", "resnet18_v1b", "--kvstore", "dist_sync_hylo",
           "--num-epochs", "1", "--batch-size", "64", "--log-interval", "3",
           "--lr", "2", "--eta", "0.02", "--hylo-warmup-steps", "0",   # one epoch: 10 steps
           "--save-dir", str(tmp_path), "--json", str(tmp_path / "summary-{rank}.json")]
    rc, log = _run(cmd + _data_args(digits_rec), timeout=180)
    assert rc == 0, log[-4000:]
    assert "validation: top1=" in log and "top5=" in log, log[-4000:]
    assert "samples/s" in log and "pushed" in log and "(measured" in log, log[-4000:]
    summaries = [json.load(open(tmp_path / ("summary-%d.json" % r))) for r in (0, 1)]
    for s in summaries:
        assert s["workers"] == 2 and len(s["epochs"]) == 1
        traffic = s["traffic"]
        assert traffic["steps"] > 0 and traffic["bytes_pushed"] > 0
        # resnet18's conv layers go top-k: far less than dense float32
        assert traffic["ratio"] > 8, traffic
    acc = summaries[0]["epochs"][0]
    assert 0.0 <= acc["val_top1"] <= acc["val_top5"] <= 1.0
    assert acc["bytes_per_step"] > 0 and acc["samples_per_s"] > 0
    for name in ("imagenet-resnet18_v1b-0.params", "imagenet-resnet18_v1b-0.states",
                 "imagenet-resnet18_v1b-0.states.residuals.rank0",
                 "imagenet-resnet18_v1b-0.states.residuals.rank1"):
        assert (tmp_path / name).is_file(), name


# default run: LARSTrainer with the hylo store resumed bit-exact, schedule position
# included (test_lars.py), the store over two devices of one process (test_kvstore.py),
# train_imagenet.py's checkpoints (the test above)
@pytest.mark.slow
def test_one_process_two_cpu_devices_then_resume(digits_rec, tmp_path):
    """--kvstore hylo in one process over cpu(0) and cpu(1), then --resume-* for epoch 1."""
    common = [sys.executable, SCRIPT, "--model", "cifar_resnet20_v1", "--kvstore", "hylo",
              "--num-cpus-as-devices", "2", "--batch-size", "16", "--log-interval", "0",
              "--lr", "1", "--eta", "0.02", "--lr-mode", "cosine", "--save-dir",
              str(tmp_path)] + _data_args(digits_rec)
    # The first run trains both epochs; the resumed one repeats epoch 1 from the epoch-0
    # checkpoint and must land on the same schedule position.
    rc, log = _run(common + ["--num-epochs", "2", "--save-frequency", "1", "--json",
                             str(tmp_path / "first.json")], timeout=150)
    assert rc == 0, log[-4000:]
    first = json.load(open(tmp_path / "first.json"))
    assert [e["epoch"] for e in first["epochs"]] == [0, 1]
    assert "2 device(s)" in log and "kvstore hylo" in log
    ckpt = str(tmp_path / "imagenet-cifar_resnet20_v1-0")
    rc, log = _run(common + ["--num-epochs", "2", "--resume-epoch", "1",
                             "--resume-params", ckpt + ".params",
                             "--resume-states", ckpt + ".states",
                             "--save-dir", str(tmp_path / "resumed"),
                             "--json", str(tmp_path / "resumed.json")], timeout=150)
    assert rc == 0, log[-4000:]
    resumed = json.load(open(tmp_path / "resumed.json"))
    assert [e["epoch"] for e in resumed["epochs"]] == [1]
    assert (tmp_path / "resumed" / "imagenet-cifar_resnet20_v1-1.params").is_file()
    # the schedule went on from the checkpoint, not from step 0
    assert resumed["epochs"][0]["num_update"] == first["epochs"][1]["num_update"]
    assert resumed["epochs"][0]["lr"] == pytest.approx(first["epochs"][1]["lr"])


def test_missing_record_file_is_named(tmp_path):
    missing = str(tmp_path / "nowhere" / "train.rec")
    rc, log = _run([sys.executable, SCRIPT, "--model", "resnet18_v1b", "--rec-train", missing,
                    "--rec-val", missing], timeout=120)
    assert rc == 2
    assert "--rec-train: %s does not exist" % missing in log
    assert "mxhylo.im2rec --digits" in log


def test_local_kvstore_under_the_launcher_is_refused(digits_rec):
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "1", "-s", "1", "--timeout", "60",
           sys.executable, SCRIPT, "--model", "resnet18_v1b", "--kvstore", "device"]
    rc, log = _run(cmd + _data_args(digits_rec), timeout=90)
    assert rc != 0
    assert "--kvstore device is not distributed" in log


def test_cosine_schedule_ramps_then_ends_at_zero():
    from mxhylo.digits import lr_scheduler

    sched = lr_scheduler("cosine", 0.1, 100, 10)
    assert sched(0) == 0.0 and sched(5) == pytest.approx(0.05)
    assert sched(10) == pytest.approx(0.1) and sched(100) == pytest.approx(0.0, abs=1e-12)
    assert lr_scheduler("constant", 0.1, 100, 0) is None
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        lr_scheduler("step", 0.1, 100, 0)
    with pytest.raises(ValueError, match="does not fit"):
        lr_scheduler("cosine", 0.1, 10, 10)


def test_schedules_example_grows_the_batch_and_cycles_the_momentum(tmp_path):
    """examples/train_schedules.py in one process: k doubles at epochs 4 and 8, the
    exchanges per epoch halve with it, the momentum is back at its high at the end, and
    the net learns the digits."""
    out = tmp_path / "log-{rank}.json"
    rc, log = _run([sys.executable, os.path.join(ROOT, "examples", "train_schedules.py"),
                    "--json", str(out)], timeout=180)
    assert rc == 0, log[-3000:]
    epochs = json.load(open(str(out).format(rank=0)))["log"]
    assert [e["k"] for e in epochs] == [1] * 4 + [2] * 4 + [4] * 4
    # 42 micro-batches an epoch (1348 images, batch 32): 42, then 21, then 10.5 updates
    updates = [e["updates"] for e in epochs]
    assert updates[3] == 4 * 42 and updates[7] == updates[3] + 4 * 21, updates
    assert updates[-1] == updates[7] + 42, updates
    assert epochs[5]["momentum"] < epochs[-1]["momentum"] == pytest.approx(0.95)
    assert epochs[-1]["accuracy"] > 0.9, epochs
