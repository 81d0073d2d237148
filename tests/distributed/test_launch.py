"""Tests of ``python -m mxhylo.launch`` and ``python -m mxhylo.run`` (plain dist_sync).

Real jobs run a scheduler, servers and workers as processes on this machine. Every
job gets a free port (the launcher picks one), a --timeout, and a --pid-file; each
test checks afterwards that every pid the launcher started is gone, and kills only
those pids if one is not.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mxhylo import launch, procs
from proc_helpers import clean_env, end_groups, launched_pids

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(REPO, "tests", "distributed", "jobs")
DIGITS = os.path.join(SCRIPTS, "digits_dist.py")
STANDIN = os.path.join(SCRIPTS, "train_imagenet_standin.py")
PY = sys.executable
KV = os.environ.get("MXHYLO_TEST_KVSTORE", "dist_sync")   # the store every job uses


def launcher(args, tmp_path, timeout=60, env=None, grace=3):
    """argv of a launcher run (with a pid file and a job timeout; grace None: the
    launcher's default)."""
    pid_file = str(tmp_path / "pids.json")
    grace_args = [] if grace is None else ["--grace", str(grace)]
    return ([PY, "-m", "mxhylo.launch", "--pid-file", pid_file, "--timeout", str(timeout)]
            + grace_args + args), pid_file


def assert_all_gone(pid_file):
    """Every pid the launcher started is gone (or a zombie); kill survivors, then fail."""
    if os.path.exists(pid_file):
        assert_pids_gone(launched_pids(pid_file))


def assert_pids_gone(pids):
    """These pids (group leaders) are gone, and their groups empty; kill survivors,
    then fail."""
    alive = end_groups(pids)
    assert not alive, "launcher left processes running: %s" % alive


def run_launcher(args, tmp_path, timeout=60, env=None, grace=3):
    """Run the launcher to completion; returns (returncode, output, seconds)."""
    argv, pid_file = launcher(args, tmp_path, timeout, grace=grace)
    t0 = time.monotonic()
    # Not the repository as cwd: python puts the cwd first on sys.path, where it
    # would shadow the (broken) mxhylo a test puts on PYTHONPATH.
    proc = subprocess.run(argv, cwd=str(tmp_path), env=env or clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout + 30)
    elapsed = time.monotonic() - t0
    out = proc.stdout.decode("utf-8", "replace")
    assert_all_gone(pid_file)
    return proc.returncode, out, elapsed


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


# ----------------------------------------------------------------------------- environment

class _Args:
    """Parsed-options stand-in for plan_children."""

    def __init__(self, **kw):
        self.num_workers, self.num_servers = kw.pop("n", 2), kw.pop("s", 2)
        self.launcher, self.hostfile, self.sync_dst_dir = kw.pop("launcher", "local"), \
            kw.pop("hostfile", None), None
        self.ssh, self.env, self.env_server, self.env_worker = "ssh", [], [], []
        self.command = kw.pop("command", ["python", "train.py"])
        self.__dict__.update(kw)


def _mxnet_local_envs(monkeypatch, W, S):
    """Run dmlc-tracker's local launcher (what MXNet's tools/launch.py calls) with its
    subprocess calls captured; returns {('scheduler'|'worker'|'server', task_id): env}."""
    import threading
    from dmlc_tracker import local, tracker

    class Thread(threading.Thread):     # dmlc-tracker still calls Thread.isAlive()
        isAlive = threading.Thread.is_alive
    captured, lock, all_in = {}, threading.Lock(), threading.Event()

    def fake_call(cmd, shell=None, executable=None, env=None):
        with lock:
            captured[(env["DMLC_ROLE"], env["DMLC_TASK_ID"])] = env
            if len(captured) == 1 + W + S:
                all_in.set()
        return 0

    def fake_check_call(cmd, env=None, shell=None, executable=None):
        # The "scheduler" must stay alive until the others started: dmlc-tracker only
        # submits them while its scheduler thread is alive.
        with lock:
            captured[("scheduler", None)] = env
        all_in.wait(10)
    monkeypatch.setattr(tracker, "Thread", Thread)
    monkeypatch.setattr(local.subprocess, "call", fake_call)
    monkeypatch.setattr(tracker.subprocess, "check_call", fake_check_call)

    class A:
        num_workers, num_servers, command, local_num_attempt = W, S, ["python", "x.py"], 0
    local.submit(A)
    return captured, tracker.get_host_ip("auto")


def test_local_env_matches_mxnet_launcher(monkeypatch):
    """Per role, the variables we add to the environment equal dmlc-tracker's."""
    W, S = 2, 3
    mx_envs, mx_host = _mxnet_local_envs(monkeypatch, W, S)
    assert mx_host == procs.host_ip("auto")
    base = dict(os.environ)
    port = int(mx_envs[("scheduler", None)]["DMLC_PS_ROOT_PORT"])
    children = launch.plan_children(_Args(n=W, s=S), mx_host, port, environ=base)
    assert len(children) == 1 + W + S
    ours = {}
    for c in children:
        key = (c.role, c.env.get("DMLC_TASK_ID"))
        ours[key] = c.env
    assert set(ours) == set(mx_envs)
    for key, mx_env in mx_envs.items():
        theirs = {k: str(v) for k, v in mx_env.items() if os.environ.get(k) != str(v)}
        mine = {k: v for k, v in ours[key].items() if os.environ.get(k) != v}
        mine.pop("PYTHONUNBUFFERED", None)     # ours only: line-wise output through pipes
        if key[0] == "server":                 # ours only: one OpenMP thread on servers
            for name, value in launch.server_defaults(base).items():
                assert mine.pop(name) == value
        assert mine == theirs, key
    # And the builder alone says the same, e.g. for worker 1 and server 0:
    assert launch.role_env("worker", W, S, mx_host, port, task_id=1) == {
        k: v for k, v in mx_envs[("worker", "1")].items() if k.startswith("DMLC_")}
    assert launch.role_env("server", W, S, mx_host, port, task_id=W) == {
        k: v for k, v in mx_envs[("server", str(W))].items() if k.startswith("DMLC_")}


def test_ssh_commands_match_mxnet_launcher(monkeypatch, tmp_path):
    """The ssh launcher's remote env/host placement equals dmlc-tracker's ssh launcher."""
    import re
    import threading
    from dmlc_tracker import ssh, tracker

    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostA\nhostB:2222\n\nhostC slots=4\n")
    W, S = 2, 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")

    class Thread(threading.Thread):
        isAlive = threading.Thread.is_alive
    progs, all_in = [], threading.Event()

    def fake_check_call(cmd, env=None, shell=None, executable=None):
        # tracker and ssh share the subprocess module: env= marks the scheduler's call,
        # which must outlive the submissions (dmlc-tracker submits while it is alive).
        if env is not None:
            all_in.wait(10)
            return 0
        progs.append(cmd)
        if len(progs) == W + S:
            all_in.set()
        return 0
    monkeypatch.setattr(tracker, "Thread", Thread)
    monkeypatch.setattr(ssh.subprocess, "check_call", fake_check_call)

    class A:
        num_workers, num_servers, host_file, host_ip = W, S, str(hostfile), None
        sync_dst_dir, command = None, ["python", "train.py"]
    ssh.submit(A)
    # dmlc: ssh -o StrictHostKeyChecking=no HOST -p PORT 'export K=V; ... cd DIR; CMD'
    theirs = []
    for prog in progs:
        m = re.match(r"ssh -o StrictHostKeyChecking=no (\S+) -p (\S+) '(.*)'$", prog)
        host, port, remote = m.groups()
        env = dict(re.findall(r"export (\w+)=([^;]*);", remote))
        theirs.append((host, port, env))
    port = int(theirs[0][2]["DMLC_PS_ROOT_PORT"])
    uri = theirs[0][2]["DMLC_PS_ROOT_URI"]
    children = launch.plan_children(_Args(n=W, s=S, launcher="ssh", hostfile=str(hostfile)),
                                    uri, port, environ=dict(os.environ))
    ours = []
    for c in children[1:]:
        argv = c.argv
        assert argv[:3] == ["ssh", "-o", "StrictHostKeyChecking=no"]
        _, _, _, _, sport, host, remote = argv
        assert remote.startswith("exec bash -c ")
        inner = shlex.split(remote)[3]
        assert inner.startswith("cd %s && export " % shlex.quote(os.getcwd()))
        assert "{ python train.py ; }" in inner
        env = dict(tuple(a.split("=", 1)) for a in
                   shlex.split(inner.split(" && ")[1])[1:])
        assert env.pop("PYTHONUNBUFFERED") == os.environ.get("PYTHONUNBUFFERED", "1")
        if env["DMLC_ROLE"] == "server":
            for name, value in launch.server_defaults(os.environ).items():
                assert env.pop(name) == value
        ours.append((host, sport, env))
    # dmlc starts its threads in order servers then workers; compare as sets per role.
    key = lambda t: (t[2]["DMLC_ROLE"], t[0], t[1], sorted(t[2].items()))
    assert sorted(map(key, ours)) == sorted(map(key, theirs))
    assert all("DMLC_TASK_ID" not in env for _, _, env in ours)
    assert children[0].role == "scheduler" and children[0].host == "local"


def test_ssh_remote_command_runs_and_stops_on_stdin_close(tmp_path):
    """The remote shell text works (run by a local bash standing in for sshd): it cds,
    exports, runs CMD; closing its stdin (what teardown does) stops CMD's group."""
    marker = tmp_path / "env.txt"
    remote = launch.remote_command(str(tmp_path), {"DMLC_ROLE": "worker", "X": "a b'c"},
                                   ["bash", "-c", 'echo "$$|$PWD|$DMLC_ROLE|$X" > env.txt; '
                                                  'exec sleep 300'])
    p = subprocess.Popen(["bash", "-c", remote], stdin=subprocess.PIPE,
                         start_new_session=True)
    try:
        wait_for(lambda: marker.exists() and marker.read_text().endswith("\n"), 10,
                 "the remote command to start")
        cmd_pid, rest = marker.read_text().strip().split("|", 1)
        assert rest == "%s|worker|a b'c" % tmp_path
        assert procs.pid_alive(int(cmd_pid))
        p.stdin.close()
        p.wait(timeout=10)
        assert p.returncode == 128 + signal.SIGTERM      # CMD's status, passed on
        wait_for(lambda: not procs.pid_alive(int(cmd_pid)), 5, "CMD to stop")
        assert not procs.group_members(p.pid)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_small_helpers(tmp_path):
    assert procs.describe_returncode(3) == "exited with code 3"
    assert procs.describe_returncode(-9) == "was killed by signal SIGKILL (9)"
    assert "killed by SIGTERM" in procs.describe_returncode(143)
    hf = tmp_path / "hosts"
    hf.write_text("# comment\n10.0.0.1\n10.0.0.2:2222\n10.0.0.3 slots=8\n")
    assert launch.read_hostfile(str(hf)) == [("10.0.0.1", "22"), ("10.0.0.2", "2222"),
                                              ("10.0.0.3", "22")]
    assert launch.local_argv(["python", "a b.py"]) == ["python", "a b.py"]
    assert launch.local_argv(["cd x && python t.py"]) == ["bash", "-c", "cd x && python t.py"]
    assert launch.node_address("localhost") == "127.0.0.1"
    assert launch.node_address("no-such-host.invalid") == "no-such-host.invalid"
    port = procs.free_port()
    assert 0 < port < 65536
    args = launch.parse_args(["-n", "2", "--env", "A:1", "--env-worker", "DMLC_PS_ROOT_PORT:9",
                              "python", "t.py", "-s", "5"])
    assert args.num_servers == 2 and args.command == ["python", "t.py", "-s", "5"]
    kids = launch.plan_children(args, "10.1.1.1", 1234, environ={"PATH": "/bin"})
    assert [c.name for c in kids] == ["scheduler", "worker 0", "worker 1", "server 0",
                                      "server 1"]
    assert all(c.env["A"] == "1" for c in kids)
    assert [c.env["DMLC_PS_ROOT_PORT"] for c in kids] == ["1234", "9", "9", "1234", "1234"]
    # servers run one OpenMP thread unless told otherwise; workers keep the shell's value
    assert [c.env.get("OMP_NUM_THREADS") for c in kids] == [None, None, None, "1", "1"]
    args = launch.parse_args(["-n", "1", "-s", "1", "--env-server", "OMP_NUM_THREADS:4",
                              "python", "t.py"])
    kids = launch.plan_children(args, "10.1.1.1", 1234, environ={"OMP_NUM_THREADS": "2"})
    assert [c.env["OMP_NUM_THREADS"] for c in kids] == ["2", "2", "4"]
    args = launch.parse_args(["-n", "1", "-s", "1", "python", "t.py"])     # the shell's wins
    kids = launch.plan_children(args, "10.1.1.1", 1234, environ={"OMP_NUM_THREADS": "2"})
    assert [c.env["OMP_NUM_THREADS"] for c in kids] == ["2", "2", "2"]


def test_help_documents_itself():
    """--help text (built in-process: each `python -m` start costs an mxnet import)."""
    from mxhylo import run
    text = launch.build_parser().format_help()
    assert "usage: python -m mxhylo.launch" in text
    for opt in ("--num-workers", "--num-servers", "--launcher", "--hostfile", "--timeout",
                "--grace", "--pid-file", "--env-worker", "DMLC_PS_ROOT_URI",
                "--no-relaunch", "start-up race"):
        assert opt in text
    text = run.build_parser().format_help()
    assert "usage: python -m mxhylo.run" in text and "--kvstore" in text
    assert "dist_sync_hylo" in text and "ImageRecordIter" in text


# ----------------------------------------------------------------------------- real jobs

# default run: the same job through the ssh launcher (test_ssh_launcher_end_to_end_...);
# dist_sync's workers bitwise equal under mxhylo.launch (test_dist.py's dist_sync run)
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dist_sync_digits_job_workers_agree(tmp_path):
    rc, out, secs = run_launcher(["-n", "2", "-s", "2", PY, DIGITS, "--kvstore", KV,
                                  "--steps", "5", "--out-dir", str(tmp_path)], tmp_path)
    assert rc == 0, out
    assert "[worker 0] " in out and "[worker 1] " in out and "job finished OK" in out
    p0, p1 = (np.load(tmp_path / ("params-rank%d.npz" % r)) for r in (0, 1))
    assert sorted(p0.files) == sorted(p1.files) and len(p0.files) >= 8
    for k in p0.files:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)


