"""Distributed hylo through real scheduler, server and worker processes (MXNet's ps-lite).

Each test launches `python -m mxhylo.launch -n 2 -s 2 python examples/train_digits.py`
on loopback (free port, a timeout on the whole job) and compares what the workers saved.
"""
import json
import pickle
import os
import subprocess
import sys
import time

import numpy as np
import pytest


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def launch(tmp_path, tag, *args, workers=2, servers=2, epochs=10):
    prefix = str(tmp_path / tag)
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", str(workers), "-s", str(servers),
           "--timeout", "240", sys.executable, os.path.join(ROOT, "examples", "train_digits.py"),
           "--epochs", str(epochs), "--batch-size", "32", "--save-params", prefix + "-{rank}.npz",
           "--json", prefix + "-{rank}.json"] + list(args)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    params = [dict(np.load(prefix + "-%d.npz" % r)) for r in range(workers)]
    reports = [json.load(open(prefix + "-%d.json" % r)) for r in range(workers)]
    return params, reports, proc.stdout


def assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, err_msg=name)


def _identical(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def dist_sync(tmp_path_factory):
    """A plain dist_sync run. Its two workers agree: before kvstore.trainer_hook waited
    for the initial broadcast, MXNet's dist_sync now and then left one worker training
    on the summed gradient as its initial weights (2 of 18 runs of an accuracy study)."""
    run = launch(tmp_path_factory.mktemp("dense"), "dense", "--kvstore", "dist_sync")
    assert _identical(run[0][0], run[0][1]), "dist_sync's workers ended with different parameters"
    return run


def test_hylo_workers_bitwise_identical_and_accuracy_near_dist_sync(tmp_path, dist_sync):
    # no warm-up: the byte and message counts below are those of compressed steps
    # (and no cost model: on loopback it may leave layers dense, and this test is about
    # the compressed exchange)
    params, reports, out = launch(tmp_path, "hylo", "--kvstore", "dist_sync_hylo",
                                  "--warmup-steps", "0", "--cost-model", "off")
    assert_same(params[0], params[1])
    assert sorted(r["rank"] for r in reports) == [0, 1]
    dense_acc = dist_sync[1][0]["accuracy"]
    # Hylo's promise is an accuracy loss below 1 point (it may also come out ahead)
    assert reports[0]["accuracy"] >= dense_acc - 0.01, (reports[0]["accuracy"], dense_acc)
    assert reports[0]["compressed_layers_ratio"] >= 8
    # over the parameter server the default pull gathers the workers' payloads
    # (compress_pull='auto' = 'gather'): about W times the push, far below dense
    assert reports[0]["bytes_pulled"] < 2.5 * reports[0]["bytes_pushed"]
    assert reports[0]["bytes_pulled"] < reports[0]["dense_bytes"] / 4
    # Gluon's per-key loop is exchanged as one step: the 8 small tensors travel in 2
    # buckets (those backward writes before the 2 MB dense weight and those after it:
    # ps_keys.BUCKET_SPANS), the conv takes one key, and the dense weight is cut in one
    # piece per server
    assert reports[0]["messages_per_step"] == 5
    # two keys carry the bytes here (the bucket and the 2-bit layer's), one per server:
    # the balance is theirs (about 0.79 since slots carry 30 bits a value)
    per_server = sorted(reports[0]["bytes_per_server"].values())
    assert len(per_server) == 2 and per_server[0] > 0.7 * per_server[1]


# default run: test_pull.py's gather-equals-dense-pull job (the dense pull's aggregate,
# bitwise, its bytes) and the accuracy test above (the default pull)
@pytest.mark.slow
def test_dense_pull_keeps_workers_identical_and_accuracy(tmp_path, dist_sync):
    """compress_pull=False ('gather', the default: above): bitwise identical workers
    after training, accuracy within 1 point of dist_sync, the dense aggregate pulled."""
    params, reports, _ = launch(tmp_path, "pull-off", "--kvstore", "dist_sync_hylo",
                                "--compress-pull", "off", "--warmup-steps", "0")
    assert_same(params[0], params[1])
    dense_acc = dist_sync[1][0]["accuracy"]
    assert reports[0]["accuracy"] >= dense_acc - 0.01, (reports[0]["accuracy"], dense_acc)
    assert reports[0]["bytes_pulled"] >= reports[0]["dense_bytes"]


# default run: compression off equals MXNet's 'device' store bitwise in one process
# (test_kvstore.py); hylo over the servers with every layer uncompressed equals one
# process (test_launch.py, mxhylo.run); over Horovod, DistributedTrainer (test_horovod.py)
@pytest.mark.slow
def test_hylo_without_compression_equals_dist_sync(tmp_path, dist_sync):
    params, _, _ = launch(tmp_path, "off", "--kvstore", "dist_sync_hylo",
                          "--policy", json.dumps({".*": "none"}))
    assert_same(params[0], params[1])
    assert_same(params[0], dist_sync[0][0])


def launch_keys_worker(tmp_path, mode, *launch_args, timeout=120):
    out = str(tmp_path / (mode + "-{rank}.json"))
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout",
           str(timeout)] + list(launch_args) + [
           sys.executable, os.path.join(ROOT, "tests", "distributed", "jobs", "dist_keys_worker.py"), mode, out]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    return proc, out, time.time() - start


