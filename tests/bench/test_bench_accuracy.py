"""The accuracy study's harness (python -m mxhylo.bench accuracy): its byte counts, the
MXNet 2-bit peer's push-then-pull adapter, its cells and budgets, and its jobs ended
with it. The whole study, tiny, and its one-process form: --runslow."""
import json
import os
import subprocess
import sys

import pytest

from proc_helpers import run_quiet

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(cmd, timeout):
    return run_quiet(cmd, timeout, cwd=ROOT)


def test_two_bit_byte_count():
    from mxhylo.bench.accuracy import dense_bytes, twobit_bytes

    assert dense_bytes(10) == 40
    assert twobit_bytes(16) == 4 and twobit_bytes(17) == 8 and twobit_bytes(1) == 4
    assert twobit_bytes(524288) * 16 == dense_bytes(524288)


PUSH_THEN_PULL_WORKER = """
import mxnet as mx
from mxhylo.bench.modes import PushThenPull
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


# default run: the harness's arithmetic (byte counts above, cells and budgets below)
@pytest.mark.slow
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
                    "--modes", "dist_sync,mxnet_2bit,hylo_rule,hylo_dense_pull",
                    "--workers", "2", "--servers", "1",
                    "--plot", str(tmp_path / "accuracy_curves.png"), "--json", str(out)], timeout=600)
    assert rc == 0, log[-4000:]
    report = json.load(open(out))
    assert sorted(report["cells"]) == ["digits_net lr=0.05 epochs=1",
                                       "digits_net lr=0.05 epochs=2"]
    # each budget is its own job: the short cell's curve ends at its own last step
    short = report["curves"]["digits_net lr=0.05 epochs=1"]["dist_sync"][0]
    long_ = report["curves"]["digits_net lr=0.05 epochs=2"]["dist_sync"][0]
    assert 2 * short[-1][0] == long_[-1][0]
    by = report["bytes_per_step_pushed_pulled"]["digits_net"]
    dense = by["dist_sync"][0]
    assert by["dist_sync"] == [dense, dense]
    assert by["mxnet_2bit"][0] < dense / 15 and by["mxnet_2bit"][1] == dense
    # hylo_rule's first 30 steps are its dense warm-up: the whole run averages above 1/8
    assert by["hylo_rule"][0] < dense and by["hylo_dense_pull"][1] == pytest.approx(dense, rel=0.01)
    for cell in report["cells"].values():
        for mode in ("dist_sync", "mxnet_2bit", "hylo_rule", "hylo_dense_pull"):
            assert all(cell[mode]["workers_identical"]), (mode, cell[mode])
    assert report["diverged_runs"] == []
    assert (tmp_path / "accuracy_curves.png").is_file()


@pytest.mark.slow
def test_accuracy_study_in_one_process(tmp_path):
    """--servers 0: W = 1, one process over two devices, no job: dist_sync is MXNet's
    'device' store, hylo the in-process store (it compresses, as one worker would);
    both start from the same weights and data (the same first evaluation)."""
    out = tmp_path / "report.json"
    rc, log = _run([sys.executable, "-m", "mxhylo.bench", "accuracy", "--seeds", "1",
                    "--nets", "digits_net", "--lrs", "0.05", "--epochs", "2",
                    "--short-epochs", "2", "--lr-schedule", "constant",
                    "--modes", "dist_sync,hylo", "--workers", "1", "--servers", "0",
                    "--plot", "", "--json", str(out)], timeout=300)
    assert rc == 0, log[-4000:]
    runs = [json.loads(l) for l in open(str(out) + ".runs.jsonl")]
    by = {r["mode"]: r for r in runs}
    assert by["dist_sync"]["workers"] == by["hylo"]["workers"] == 1
    assert by["dist_sync"]["curve"][0] == by["hylo"]["curve"][0]
    assert by["hylo"]["bytes_per_step"] < by["dist_sync"]["bytes_per_step"]    # compressed
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


@pytest.mark.slow
def test_a_stopped_accuracy_study_leaves_no_process(tmp_path):
    """SIGTERM to `bench accuracy` while a job trains ends the job too: its launcher
    and every role (the job dies with the study, as a job dies with its launcher)."""
    import signal
    import time
    cmd = [sys.executable, "-m", "mxhylo.bench", "accuracy", "--seeds", "1", "--nets",
           "digits_net", "--lrs", "0.05", "--epochs", "40", "--short-epochs", "40",
           "--lr-schedule", "constant", "--modes", "dist_sync", "--workers", "2",
           "--servers", "1", "--plot", "", "--json", str(tmp_path / "r.json")]
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

    cfg = {"nets": ["n"], "lrs": [0.1], "modes": ["dist_sync", "hylo"], "seeds": 1,
           "epochs": 4, "short_epochs": 2, "lr_schedule": "cosine", "warmup_epochs": 1}
    assert budgets(cfg) == [2, 4]
    runs = [_fake_run("n", 0.1, "dist_sync", 0, 2, [(10, 0.5), (20, 0.9)]),
            _fake_run("n", 0.1, "hylo", 0, 2, [(10, 0.4), (20, 0.88)]),
            _fake_run("n", 0.1, "dist_sync", 0, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]),
            _fake_run("n", 0.1, "hylo", 0, 4, [(10, 0.3), (20, 0.5), (40, 0.96)])]
    report = summarize(cfg, runs)
    short, long_ = report["cells"]["n lr=0.1 epochs=2"], report["cells"]["n lr=0.1 epochs=4"]
    assert short["dist_sync"]["final_accuracy"]["mean"] == 0.9          # not 0.6
    assert short["hylo"]["gap_points"] == pytest.approx(-2.0)
    assert long_["hylo"]["gap_points"] == pytest.approx(1.0)
    assert report["checks"]["n lr=0.1 epochs=2"]["within_0.5_points"] is False
    assert report["checks"]["n lr=0.1 epochs=4"]["within_0.5_points"] is True
    assert sorted(report["curves"]) == ["n lr=0.1 epochs=2", "n lr=0.1 epochs=4"]

    # a cell where dense misses its own target in a seed is not checked, and says why
    runs[2] = _fake_run("n", 0.1, "dist_sync", 0, 4, [(10, 0.1), (20, 0.1), (40, 0.1)])
    runs.append(_fake_run("n", 0.1, "dist_sync", 1, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]))
    report = summarize(dict(cfg, seeds=2), runs)
    assert "n lr=0.1 epochs=4" not in report["checks"]
    assert "seed(s) [0]" in report["checks_not_applicable"]["n lr=0.1 epochs=4"]
    assert report["checks_total"] == 1

    runs = runs[:2] + [_fake_run("n", 0.1, "dist_sync", 0, 4, [(10, 0.3), (20, 0.6), (40, 0.95)]),
                       _fake_run("n", 0.1, "hylo", 0, 4, [(10, 0.3), (20, 0.5), (40, 0.96)])]
    constant = dict(cfg, lr_schedule="constant")
    assert budgets(constant) == [4]
    report = summarize(constant, runs[2:])
    assert report["cells"]["n lr=0.1 epochs=2"]["dist_sync"]["final_accuracy"]["mean"] == 0.6
    assert report["cells"]["n lr=0.1 epochs=2"]["hylo"]["gap_points"] == pytest.approx(-10.0)
