"""examples/train_imagenet.py and the accuracy study's pieces, run for real but small.

The distributed runs go through ``python -m mxhylo.launch`` on the digits packed by
``python -m mxhylo.im2rec --digits``; each has a launcher timeout below the test's own,
so a hung job fails with the launcher's message instead of hanging pytest.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "train_imagenet.py")


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"   # several processes share a small machine
    env.pop("DMLC_ROLE", None)
    return env


def _run(cmd, timeout):
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout, cwd=ROOT, env=_env())
    return res.returncode, res.stdout


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


def test_two_bit_byte_count():
    from mxhylo.bench.accuracy import dense_bytes, twobit_bytes

    assert dense_bytes(10) == 40
    assert twobit_bytes(16) == 4 and twobit_bytes(17) == 8 and twobit_bytes(1) == 4
    assert twobit_bytes(524288) * 16 == dense_bytes(524288)


PUSH_THEN_PULL_WORKER = """
import mxnet as mx
from mxhylo.bench.accuracy import PushThenPull
kv = PushThenPull(threshold=0.5)
w = mx.nd.zeros((3, 7))
kv.broadcast(0, mx.nd.ones((3, 7)) * (1 + kv.rank), out=w)   # rank 0's value everywhere
sums = []
for step in range(2):
    g = mx.nd.ones((3, 7)) * 0.7 * (kv.rank + 1)
    kv.pushpull(0, g)
    sums.append(float(g.asnumpy().mean()))
print("RESULT", kv.rank, float(w.asnumpy().mean()), sums, flush=True)
"""


def test_push_then_pull_sums_dequantized_two_bit_pushes(tmp_path):
    """MXNet's 2-bit with error feedback, through the adapter Gluon can use: worker 0
    pushes 0.7 (sends +0.5, keeps 0.2), worker 1 pushes 1.4 (sends +0.5, keeps 0.9);
    next step 0.9 and 2.3 both send +0.5 again. Each pull returns the sum, 1.0."""
    script = tmp_path / "worker.py"
    script.write_text(PUSH_THEN_PULL_WORKER)
    rc, log = _run([sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout",
                    "60", sys.executable, str(script)], timeout=90)
    assert rc == 0, log[-3000:]
    results = [line.split("RESULT", 1)[1].split(None, 2) for line in log.splitlines()
               if "RESULT" in line]
    assert len(results) == 2, log
    for rank, weight, sums in results:
        assert float(weight) == 1.0              # broadcast gave rank 0's ones
        assert json.loads(sums) == [1.0, 1.0]


@pytest.mark.slow
def test_accuracy_study_smoke(tmp_path):
    """The whole study pipeline, tiny: 2 workers + 1 server, 1 seed, budgets of 1 and 2
    epochs under the default cosine schedule (one job per budget), four modes, plot
    written; the byte counts say what each mode moves."""
    out = tmp_path / "report.json"
    rc, log = _run([sys.executable, "-m", "mxhylo.bench", "accuracy", "--seeds", "1",
                    "--nets", "digits_net", "--lrs", "0.05", "--epochs", "2",
                    "--short-epochs", "1", "--warmup-epochs", "0.5",
                    "--modes", "dense,2bit,hylo,hylo_densepull",
                    "--workers", "2", "--servers", "1",
                    "--plots-dir", str(tmp_path), "--json", str(out)], timeout=600)
    assert rc == 0, log[-4000:]
    report = json.load(open(out))
    assert sorted(report["cells"]) == ["digits_net lr=0.05 epochs=1",
                                       "digits_net lr=0.05 epochs=2"]
    # each budget is its own job: the short cell's curve ends at its own last step
    short = report["curves"]["digits_net lr=0.05 epochs=1"]["dense"][0]
    long_ = report["curves"]["digits_net lr=0.05 epochs=2"]["dense"][0]
    assert 2 * short[-1][0] == long_[-1][0]
    by = report["bytes_per_step_pushed_pulled"]["digits_net"]
    dense = by["dense"][0]
    assert by["dense"] == [dense, dense]
    assert by["2bit"][0] < dense / 15 and by["2bit"][1] == dense
    # hylo's first 30 steps are its dense warm-up: the whole run averages above 1/8
    assert by["hylo"][0] < dense and by["hylo_densepull"][1] == pytest.approx(dense, rel=0.01)
    for cell in report["cells"].values():
        for mode in ("dense", "2bit", "hylo", "hylo_densepull"):
            assert all(cell[mode]["workers_identical"]), (mode, cell[mode])
    assert report["diverged_runs"] == []
    assert (tmp_path / "accuracy_curves.png").is_file()


def test_accuracy_study_in_one_process(tmp_path):
    """--servers 0: W = 1, one process over two devices, no job: dense is MXNet's
    'device' store, hylo the in-process store (it compresses, as one worker would);
    both start from the same weights and data (the same first evaluation)."""
    out = tmp_path / "report.json"
    rc, log = _run([sys.executable, "-m", "mxhylo.bench", "accuracy", "--seeds", "1",
                    "--nets", "digits_net", "--lrs", "0.05", "--epochs", "2",
                    "--short-epochs", "2", "--lr-schedule", "constant",
                    "--modes", "dense,hylo", "--workers", "1", "--servers", "0",
                    "--plots-dir", "", "--json", str(out)], timeout=300)
    assert rc == 0, log[-4000:]
    runs = [json.loads(l) for l in open(str(out) + ".runs.jsonl")]
    by = {r["mode"]: r for r in runs}
    assert by["dense"]["workers"] == by["hylo"]["workers"] == 1
    assert by["dense"]["curve"][0] == by["hylo"]["curve"][0]
    assert by["hylo"]["bytes_per_step"] < by["dense"]["bytes_per_step"]    # compressed
    rc, log = _run([sys.executable, "-m", "mxhylo.bench", "accuracy", "--workers", "2",
                    "--servers", "0", "--json", str(out)], timeout=120)
    assert rc != 0 and "--servers 0 is one process" in log


def _descendants(pid):
    """Pids of every live process below ``pid`` (from /proc: parent links)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_accuracy_study_leaves_no_process(tmp_path):
    """SIGTERM to `bench accuracy` while a job trains ends the job too: its launcher
    and every role (the job dies with the study, as a job dies with its launcher)."""
    import signal
    import time
    cmd = [sys.executable, "-m", "mxhylo.bench", "accuracy", "--seeds", "1", "--nets",
           "digits_net", "--lrs", "0.05", "--epochs", "40", "--short-epochs", "40",
           "--lr-schedule", "constant", "--modes", "dense", "--workers", "2",
           "--servers", "1", "--plots-dir", "", "--json", str(tmp_path / "r.json")]
    study = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    job = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(job) < 5:     # launcher + 4 roles
            time.sleep(0.5)
            job = _descendants(study.pid)
        assert len(job) >= 5, "the study's job did not start: %s" % job
        study.send_signal(signal.SIGTERM)
        study.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(p) for p in job):
            time.sleep(0.5)
        assert not [p for p in job if _alive(p)], "left behind: %s" % job
    finally:
        if study.poll() is None:
            study.kill()
        for pid in job:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _fake_run(net, lr, mode, seed, epochs, curve):
    return {"net": net, "lr": lr, "mode": mode, "seed": seed, "epochs": epochs,
            "curve": curve, "steps_per_epoch": 10, "rank_checksums": [1.0, 1.0],
            "bytes_per_step": 1.0, "bytes_pulled_per_step": 1.0}