def test_broadcast_gives_every_worker_rank0s_values_bitwise(tmp_path):
    """Every worker gets rank 0's values bitwise: large and small parameters, float16,
    in place, one after another."""
    proc, out, _ = launch_keys_worker(tmp_path, "broadcast")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
    for i in range(6):
        want = got[0]["sent%d" % i]
        assert not np.array_equal(got[1]["sent%d" % i], want)   # each its own values
        for r in range(2):
            for name in ("got%d" % i, "gotb%d" % i):
                if name in got[r]:
                    assert got[r][name].dtype == want.dtype
                    np.testing.assert_array_equal(got[r][name], want, err_msg=name)
    assert np.signbit(got[0]["sent4"][0]) and got[1]["got4"][0] == 0.0   # (-0.0 == 0.0)


# default run: the accuracy test above (Gluon's small tensors in 2 bucket messages)
@pytest.mark.slow
def test_small_tensors_travel_fused(tmp_path):
    """21 small uncompressed tensors pushed in one call: one bucket message per step."""
    proc, out, _ = launch_keys_worker(tmp_path, "fusion")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        report = json.load(open(out.format(rank=rank)))
        assert report["ok"]
        assert report["messages_per_step"] == 1
        assert sum(report["bytes_per_server"].values()) > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, launcher_args", [
    # the default bound: its 60 s floor (kvstore.watchdog.AUTO_MIN) is most of the run
    pytest.param("stall", [], marks=pytest.mark.slow, id="default_bound"),
    # (the stopped server ignores SIGTERM: SIGKILL comes after --grace)
    pytest.param("stall:6", ["--grace", "1"], id="bound_6s")])
def test_a_stopped_server_ends_the_job_with_a_message(tmp_path, mode, launcher_args):
    """A server stopped with SIGSTOP mid-training (a frozen machine): with the default
    bound (or stall_timeout=6), every worker's watchdog ends it within 90 s, naming
    the exchange and the server, and the launcher tears the job down. (The default
    bound's value: test_watchdog.py.)"""
    import re
    import signal
    out = str(tmp_path / "stall-{rank}.txt")
    cmd = [sys.executable, "-m", "mxhylo.launch", "-n", "2", "-s", "2", "--timeout", "200"] + \
        launcher_args + [sys.executable, os.path.join(ROOT, "tests", "distributed", "jobs", "dist_keys_worker.py"),
                         mode, out]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, server_pid = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"server 1 pid (\d+)", line)
            if found:
                server_pid = int(found.group(1))
                break
        assert server_pid, "".join(lines)
        deadline = time.time() + 120
        while time.time() < deadline:      # mid-training: both workers past step 5
            steps = [int(open(out.format(rank=r)).read() or 0)
                     if os.path.exists(out.format(rank=r)) else 0 for r in range(2)]
            if min(steps) >= 5:
                break
            time.sleep(0.2)
        assert min(steps) >= 5, steps
        os.kill(server_pid, signal.SIGSTOP)
        stopped = time.time()
        rest, _ = proc.communicate(timeout=150)
        ended = time.time() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server_pid:
            try:
                os.kill(server_pid, signal.SIGKILL)    # if the launcher left it behind
            except ProcessLookupError:
                pass
    text = "".join(lines) + rest
    assert proc.returncode != 0, text[-3000:]
    assert ended < 90, (ended, text[-3000:])
    assert re.search(r"worker \d: exchange \d+ \(training step \d+ under a Trainer\) has "
                     r"not completed after", text), text[-3000:]
    # the worker names ps-lite's server rank (its numbering, not the launcher's) ...
    assert re.search(r"waiting for layer '\w+' \(key \d+, server [01]\)", text), text[-3000:]
    assert re.search(r"Parameter server\(s\) [0-9, ]+ \(ps-lite's server ranks\) may be "
                     r"stopped", text), text[-3000:]
    # ... and the launcher names the process
    assert "server 1 (pid %d) is stopped (process state T" % server_pid in text, text[-3000:]