@pytest.mark.timeout(90)
def test_killed_worker_ends_job(tmp_path):
    """SIGKILL one of 2 training workers: the job ends non-zero within 60 s, naming it."""
    argv, pid_file = launcher(["-n", "2", "-s", "2", PY, DIGITS, "--kvstore", KV,
                               "--steps", "0", "--out-dir", str(tmp_path)], tmp_path, 120)
    job = subprocess.Popen(argv, cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: all((tmp_path / ("progress-rank%d" % r)).exists() for r in (0, 1)),
                 60, "both workers to train")
        with open(pid_file) as f:
            victim = [c for c in json.load(f)["children"] if c["name"] == "worker 1"][0]
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        out = job.communicate(timeout=60)[0].decode()
        elapsed = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        assert_all_gone(pid_file)
    assert job.returncode != 0
    assert elapsed < 60
    assert "job FAILED" in out
    assert "worker 1 (pid %d) was killed by signal SIGKILL" % victim["pid"] in out
    print("worker kill -> job ended in %.2f s" % elapsed)


def _digits_rec(path, n, idx=None):
    import mxnet as mx
    from mxhylo.data import load_digits
    x, y, _, _ = load_digits()
    w = mx.recordio.MXIndexedRecordIO(str(idx), str(path), "w") if idx else \
        mx.recordio.MXRecordIO(str(path), "w")
    for i in range(n):
        img = np.round(x[i, 0] * 255).astype(np.uint8)
        record = mx.recordio.pack_img(mx.recordio.IRHeader(0, float(y[i]), i, 0), img,
                                      img_fmt=".png")
        w.write_idx(i, record) if idx else w.write(record)
    w.close()