def test_accuracy_study_cells_come_from_their_budgets_job():
    """Under a schedule that ends with the budget, a cell is read from its own job
    (its last step), never from the first part of the long job; at a constant rate
    both cells come from the long job."""
    from mxhylo.bench.accuracy import budgets, summarize

    cfg = {"nets": ["n"], "lrs": [0.1], "modes": ["dense", "hylo"], "seeds": 1,
           "epochs": 4, "short_epochs": 2, "lr_schedule": "cosine", "warmup_epochs": 1}
    assert budgets(cfg) == [2, 4]
    runs = [_fake_run("n", 0.1, "dense", 0, 2, [(10, 0.5), (20, 0.9)]),
            _fake_run("n", 0.1, "hylo", 0, 2, [(10, 0.4), (20, 0.88)]),
            _fake_run("n", 0.1, "dense", 0, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]),
            _fake_run("n", 0.1, "hylo", 0, 4, [(10, 0.3), (20, 0.5), (40, 0.96)])]
    report = summarize(cfg, runs)
    short, long_ = report["cells"]["n lr=0.1 epochs=2"], report["cells"]["n lr=0.1 epochs=4"]
    assert short["dense"]["final_accuracy"]["mean"] == 0.9          # not 0.6
    assert short["hylo"]["gap_points"] == pytest.approx(-2.0)
    assert long_["hylo"]["gap_points"] == pytest.approx(1.0)
    assert report["checks"]["n lr=0.1 epochs=2"]["within_0.5_points"] is False
    assert report["checks"]["n lr=0.1 epochs=4"]["within_0.5_points"] is True
    assert sorted(report["curves"]) == ["n lr=0.1 epochs=2", "n lr=0.1 epochs=4"]

    # a cell where dense misses its own target in a seed is not checked, and says why
    runs[2] = _fake_run("n", 0.1, "dense", 0, 4, [(10, 0.1), (20, 0.1), (40, 0.1)])
    runs.append(_fake_run("n", 0.1, "dense", 1, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]))
    report = summarize(dict(cfg, seeds=2), runs)
    assert "n lr=0.1 epochs=4" not in report["checks"]
    assert "seed(s) [0]" in report["checks_not_applicable"]["n lr=0.1 epochs=4"]
    assert report["checks_total"] == 1

    runs = runs[:2] + [_fake_run("n", 0.1, "dense", 0, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]),
                       _fake_run("n", 0.1, "hylo", 0, 4, [(10, 0.3), (20, 0.5), (40, 0.96)])]
    constant = dict(cfg, lr_schedule="constant")
    assert budgets(constant) == [4]
    report = summarize(constant, runs[2:])
    assert report["cells"]["n lr=0.1 epochs=2"]["dense"]["final_accuracy"]["mean"] == 0.6
    assert report["cells"]["n lr=0.1 epochs=2"]["hylo"]["gap_points"] == pytest.approx(-10.0)


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