@pytest.mark.timeout(180)
def test_a_workers_own_stalled_backward_is_not_blamed_on_the_servers(tmp_path):
    """Rank 0's backward takes 30 s in one step, past stall_timeout=3: its watchdog
    ends it saying that it waits for its own gradient, not naming a server as the
    cause; the job ends well before the backward would have."""
    proc, out, seconds = launch_keys_worker(tmp_path, "own_stall")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert open(out.format(rank=0)).read() == "3", text[-3000:]    # stalled in step 4
    # (the launcher quotes it again when it stops the job)
    own = [line for line in text.splitlines()
           if line.startswith("[worker") and "] mxhylo: worker 0: exchange" in line]
    assert len(own) == 1, text[-3000:]
    assert "waiting for this worker's own next gradient" in own[0], own[0]
    assert "Parameter server(s)" not in own[0], own[0]
    assert seconds < 90, (seconds, text[-3000:])


def test_workers_with_different_models_end_the_job(tmp_path):
    proc, _, seconds = launch_keys_worker(tmp_path, "mismatch")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "workers train different models" in text, text[-3000:]
    assert "(64, 32, 3, 3)" in text or "(32, 32, 3, 3)" in text
    assert seconds < 100


def test_server_that_cannot_import_mxhylo_ends_the_job(tmp_path):
    """Servers see a broken mxhylo first on their path: the workers' probe catches it."""
    fake = tmp_path / "broken" / "mxhylo"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    proc, _, seconds = launch_keys_worker(
        tmp_path, "fusion", "--env-server", "PYTHONPATH:%s" % fake.parent)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "do not run hylo's decoder" in text, text[-3000:]
    assert seconds < 100


def _startup_launches(tmp_path, seeds):
    """A job of dist_keys_worker.py startup:SEED for each of ``seeds``, in a row: every
    one must end well, with exact sums (a key reaching a server before its init aborts
    the server)."""
    seeds = list(seeds)
    for launch, seed in enumerate(seeds):
        proc, out, _ = launch_keys_worker(tmp_path, "startup:%d" % seed, timeout=90)
        assert proc.returncode == 0, "launch %d of %d: %s" % (
            launch + 1, len(seeds), proc.stdout[-3000:] + proc.stderr[-3000:])
        for rank in range(2):
            report = json.load(open(out.format(rank=rank)))
            assert report["ok"], (seed, report)
            assert report["buckets"] == 4, report      # one per step: each made mid-training


# default run: the user scripts' launches under load (test_user_scripts.py: keys made
# at the first step on every route); the 50-launch soak below
@pytest.mark.slow
def test_keys_made_during_training_under_shaken_timing(tmp_path):
    # seed 1: the default pull, 'gather' (compress_pull by the seed's parity; the
    # dense pull's keys, even seeds, in the 50 launches below)
    _startup_launches(tmp_path, [1])


@pytest.mark.slow
@pytest.mark.timeout(50 * 60)
def test_keys_made_during_training_50_launches(tmp_path):
    """The issue's bar: 50 consecutive start-ups (python -m pytest --runslow)."""
    _startup_launches(tmp_path, range(50))