def _batch_order_rec(src, dst, parts, batch):
    """Write dst so that one reader with batch parts*batch sees, at step k, exactly the
    samples the ``parts`` workers see at their step k (read back through the iterator)."""
    import mxnet as mx
    per_part = []
    for part in range(parts):
        it = mx.io.ImageRecordIter(path_imgrec=str(src), data_shape=(1, 8, 8),
                                   batch_size=batch, shuffle=False, preprocess_threads=1,
                                   num_parts=parts, part_index=part)
        per_part.append([(b.data[0].asnumpy(), b.label[0].asnumpy(), b.pad) for b in it])
    counts = {len(p) for p in per_part}
    assert len(counts) == 1 and all(pad == 0 for p in per_part for _, _, pad in p), \
        "pick a record count the parts split into whole batches"
    w = mx.recordio.MXRecordIO(str(dst), "w")
    for k in range(counts.pop()):
        for part in per_part:
            data, label, _ = part[k]
            for img, lab in zip(data, label):
                w.write(mx.recordio.pack_img(mx.recordio.IRHeader(0, float(lab), 0, 0),
                                             img[0].astype(np.uint8), img_fmt=".png"))
    w.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kvstore", [
    # (dist_sync under mxhylo.run, in the default run: test_run_batch_schedule_...)
    pytest.param("dist_sync", marks=pytest.mark.slow), "dist_sync_hylo"])