# default run: test_overlap.py (overlap on and off bitwise equal, pushes during
# backward), test_kvstore.py (the step's order against Gluon's per-key one, bitwise),
# and the jobs above, whose stores overlap by default
@pytest.mark.slow
def test_overlapped_exchange_equals_serial_ones_bitwise_and_pushes_during_backward(
        tmp_path):
    """2 workers + 2 servers, a conv net whose first layer's backward is late (0.8 s):
    the Trainer's step exchanged in one call as backward writes the gradients (the
    store's hook, overlap on), in one call after backward (overlap off), and by Gluon's
    own loop (one pushpull per key, in order) give bitwise the same parameters over 4
    compressed steps (conv_topk, fc_2bit and fused uncompressed layers).
    With overlap on, the layers after the late one leave while its backward still
    runs (the fused bucket always; the exchange begins before backward ends); with it
    off, no push leaves before backward has ended: so this fails if the exchange waits
    for all of backward."""
    runs, reports = {}, {}
    for how in ("step", "nooverlap", "serial"):
        proc, out, _ = launch_keys_worker(tmp_path, "order:" + how)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[how] = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
        reports[how] = [json.load(open(out.format(rank=r))) for r in range(2)]
        assert reports[how][0]["policies"] == ["conv_topk", "fc_2bit", "none"], reports
        # only the one-call exchange fuses small layers into a bucket key
        assert (reports[how][0]["buckets"] > 0) == (how != "serial"), (how, reports)
    for name, value in runs["step"][0].items():
        for how in runs:
            for r in range(2):
                np.testing.assert_array_equal(runs[how][r][name], value,
                                              err_msg="%s %s rank %d" % (name, how, r))
    assert all(r["overlap"] for r in reports["step"])
    for report in reports["step"]:
        # (from the second step: in the first, which also makes the keys, the late
        # operator's recorded end does not bound the gradients' writes: every store,
        # overlap off included, had them all 0.8 s before it; not traced further)
        for step in report["steps"][1:]:
            end, push = step["backward_end"], step["push"]
            assert push["out.bias"] < end - 0.3 and push["out.weight"] < end - 0.3, step
            assert min(push.values()) < end - 0.3, step
            assert push["conv.weight"] > end - 0.05, step    # (test_overlap.py: 50 ms)
    for report in reports["nooverlap"]:
        for step in report["steps"][1:]:
            assert min(step["push"].values()) > step["backward_end"] - 0.05, step


# default run: the user scripts' launches with the cost model running
# (test_user_scripts.py), whose workers end bitwise identical
@pytest.mark.slow
def test_cost_model_every_worker_reaches_rank0s_plan(tmp_path):
    """With the cost model on (loopback: whatever it decides), both workers use rank 0's
    measured numbers, make the same per-layer choices and stay bitwise identical."""
    params, reports, _ = launch(tmp_path, "cost", "--kvstore", "dist_sync_hylo",
                                "--warmup-steps", "0", "--cost-model", "on", epochs=2)
    assert_same(params[0], params[1])
    costs = [r["cost_model"] for r in reports]
    measured = [{n: p.pop("measured_s") for n, p in c["layers"].items()} for c in costs]
    assert costs[0] is not None and costs[0] == costs[1]
    # what each worker measured is its own; every exchanged layer has its figure (the
    # parameters only broadcast, such as BatchNorm's running statistics, none)
    exchanged = set(reports[0]["plans"])
    for m in measured:
        assert all((s is not None and s > 0) == (n in exchanged) for n, s in m.items()), m
    assert costs[0]["per_byte_s"] > 0 and set(costs[0]["codecs"]) == {"conv_topk", "fc_2bit"}
    # each server's link alone (2 servers), one more message's cost, and the cut the
    # transport took from them: rank 0's, on both workers
    from mxhylo.kvstore.cost_model import MIN_SPLIT_ELEMENTS, LinkCosts, WireCost
    links = LinkCosts(tuple(WireCost(**l) for l in costs[0]["links"]), costs[0]["message_s"])
    assert len(links.links) == 2 and all(l.per_byte_s > 0 for l in links.links), links
    from mxhylo.kvstore.wire import DEFAULT_SPLIT_MIN
    assert costs[0]["split_elements"] == max(DEFAULT_SPLIT_MIN, links.split_min_elements())
    assert links.split_min_elements() >= MIN_SPLIT_ELEMENTS
    layers = costs[0]["layers"]
    assert layers, "no layer was offered to the cost model"
    assert exchanged <= set(layers)
    for name, p in layers.items():
        assert p["strategy"] in ("none", "conv_topk", "fc_2bit"), (name, p)
        assert p["strategy"] == "none" or p["codec_s"] < p["dense_s"], (name, p)
        assert name not in exchanged or reports[0]["plans"][name] == p["strategy"], name


# default run: a drift measuring the cost model again in test_cost_recheck.py (one
# process); every worker taking rank 0's measurement over the servers in
# test_cost_model_every_worker_reaches_rank0s_plan
@pytest.mark.slow
def test_drift_seen_by_rank0_alone_makes_every_worker_measure_again(tmp_path):
    """2 workers + 2 servers: only rank 0's exchanges drift (forced times); at the drift
    check after the change both workers measure the cost model again, at the same step
    (rank 0's answer is shared), and stay bitwise identical."""
    proc, out, _ = launch_keys_worker(tmp_path, "drift")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.load(open(out.format(rank=r))) for r in range(2)]
    # checks before steps 3, 6, 9, 12; rank 0's last 2 exchanges are slow at step 9
    assert reports[0]["drifts"] == reports[1]["drifts"] == [0] * 8 + [1] * 4, reports
    runs = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
    for name, value in runs[0].items():
        np.testing.assert_array_equal(runs[1][name], value, err_msg=name)


# default run: test_cost_recheck.py (the same re-plans in one process), the cost
# model's real probes over the servers (test_cost_model_every_worker_reaches_rank0s_plan)
# and a drift making every worker measure again (the test above)
@pytest.mark.slow
def test_cost_model_rechecked_mid_run_replans_and_loses_nothing(tmp_path):
    """recheck_costs (real probes mid-run, the fitted wire forced slow, fast, slow,
    fast): layers go compressed -> dense -> compressed -> dense on both workers at the
    same step, on keys made for each plan (the warm-up keys reused, and kept for the
    way back). Summed over workers, what the layers received equals what was sent
    once a dense phase has flushed the residuals, and not while they are compressed."""
    proc, out, _ = launch_keys_worker(tmp_path, "recheck", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.load(open(out.format(rank=r))) for r in range(2)]
    assert reports[0]["strategies"] == reports[1]["strategies"]
    assert reports[0]["changes"] == reports[1]["changes"] == [
        {"conv": ["conv_topk", "none"], "fc": ["fc_2bit", "none"]},
        {"conv": ["none", "conv_topk"], "fc": ["none", "fc_2bit"]},
        {"conv": ["conv_topk", "none"], "fc": ["fc_2bit", "none"]}]
    want = ["conv_topk"] * 3 + ["none"] * 3 + ["conv_topk"] * 3 + ["none"] * 3
    assert [s["conv"] for s in reports[0]["strategies"]] == want
    assert all(s["bias"] == "none" for s in reports[0]["strategies"])
    assert reports[0]["steps"] == 12               # the probes do not count as steps
    assert reports[0]["decisions"] == {"conv": "none", "fc": "none", "bias": "none"}
    assert reports[0]["warmup_done"] == {"conv": 1, "fc": 1}    # no second warm-up
    for phase, flushed in enumerate([False, True, False, True]):
        runs = [dict(np.load(out.format(rank=r) + ".phase%d.npz" % phase)) for r in range(2)]
        for k in ("conv", "fc", "bias"):
            np.testing.assert_array_equal(runs[0]["got/" + k], runs[1]["got/" + k])
            total = runs[0]["sent/" + k] + runs[1]["sent/" + k]
            # every worker receives the sum: got is the workers' total, twice counted once
            close = np.allclose(runs[0]["got/" + k], total, rtol=1e-4, atol=1e-5)
            assert close == (flushed or k == "bias"), (phase, k)


def _route_run(tmp_path, how):
    proc, out, _ = launch_keys_worker(tmp_path, "route:" + how, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.load(open(out.format(rank=r))) for r in range(2)]
    arrays = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
    return reports, arrays


def test_servers_route_equals_dist_sync_and_takes_a_new_learning_rate(tmp_path):
    """server_update=True: Gluon updates on the servers through hylo's keys (one layer
    cut over both servers), bitwise what MXNet's dist_sync gives; a learning rate and
    momentum set to 0 on the Trainer reach the servers (the weights stop: under
    dist_sync they would go on moving with the servers' momentum); the store stays the
    Trainer's, trainer.save_states saves (tests/distributed/test_server_states.py: what), and a
    last, smaller batch steps (Gluon refuses it with MXNet's own store)."""
    reports, arrays = _route_run(tmp_path, "servers")
    dense_reports, dense = _route_run(tmp_path, "dist_sync")
    for report in reports:
        assert report["store"] == "DistSyncHylo" and report["update_on_kvstore"]
        route = report["route"]
        assert (route["route"], route["reason"]) == ("servers", "server_update=True")
        assert report["save_states"] == "saved"
        assert report["smaller_batch"] == "ok"
        # kv.stats() counts the route's dense steps: 3 + 2 + the smaller batch
        assert report["traffic"]["steps"] == 6 and report["traffic"]["ratio"] == 1.0
        assert report["traffic"]["bytes_pushed"] == report["traffic"]["dense_bytes"] > 0
        # the 1 179 648-element weight is cut over both servers, the rest whole
        assert sorted(len(p) for p in report["pieces"].values()) == [1] * 5 + [2]
        assert sorted(max(report["pieces"].values(), key=len)) == [0, 1]
    assert dense_reports[0]["update_on_kvstore"]
    first = {k: v for k, v in arrays[0].items() if k.startswith("first/")}
    assert_same(first, {k: v for k, v in dense[0].items() if k.startswith("first/")})
    assert_same(arrays[0], arrays[1])
    for key, value in first.items():
        np.testing.assert_array_equal(arrays[0]["second/" + key[len("first/"):]], value,
                                      err_msg=key)