def test_run_unmodified_script_equals_one_process_with_double_batch(tmp_path, kvstore):
    """2 workers x batch b under mxhylo.run == 1 process x batch 2b, plain SGD.

    (The stand-in's layers are all below hylo's size threshold: hylo's transport must
    then give MXNet's own result.)"""
    b = 32
    rec, ref_rec = tmp_path / "digits.rec", tmp_path / "digits-2b.rec"
    _digits_rec(rec, 256)
    _batch_order_rec(rec, ref_rec, 2, b)
    common = ["--optimizer", "sgd", "--momentum", "0", "--wd", "0", "--lr", "0.5"]
    (tmp_path / "dist").mkdir()
    (tmp_path / "single").mkdir()
    rc, out, secs = run_launcher(
        ["-n", "2", "-s", "1", PY, "-m", "mxhylo.run", "--kvstore", kvstore,
         "--shard-all-readers", STANDIN,      # its training reader is deterministic
         "--rec-train", str(rec), "--batch-size", str(b), "--save-dir",
         str(tmp_path / "dist")] + common, tmp_path)
    assert rc == 0, out
    assert out.count("epoch 0: 4 batches") == 2, out        # each worker read half
    single = subprocess.run(
        [PY, "-m", "mxhylo.run", STANDIN, "--rec-train", str(ref_rec), "--batch-size",
         str(2 * b), "--save-dir", str(tmp_path / "single")] + common,
        cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=60)
    assert single.returncode == 0, single.stdout.decode()
    dist = [np.load(p) for p in sorted((tmp_path / "dist").glob("*.npz"))]
    ref = np.load(next((tmp_path / "single").glob("*.npz")))
    assert len(dist) == 2
    for k in ref.files:
        np.testing.assert_array_equal(dist[0][k], dist[1][k], err_msg=k)
        np.testing.assert_allclose(dist[0][k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # Not vacuous: training moved the weights by far more than the tolerance.
    init = _standin_init()       # in collect_params order, as the script saved them
    moved = max(np.abs(ref[k] - v).max() for k, v in zip(ref.files, init))
    assert moved > 1e-2


def _epoch_losses(out, samples, workers):
    """Mean training loss per epoch over ``samples``, from the stand-in's 'loss summed'
    lines of ``workers`` processes (each its part of the samples; printed in any
    order within an epoch)."""
    sums = [float(x) for x in re.findall(r"loss summed ([0-9.]+)", out)]
    assert len(sums) % workers == 0, out
    return [sum(sums[i:i + workers]) / samples for i in range(0, len(sums), workers)]


# slow: the sharded reader is the test above's (exact, plain SGD), BatchNorm over the
# whole batch test_sync_batchnorm_dist.py's (exact, with --sync-batchnorm)
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_run_batchnorm_net_trains_like_one_process_with_double_batch(tmp_path):
    """2 workers x b under mxhylo.run against 1 process x 2b, on a net with BatchNorm
    (momentum SGD, the same samples in every update): each worker normalises over its
    b samples and keeps its own running statistics, so the weights differ, but every
    epoch's mean training loss stays within 10% (+0.01) of one process's. Measured:
    within 5%; a doubled or halved learning rate moves it by 25-60%, a reader that
    is not sharded (twice the updates per epoch) by more. (That every worker
    evaluates the whole validation set: the test below.)"""
    b, n_train = 32, 256
    rec, ref_rec = tmp_path / "digits.rec", tmp_path / "digits-2b.rec"
    _digits_rec(rec, n_train)
    _batch_order_rec(rec, ref_rec, 2, b)
    common = ["--optimizer", "sgd", "--momentum", "0.9", "--wd", "0", "--lr", "0.1",
              "--batchnorm", "--num-epochs", "8"]
    (tmp_path / "dist").mkdir()
    (tmp_path / "single").mkdir()
    rc, out, _ = run_launcher(
        ["-n", "2", "-s", "1", PY, "-m", "mxhylo.run", "--kvstore", "dist_sync",
         "--shard-all-readers", STANDIN,      # its training reader is deterministic
         "--rec-train", str(rec), "--batch-size", str(b),
         "--save-dir", str(tmp_path / "dist")] + common, tmp_path, timeout=100)
    assert rc == 0, out
    single = subprocess.run(
        [PY, "-m", "mxhylo.run", STANDIN, "--rec-train", str(ref_rec), "--batch-size",
         str(2 * b), "--save-dir", str(tmp_path / "single")] + common,
        cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=60).stdout.decode()
    dist, ref = _epoch_losses(out, n_train, 2), _epoch_losses(single, n_train, 1)
    assert len(dist) == len(ref) == 8
    for epoch, (d, r) in enumerate(zip(dist, ref)):
        assert abs(d - r) <= 0.1 * r + 0.01, (epoch, dist, ref)
    assert ref[-1] < 0.3 * ref[0]          # not vacuous: the loss fell


@pytest.mark.timeout(120)
def test_run_keeps_schedule_and_validation_of_unmodified_script(tmp_path):
    """mxhylo.run: the script's cosine schedule (sized from the sample count) ends where
    one process with batch 2b ends it, the training reader is sharded, the validation
    reader is read whole by each worker."""
    b, n_train, n_val = 32, 256, 96
    rec, val = tmp_path / "train.rec", tmp_path / "val.rec"
    _digits_rec(rec, n_train)
    _digits_rec(val, n_val)
    common = ["--rec-train", str(rec), "--rec-val", str(val), "--shuffle",
              "--lr-mode", "cosine", "--num-training-samples", str(n_train),
              "--num-epochs", "2", "--save-dir", str(tmp_path)]
    # dist_sync_hylo: the workers run the optimizer, so they can print its lr
    rc, out, _ = run_launcher(["-n", "2", "-s", "1", PY, "-m", "mxhylo.run", "--kvstore",
                               "dist_sync_hylo", STANDIN, "--batch-size", str(b)] + common,
                              tmp_path)
    assert rc == 0, out
    assert out.count("epoch 1: 4 batches") == 2, out          # each worker read half
    assert out.count("training reader, this worker reads part") == 2, out
    # each worker's augmenters get their own seed (MXNet seeds every process alike)
    assert "augmentation seed 0" in out and "augmentation seed 1" in out, out
    assert out.count("validation: %d samples" % n_val) == 2, out     # the whole set
    single = subprocess.run(
        [PY, "-m", "mxhylo.run", STANDIN, "--batch-size", str(2 * b)] + common,
        cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=60).stdout.decode()
    assert "final lr 0 after 8 updates" in single, single
    # Without pacing each worker would be half-way through the cosine (lr 0.05).
    assert out.count("final lr 0 after 8 updates") == 2, out


@pytest.mark.timeout(120)
def test_run_batch_schedule_grows_the_batch_of_an_unmodified_script(tmp_path):
    """mxhylo.run --batch-schedule 1: the script's Trainers take one update per
    micro-batch in epoch 0 and one per 2 in epoch 1 (the epoch's length from the
    training reader's .idx: 4 batches of each worker's half), and the cosine schedule,
    read at W times the micro-batches, still ends at 0 with the last epoch."""
    b, n_train = 32, 256
    rec, idx = tmp_path / "train.rec", tmp_path / "train.idx"
    _digits_rec(rec, n_train, idx=idx)
    rc, out, _ = run_launcher(
        ["-n", "2", "-s", "1", PY, "-m", "mxhylo.run", "--kvstore", "dist_sync",
         "--batch-schedule", "1", STANDIN, "--batch-size", str(b), "--rec-train",
         str(rec), "--rec-train-idx", str(idx), "--shuffle", "--lr-mode", "cosine",
         "--num-training-samples", str(n_train), "--num-epochs", "2", "--save-dir",
         str(tmp_path)], tmp_path)
    assert rc == 0, out
    assert out.count("epoch 1: 4 batches") == 2, out          # each worker read half
    assert out.count("final lr 0 after 6 updates") == 2, out  # 4 + 4 / 2
    dist = [np.load(p) for p in sorted(tmp_path.glob("params-*.npz"))]
    for k in dist[0].files:
        np.testing.assert_array_equal(dist[0][k], dist[1][k], err_msg=k)
    bad = subprocess.run([PY, "-m", "mxhylo.run", "--batch-schedule", "2,1", STANDIN],
                         cwd=str(tmp_path), env=clean_env(), stderr=subprocess.PIPE,
                         timeout=60)
    assert bad.returncode == 2 and b"expected increasing epochs" in bad.stderr


def test_run_patch_helpers():
    """Which readers mxhylo.run shards; the paced schedule reads, delegates, pickles."""
    import pickle
    import mxnet as mx
    from mxhylo.paced_schedule import WorkerPacedSchedule, pace_schedule
    from mxhylo.run import is_training_reader
    assert is_training_reader({"shuffle": True})
    assert is_training_reader({"rand_mirror": True, "shuffle": False})
    assert is_training_reader({"max_random_area": 1, "min_random_area": 0.08,
                               "random_resized_crop": True})
    assert is_training_reader({"max_random_area": 0.5})
    assert not is_training_reader({"shuffle": False, "resize": 36, "max_random_area": 1})
    assert not is_training_reader({})
    inner = mx.lr_scheduler.PolyScheduler(max_update=20, base_lr=1.0, pwr=1)
    paced = WorkerPacedSchedule(inner, 4)
    assert abs(paced(3) - 0.4) < 1e-12                  # read at update 12 of 20
    assert paced.max_update == 20                       # attributes are the schedule's
    paced.final_lr = 0.1
    assert inner.final_lr == 0.1
    back = pickle.loads(pickle.dumps(paced, 0))     # as MXNet sends it to the servers
    assert type(back) is WorkerPacedSchedule and back.num_workers == 4
    assert type(back.schedule) is mx.lr_scheduler.PolyScheduler and back.final_lr == 0.1
    opt = mx.optimizer.SGD(learning_rate=1.0, lr_scheduler=mx.lr_scheduler.FactorScheduler(
        step=10, factor=0.5))

    class T:
        _optimizer = opt
    pace_schedule(T, 2)
    pace_schedule(T, 2)                 # again (after load_states): not paced twice
    assert isinstance(opt.lr_scheduler, WorkerPacedSchedule)
    assert not isinstance(opt.lr_scheduler.schedule, WorkerPacedSchedule)
    assert opt.lr_scheduler(6) == 0.5


def _standin_init():
    """The stand-in's initial parameters (same seed, same net)."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    np.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 1, 8, 8)))
    return [v.data().asnumpy() for v in net.collect_params().values()]


# ----------------------------------------------------------------------------- failures

@pytest.mark.timeout(60)
def test_server_that_cannot_import_mxhylo_ends_job(tmp_path):
    """A broken environment on the servers (a shadowing mxhylo that fails to import)."""
    broken = tmp_path / "broken" / "mxhylo"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ImportError('simulated broken environment on this host')\n")
    rc, out, secs = run_launcher(
        ["-n", "1", "-s", "1", "--env-server", "PYTHONPATH:%s" % broken.parent,
         PY, "-m", "mxhylo.run", "--kvstore", KV, DIGITS, "--out-dir", str(tmp_path)],
        tmp_path, timeout=40)
    assert rc != 0 and secs < 30, out
    assert "server 0 (pid" in out and "exited with code 1 while workers were still " \
        "running" in out, out
    assert "simulated broken environment" in out


@pytest.mark.timeout(60)
def test_unreachable_scheduler_bounded_by_run_watchdog(tmp_path):
    """Workers pointed at a port nobody listens on: ps-lite would wait forever; the
    mxhylo.run connect watchdog ends the worker (exit 3), the launcher the job."""
    dead_port = procs.free_port()
    rc, out, secs = run_launcher(
        ["-n", "1", "-s", "1", "--env-worker", "DMLC_PS_ROOT_PORT:%d" % dead_port,
         PY, "-m", "mxhylo.run", "--kvstore", KV, "--connect-timeout", "4", DIGITS,
         "--out-dir", str(tmp_path)], tmp_path, timeout=40)
    assert rc != 0 and secs < 30, out
    assert "worker 0 (pid" in out and "exited with code 3" in out, out
    assert "could not join the parameter-server job within 4 s" in out
    assert "DMLC_PS_ROOT_PORT=%d" % dead_port in out


@pytest.mark.timeout(60)
def test_unreachable_scheduler_bounded_by_launcher_timeout(tmp_path):
    """Without mxhylo.run nothing in the workers gives up: --timeout ends the job."""
    dead_port = procs.free_port()
    rc, out, secs = run_launcher(
        ["-n", "1", "-s", "1", "--env-worker", "DMLC_PS_ROOT_PORT:%d" % dead_port,
         PY, DIGITS, "--out-dir", str(tmp_path)], tmp_path, timeout=6)
    assert rc == launch.EXIT_TIMEOUT and secs < 20, out
    assert "ran past --timeout 6 s (still running: scheduler, worker 0, server 0)" in out


@pytest.mark.timeout(60)
def test_script_error_on_one_worker_ends_job(tmp_path):
    """A worker's script raising mid-training: mxhylo.run exits at once (without it,
    ps-lite's exit-time finalize would wait forever for the other worker)."""
    rc, out, secs = run_launcher(
        ["-n", "2", "-s", "1", PY, "-m", "mxhylo.run", "--kvstore", KV, DIGITS,
         "--steps", "0", "--out-dir", str(tmp_path), "--fail-rank", "1"],
        tmp_path, timeout=40)
    assert rc != 0 and secs < 30, out
    assert "RuntimeError: injected failure on rank 1" in out
    assert "exited with code 1" in out and "job FAILED" in out


@pytest.mark.timeout(60)
def test_workers_with_different_models_surface_server_error(tmp_path):
    """Different models on two workers: MXNet's ps-lite aborts a process on the shape
    mismatch, and the launcher names it and shows its last words."""
    rc, out, secs = run_launcher(
        ["-n", "2", "-s", "1", PY, DIGITS, "--kvstore", KV, "--out-dir", str(tmp_path),
         "--mismatch"], tmp_path, timeout=40)
    assert rc != 0 and secs < 30, out
    # Whichever notices first aborts: the server summing pushes of different shapes,
    # or a worker pulling a value of another size than it pushed.
    assert "was killed by signal SIGABRT" in out, out
    assert "shape mismatch" in out or "vals->size() == total_val" in out, out


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_stops_everything(tmp_path):
    argv, pid_file = launcher(["-n", "1", "-s", "1", PY, DIGITS, "--kvstore", KV,
                               "--steps", "0", "--out-dir", str(tmp_path)], tmp_path, 60)
    job = subprocess.Popen(argv, cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (tmp_path / "progress-rank0").exists(), 40, "the worker to train")
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=20)[0].decode()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        assert_all_gone(pid_file)
    assert job.returncode == 128 + signal.SIGTERM
    assert "the launcher received SIGTERM" in out


def test_ssh_launcher_end_to_end_with_stand_in_ssh(tmp_path):
    """The ssh path (hostfile, remote command, teardown through stdin) with an 'ssh'
    that runs the remote text with a local bash (there is no sshd here)."""
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text("#!/bin/bash\n# fake ssh: -o OPT -p PORT HOST CMD\n"
                        "exec bash -c \"${@: -1}\"\n")
    fake_ssh.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\nlocalhost:2200\n")
    rc, out, secs = run_launcher(
        ["-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hostfile), "--ssh",
         str(fake_ssh), PY, DIGITS, "--kvstore", KV, "--steps", "3", "--out-dir",
         str(tmp_path)], tmp_path, timeout=60)
    assert rc == 0, out
    assert (tmp_path / "params-rank0.npz").exists() and (tmp_path / "params-rank1.npz").exists()


# ----------------------------------------------------------------------------- start-up race

FAKE_RACE = os.path.join(REPO, "tests", "distributed", "jobs", "fake_race.py")
SERVER_RACE = 'server 0: "Check failed: !stored.is_none(): init 5 first"'
WORKER_RACE = 'worker 0: "Check failed: msg.data.size() >= (size_t)2 (0 vs. 2)"'


def _launched_pids(out):
    """Every pid of every attempt, from the launcher's "[launch] started ..." lines."""
    lines = [l for l in out.splitlines() if l.startswith("[launch] started ")]
    return [int(p) for l in lines for p in re.findall(r" pid (\d+)", l)]


def _fake_job(tmp_path, args=(), grace=3, **fake_env):
    """Run the launcher on tests/distributed/jobs/fake_race.py (2 workers, 2 servers).

    Returns (rc, output, attempts, abort walltimes, launcher end walltime); attempts:
    the scheduler ports, one per attempt. Asserts that no process of any attempt is
    left when the launcher has returned.
    """
    log = tmp_path / "fake.log"
    argv, _ = launcher(list(args) + ["-n", "2", "-s", "2", PY, FAKE_RACE], tmp_path,
                       timeout=20, grace=grace)
    proc = subprocess.run(argv, cwd=str(tmp_path), env=clean_env(FAKE_LOG=str(log), **fake_env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    ended = time.time()
    out = proc.stdout.decode("utf-8", "replace")
    pids = _launched_pids(out)
    left = [p for p in pids if procs.pid_alive(p) or procs.group_members(p)]
    assert_pids_gone(pids)          # (kills what is left)
    assert pids and not left, "processes left when the launcher returned: %s" % left
    ports, aborts = [], []
    for line in log.read_text().splitlines():
        kind, value, _ = line.split()
        if kind == "start" and value not in ports:
            ports.append(value)
        elif kind == "abort":
            aborts.append(float(value))
    return proc.returncode, out, ports, aborts, ended


def _last_line(out):
    return out.strip().splitlines()[-1]


def test_startup_race_helpers():
    """Which failures are the start-up race, and what the final line quotes."""
    def child(role, name, rc, *lines):
        c = procs.Child(name, role, ["true"], {})
        c.returncode, c.exited_at = rc, 0.0
        for line in lines:
            c.note_output(line)
        return c
    glog = "[16:28:21] ../src/kvstore/kvstore_dist_server.h:611: Check failed: "
    server = child("server", "server 1", -6, "x", glog + "!stored.is_none(): init 5 first",
                   "Stack trace:", *["  [bt] (%d)" % i for i in range(30)], "")
    assert launch.startup_race(server) == \
        'server 1: "Check failed: !stored.is_none(): init 5 first"'
    assert launch.last_words(server) == '"Check failed: !stored.is_none(): init 5 first"'
    kv_app = "kv_app.h:624: Check failed: msg.data.size() >= (size_t)2 (0 vs. 2)"
    assert launch.startup_race(child("server", "server 0", -6, "Check failed: "
                                     "!stored.is_none() init 12 first"))   # no ': '
    assert launch.startup_race(child("worker", "worker 3", 134, kv_app)) == \
        'worker 3: "Check failed: msg.data.size() >= (size_t)2 (0 vs. 2)"'
    # the check of the other role, another check, a clean exit, no check: not the race
    assert launch.startup_race(child("worker", "worker 0", -6, glog + "!stored.is_none(): "
                                     "init 5 first")) is None
    assert launch.startup_race(child("server", "server 0", -6, glog + "shape mismatch")) is None
    assert launch.startup_race(child("worker", "worker 0", 0, kv_app)) is None
    plain = child("server", "server 0", 1, "Traceback ...", "ImportError: broken", "  ")
    assert launch.startup_race(plain) is None
    assert launch.last_words(plain) == '"ImportError: broken"'
    assert launch.last_words(child("server", "server 0", -9)) is None


@pytest.mark.timeout(30)
def test_startup_race_relaunches_the_job(tmp_path):
    """The race on the first attempt: one line says so, the second attempt succeeds
    on a fresh scheduler port. (A worker's race check: test_startup_race_helpers.)"""
    rc, out, ports, aborts, _ = _fake_job(tmp_path)
    assert rc == 0, out
    relaunches = [l for l in out.splitlines() if "relaunching" in l]
    assert relaunches == ["[launch] MXNet's start-up race (%s): nothing had trained yet; "
                          "relaunching (attempt 2 of 3)" % SERVER_RACE], out
    assert len(ports) == 2 and len(aborts) == 1, out
    assert "job finished OK" in _last_line(out)


@pytest.mark.timeout(30)
def test_startup_race_every_time_gives_up_after_three_attempts(tmp_path):
    rc, out, ports, aborts, _ = _fake_job(tmp_path, FAKE_FAIL_ATTEMPTS="99")
    assert rc == launch.EXIT_FAILED, out
    assert len(ports) == 3 and len(aborts) == 3, out
    relaunches = [l for l in out.splitlines() if "relaunching" in l]
    assert [l[-len("(attempt 2 of 3)"):] for l in relaunches] == [
        "(attempt 2 of 3)", "(attempt 3 of 3)"], out
    last = _last_line(out)
    server0 = _launched_pids(out)[-2]      # started: scheduler, workers, then servers
    assert last.startswith("[launch] job FAILED"), out
    assert "server 0 (pid %d) was killed by signal SIGABRT" % server0 in last, last
    assert '"Check failed: !stored.is_none(): init 5 first"' in last, last


@pytest.mark.timeout(30)
def test_no_relaunch_ends_the_job_on_the_race(tmp_path):
    """--no-relaunch: the race (here a worker's check) ends the job like any failure;
    the final line names the worker and quotes its check, as it would a server's."""
    rc, out, ports, aborts, _ = _fake_job(tmp_path, ["--no-relaunch"], FAKE_FAILER="worker")
    assert rc == launch.EXIT_FAILED, out
    assert len(ports) == 1 and "relaunching" not in out, out
    name, check = WORKER_RACE.split(": ", 1)
    last = _last_line(out)
    assert last.startswith("[launch] job FAILED") and name + " (pid " in last, last
    assert last.endswith(": %s (MXNet's start-up race)" % check), last


@pytest.mark.timeout(30)
def test_server_abort_on_other_check_ends_job_within_5s(tmp_path):
    """A server aborts on another check while workers (ignoring SIGTERM) wait: no
    relaunch; with the default --grace the job still ends within 5 s of the abort, no
    process is left, and the last line names the server and its check message."""
    rc, out, ports, aborts, ended = _fake_job(
        tmp_path, grace=None, FAKE_CHECK="something else", FAKE_IGNORE_TERM="1")
    assert rc == launch.EXIT_FAILED, out
    assert len(ports) == 1 and len(aborts) == 1 and "relaunching" not in out, out
    last = _last_line(out)
    assert last.startswith("[launch] job FAILED") and "server 0 (pid " in last, last
    assert last.endswith('while workers were still running: "Check failed: something '
                         'else"'), last
    # The workers ignored SIGTERM: teardown cut --grace short to keep the 5 s bound.
    graces = re.findall(r"did not stop within (\d+) s of SIGTERM", out)
    assert graces and all(int(g) < launch.DEAD_PEER_END_S for g in graces), out
    after_abort = ended - aborts[0]
    print("server abort -> launcher returned in %.2f s" % after_abort)
    assert after_abort < 15, out