# default run: server_update='auto' over the servers with the cost model, and with
# it off over Horovod (test_user_scripts.py: ps-auto, horovod-auto-cost_off); a route
# on trial (test_route_trial_... below); the route without measurements (test_plan.py)
@pytest.mark.slow
@pytest.mark.parametrize("how", ["auto", "auto_dense_pull"])
def test_route_chosen_by_rank0s_figures(tmp_path, how):
    """server_update='auto': every worker takes the same route. With the cost model its
    first steps are the servers' (the warm-up of a route on trial, or no layer worth
    compressing); where an explicit option (compress_pull=False) turns the cost model
    off, nothing is measured and the workers' route is taken."""
    reports, arrays = _route_run(tmp_path, how)
    route = reports[0]["route"]
    assert route == reports[1]["route"]
    assert route["workers_s"] is None and route["servers_s"] is None   # (3 steps)
    if how == "auto":
        assert route["reason"].startswith(("on trial", "no layer compresses")), route
        want = "servers"
    else:
        assert route["reason"].startswith("not measured"), route
        want = "workers"
    assert route["route"] == want
    # on the servers' route the Trainer updates on the kvstore
    assert all(r["update_on_kvstore"] == (want == "servers") for r in reports), reports
    assert_same(arrays[0], arrays[1])


@pytest.mark.parametrize("faster", [
    # (the 'servers' case trials the workers' route too, then goes back)
    pytest.param("workers", marks=pytest.mark.slow), "servers"])
def test_route_trial_keeps_the_faster_route_and_moves_the_optimizer(tmp_path, faster):
    """A route on trial (kvstore.route; its clock forced): 3 warm-up steps on the
    servers, 4 compressed steps on the workers, then the faster route for good; going
    back to the servers takes 2 dense steps first. The optimizer's state and update
    counts move with it: after 12 steps every parameter was updated 12 times, the
    saved state is finite and not zero, and both workers hold the same weights."""
    proc, out, _ = launch_keys_worker(tmp_path, "route:trial_" + faster, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.load(open(out.format(rank=r))) for r in range(2)]
    arrays = [dict(np.load(out.format(rank=r) + ".npz")) for r in range(2)]
    assert_same(arrays[0], arrays[1])
    for report in reports:
        route = report["route"]
        assert route["settled"] and route["route"] == faster, route
        # compressed on the workers' route; made dense before going back
        assert bool(report["compressed"]) == (faster == "workers"), report
        if faster == "workers":
            assert route["moves"] == [[4, "workers"]]
            assert report["routes"] == ["servers"] * 3 + ["workers"] * 9
            assert (route["servers_s"], route["workers_s"]) == (2.0, 1.0)
        else:
            assert route["moves"] == [[4, "workers"], [10, "servers"]]
            assert report["routes"] == ["servers"] * 3 + ["workers"] * 6 + ["servers"] * 3
            assert (route["servers_s"], route["workers_s"]) == (1.0, 2.0)
        assert report["update_on_kvstore"] == (faster == "servers")
        assert report["evaluation_finite"], report
        with open(out.format(rank=report["rank"]) + ".states", "rb") as f:
            content = pickle.load(f)
        states, optimizer = content if isinstance(content, tuple) else (content, None)
        if optimizer is not None:
            assert set(optimizer._index_update_count.values()) == {12}
        else:
            assert report["num_update"] == 12
        momenta = [s.asnumpy() for s in states.values() if s is not None]
        assert momenta and all(np.isfinite(m).all() for m in momenta)
        assert any(np.abs(m).max() > 0 for m in momenta)
