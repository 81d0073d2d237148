"""Security and trust: where a job's processes listen, and what a server does with a
push that does not fit its key's layout.

* ``mxhylo.launch`` binds every process to one interface (--interface, else the one
  that reaches the scheduler: loopback for a local job); a job started with
  ``--interface lo`` listens on 127.0.0.1 only, read from /proc while it runs.
* A malformed push (wrong shape, a key without a layout, a worker's slot cut short or
  out of place, NaN where a codec never sends one, an unknown codec in the layout
  table, a layout of another job) ends the server with a message that names the key
  and, where the layout tells it, the worker. In-process against the server's
  aggregate path (its ``_fatal`` raises here instead of ending the process), and once
  over a real parameter-server job.

Every job gets a free scheduler port (the launcher picks one), a --timeout and a
--pid-file; afterwards only the pids the launcher started are checked, and killed if
one is left.
"""
import dataclasses
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest

from mxhylo import launch, procs
from proc_helpers import clean_env, end_groups, launched_pids
from mxhylo.kvstore import server as server_mod
from mxhylo.kvstore.server import ServerDecoder, ServerState
from mxhylo.kvstore.wire import ChunkLayout, plan_chunks, row_sparse_push, rows_from_zero
from mxhylo.ops.formats import pack_bytes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(REPO, "tests", "distributed", "jobs")
PY = sys.executable
W = 2           # workers of every in-process server below


# ----------------------------------------------------------------------------- helpers: jobs


def _start_job(args, tmp_path, timeout):
    """Start ``python -m mxhylo.launch`` with a pid file, --timeout ``timeout`` seconds
    and a 3 s grace; returns (Popen, pid file path)."""
    pid_file = tmp_path / "pids.json"
    argv = [PY, "-m", "mxhylo.launch", "--pid-file", str(pid_file), "--timeout",
            str(timeout), "--grace", "3"] + list(args)
    # not the repository as cwd: the installed mxhylo is the one every role imports
    job = subprocess.Popen(argv, cwd=str(tmp_path), env=clean_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return job, pid_file


def _end_job(job, pid_file):
    """Stop what is left of a job: the launcher, then the process groups it started
    (by their ids); fail if any of them had to be killed after the launcher returned."""
    if job.poll() is None:
        job.kill()
        job.wait()
    left = end_groups(launched_pids(pid_file)) if os.path.exists(pid_file) else []
    assert not left, "the launcher left processes running: %s" % left


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out after %g s waiting for %s" % (timeout, what))


# ----------------------------------------------------------------------------- helpers: sockets

def _proc_address(text):
    """/proc/net/tcp{,6}'s 'HEX:PORT' -> (address text, port)."""
    hexaddr, hexport = text.split(":")
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(hexport, 16)
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(hexport, 16)


def _listening_sockets(pids):
    """[(pid, address, port)] of every TCP socket in state LISTEN (IPv4 and IPv6) that
    a process of ``pids``' process groups holds open."""
    listen = {}         # socket inode -> (address, port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A":           # TCP_LISTEN
                    listen[fields[9]] = _proc_address(fields[1])
    found = []
    members = sorted({m for p in pids for m in [p] + procs.group_members(p)})
    for pid in members:
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listen:
                found.append((pid,) + listen[target[8:-1]])
    return sorted(set(found))


def _ss_lines(pids):
    """`ss -ltnp` lines of these pids, for the record (empty without ss)."""
    if shutil.which("ss") is None:
        return []
    out = subprocess.run(["ss", "-ltnp"], stdout=subprocess.PIPE, text=True,
                         timeout=10).stdout
    return [l for l in out.splitlines() if any("pid=%d," % p in l for p in pids)]


# ----------------------------------------------------------------------------- binding

def _plan(argv, environ=None):
    """{child name: its DMLC_* variables} of a launch command line, as --dry-run shows."""
    environ = {} if environ is None else environ
    args = launch.parse_args(argv)
    binding = launch.job_binding(args, environ)
    kids = launch.plan_children(args, binding.scheduler_uri, 1234, environ=environ,
                                binding=binding)
    return {c.name: {k: v for k, v in getattr(c, "remote_env", c.env).items()
                     if k.startswith("DMLC_")} for c in kids}


def test_interface_lo_binds_every_role_in_the_dry_run(capsys):
    """--dry-run --interface lo: every role, scheduler included, gets DMLC_INTERFACE=lo
    and DMLC_NODE_HOST=127.0.0.1, and finds the scheduler at 127.0.0.1."""
    assert launch.main(["-n", "2", "-s", "1", "--interface", "lo", "--dry-run",
                        "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    envs = {lines[i].split(":")[0]: json.loads(lines[i + 1]) for i in range(0, len(lines), 2)}
    assert sorted(envs) == ["scheduler", "server 0", "worker 0", "worker 1"]
    for name, env in envs.items():
        assert env["DMLC_INTERFACE"] == "lo", name
        assert env["DMLC_NODE_HOST"] == "127.0.0.1", name
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1", name


def test_default_binding_is_the_address_that_reaches_the_scheduler(tmp_path, monkeypatch):
    """No --interface: a local job on loopback; DMLC_INTERFACE of the shell counts as
    --interface; an ssh job's scheduler on the address that reaches the hostfile's
    hosts, each remote process on its hostfile address (or, with --interface, on its
    own interface of that name); hosts reached from two addresses are an error."""
    for env in _plan(["-n", "2", "-s", "1", "python", "t.py"]).values():
        assert (env["DMLC_PS_ROOT_URI"], env["DMLC_NODE_HOST"], env["DMLC_INTERFACE"]) \
            == ("127.0.0.1", "127.0.0.1", "lo")
    for env in _plan(["-n", "1", "python", "t.py"], {"DMLC_INTERFACE": "lo"}).values():
        assert (env["DMLC_NODE_HOST"], env["DMLC_INTERFACE"]) == ("127.0.0.1", "lo")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\nlocalhost:2200\n")
    envs = _plan(["-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hosts), "python",
                  "t.py"])
    assert envs["scheduler"]["DMLC_NODE_HOST"] == "127.0.0.1"
    for name, env in envs.items():
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_NODE_HOST"] == \
            "127.0.0.1", name
    envs = _plan(["-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hosts),
                  "--interface", "lo", "python", "t.py"])
    for name, env in envs.items():
        assert env["DMLC_INTERFACE"] == "lo", name
        if name != "scheduler":     # ps-lite reads the interface's address on its host
            assert "DMLC_NODE_HOST" not in env, name
    # two hosts the kernel reaches from two different addresses of this host
    monkeypatch.setattr(launch, "source_address",
                        lambda a: {"10.0.0.1": "10.0.0.9", "10.1.0.1": "10.1.0.9"}[a])
    hosts.write_text("10.0.0.1\n10.1.0.1\n")
    with pytest.raises(launch.BindError, match=r"10\.0\.0\.1 from 10\.0\.0\.9; 10\.1\.0\.1 "
                                               r"from 10\.1\.0\.9.*--interface NAME"):
        _plan(["-n", "2", "--launcher", "ssh", "-H", str(hosts), "python", "t.py"])
    # the launcher's own address rule is not all interfaces, whatever the options
    for env in _plan(["-n", "1", "--host-ip", "127.0.0.1", "python", "t.py"]).values():
        assert env["DMLC_NODE_HOST"] == "127.0.0.1"


def test_bogus_interface_is_a_clear_error_before_anything_starts(tmp_path):
    """An interface that does not exist (or has no IPv4 address): exit 2, the message
    names it and lists this host's interfaces, and nothing was started."""
    missing = "nosuchif0"
    assert missing not in [n for _, n in socket.if_nameindex()]
    marker = tmp_path / "started"
    proc = subprocess.run(
        [PY, "-m", "mxhylo.launch", "-n", "1", "-s", "1", "--interface", missing,
         "--timeout", "20", "touch", str(marker)],
        cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert "--interface %s: this host has no interface of that name" % missing in last
    assert "this host's interfaces: lo (127.0.0.1)" in last
    assert not marker.exists() and "started" not in proc.stdout
    # an interface without an IPv4 address, when this host has one (e.g. an ifb)
    bare = [n for n, a in launch.interfaces() if a is None]
    if bare:
        with pytest.raises(launch.BindError, match="--interface %s: the interface has no "
                                                   "IPv4 address" % bare[0]):
            launch.interface_address(bare[0])
    # --host-ip must agree with the interface: the scheduler listens on its address
    args = launch.parse_args(["-n", "1", "--interface", "lo", "--host-ip", "10.9.9.9",
                              "python", "t.py"])
    with pytest.raises(launch.BindError, match="--host-ip 10.9.9.9 is not the address of "
                                               "--interface lo, 127.0.0.1"):
        launch.job_binding(args, {})


def test_help_documents_interface():
    text = " ".join(launch.build_parser().format_help().split())     # (argparse wraps)
    for words in ("--interface NAME", "DMLC_INTERFACE", "DMLC_NODE_HOST", "Never all",
                  "trusted network", "127.0.0.1 for a local job"):
        assert words in text, words


@pytest.mark.timeout(120)
def test_job_with_interface_lo_listens_on_loopback_only(tmp_path):
    """A real job (an mxhylo store: 'rows', 'slots' and dense keys through the servers'
    checks) started with --interface lo: while every process runs, each of its
    listening sockets is on 127.0.0.1, and each process has one."""
    job, pid_file = _start_job(
        ["-n", "2", "-s", "1", "--interface", "lo", PY,
         os.path.join(SCRIPTS, "kv_job.py"), str(tmp_path)], tmp_path, timeout=80)
    try:
        _wait_for(lambda: all((tmp_path / ("ready-%d" % r)).exists() for r in range(2))
                  or job.poll() is not None, 90, "both workers to exchange")
        assert job.poll() is None, job.communicate()[0].decode()
        pids = launched_pids(pid_file)
        sockets = _listening_sockets(pids)
        print("\n".join(["listening sockets of the job's processes (ss -ltnp):"]
                        + _ss_lines(pids)))
        (tmp_path / "release").write_text("")
        out = job.communicate(timeout=60)[0].decode("utf-8", "replace")
    finally:
        _end_job(job, pid_file)
    assert job.returncode == 0, out
    assert "listening on 127.0.0.1 (lo)" in out
    assert {p for p, _, _ in sockets} == set(pids), (sockets, pids)
    assert all(addr == "127.0.0.1" for _, addr, _ in sockets), sockets
    # the servers decoded what they were meant to (the checks let good pushes through)
    assert "layer conv0_weight codec conv_topk keys rows/" in out, out
    assert "layer fc0_weight codec fc_2bit keys slots/" in out, out


# ----------------------------------------------------------------------------- the server

class ServerEnded(BaseException):
    """What the server's _fatal raises here (a BaseException: no `except Exception` on
    the way swallows it), instead of ending this process."""


def _raise(message):
    raise ServerEnded(message)


@pytest.fixture
def server(monkeypatch):
    """A fresh ServerState as this process's server (of a job of W workers, 1 server),
    whose fatal errors raise ServerEnded."""
    monkeypatch.setenv("DMLC_NUM_WORKER", str(W))
    monkeypatch.setenv("DMLC_NUM_SERVER", "1")
    state = ServerState()
    monkeypatch.setattr(server_mod, "_SERVER", state)
    monkeypatch.setattr(server_mod, "_fatal", _raise)
    return state


def _ended(server, key, stored, received):
    """The message the server ends with on this push (fails if it takes it)."""
    with pytest.raises(ServerEnded) as err:
        server.aggregate_into(key, stored, received)
    return str(err.value)


def _sum(pushes):
    """What a server's updater gets: the workers' row_sparse pushes summed."""
    total = pushes[0]
    for p in pushes[1:]:
        total = mx.nd.sparse.elemwise_add(total, p)
    return total


def _slots_layout(codec, size, pull="none"):
    """The first chunk of a layer of ``size`` elements under ``codec``, W workers."""
    layout = plan_chunks(codec, (size,), W, 1, pull=pull)[0]
    assert layout.kind == "slots"
    return layout


def _payload_bytes(layout, rng):
    """Random payload bytes of ``layout``'s codec that decode to finite values: 2-bit
    codes of any bits, or float16 values in [-1, 1)."""
    codec = server_mod._SERVER.codecs[layout.codec]
    nbytes = codec.byte_span(0, layout.size)[1]
    if layout.codec == "fp16":
        return rng.uniform(-1, 1, nbytes // 2).astype(np.float16).view(np.uint8)
    if layout.codec == "shared_2bit":
        return np.zeros(nbytes, np.uint8)       # (codes of 0: the sums stay in range)
    return rng.randint(0, 256, nbytes).astype(np.uint8)


def _slot_values(layout, data, scalars):
    """A slot's float32 values (slot_rows * cols) as push_slot writes them."""
    packed = pack_bytes(data)
    values = np.zeros(layout.slot_rows * layout.cols, np.float32)
    values[:len(scalars)] = scalars
    values[len(scalars):len(scalars) + len(packed)] = packed
    return values


def _slot_push(layout, rank, values, rows=None):
    """Worker ``rank``'s push of slot ``values`` (float32, whole rows) into ``rows``
    (default: its own slot's)."""
    if rows is None:
        rows = rank * layout.slot_rows + np.arange(len(values) // layout.cols)
    return row_sparse_push(layout, values, np.asarray(rows, np.int64))[0]


def _good_slots(layout, rng, scalars=(0.5,)):
    """Every worker's well-formed slot values, by rank."""
    n = server_mod._SERVER.codecs[layout.codec].scalars
    return [_slot_values(layout, _payload_bytes(layout, rng), scalars[:n]) for _ in range(W)]


def _stored(layout):
    return rows_from_zero(layout, mx.nd.zeros(layout.key_shape))


@pytest.mark.parametrize("codec,pull", [("fc_2bit", "none"), ("fc_2bit", "gather"),
                                        ("fp16", "none"), ("fp16", "gather"),
                                        ("shared_2bit", "gather")])
def test_well_formed_pushes_of_real_layouts_pass(server, codec, pull):
    """The checks let every planned layout and its well-formed pushes through, and a
    'none' pull's aggregate is the sum of the workers' decodes."""
    rng = np.random.RandomState(0)
    layout = _slots_layout(codec, 40000, pull)
    if codec == "shared_2bit":
        assert layout.pull == "sum"
    server.merge_layouts({3: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng, (0.25, 7.0, 0.3))
    stored = _stored(layout)
    server.aggregate_into(3, stored, _sum([_slot_push(layout, w, slots[w]) for w in range(W)]))
    if layout.pull == "none":
        want = sum(server_mod._decoded(layout, s).asnumpy() for s in slots)
        got = stored.tostype("default").asnumpy().reshape(-1)[:layout.size]
        np.testing.assert_array_equal(got, want)
    rows = plan_chunks("conv_topk", (64, 8, 3, 3), W, 1, pull="gather", push_k=4)[0]
    server.merge_layouts({4: ("conv", rows)}, "test")
    push = row_sparse_push(rows, rng.normal(size=(3, rows.cols)).astype(np.float32),
                           np.array([1, 5, 9]))[0]
    server.aggregate_into(4, _stored(rows), push)


def test_push_to_a_key_without_layout_names_key_and_workers(server):
    msg = _ended(server, 99, mx.nd.zeros((4,)), mx.nd.ones((4,)))
    assert "parameter-server key 99, for which this server has no layout" in msg
    assert "a key of another job or model" in msg
    assert "sum of the workers' pushes of the key (it waits for 2, one a worker)" in msg
    assert "cannot tell which worker sent it" in msg


def test_wrong_length_and_wrong_storage_name_the_key(server):
    server.merge_layouts({5: ("fc_bias", ChunkLayout("dense", 0, 8, 8))}, "test")
    msg = _ended(server, 5, mx.nd.zeros((8,)), mx.nd.ones((6,)))
    assert "malformed push to parameter-server key 5 (fc_bias: a 'dense' key)" in msg
    assert "the push has shape (6,), the layout's is (8,): a key of another job" in msg
    assert "cannot tell which worker" in msg
    msg = _ended(server, 5, mx.nd.zeros((5,)), mx.nd.ones((8,)))
    assert "the key's stored value has shape (5,), the layout's is (8,)" in msg
    layout = _slots_layout("fc_2bit", 4096)
    server.merge_layouts({6: ("fc", layout)}, "test")
    msg = _ended(server, 6, _stored(layout), mx.nd.ones(layout.key_shape))
    assert "key 6 (fc: a 'slots' key of fc_2bit, pull 'none')" in msg
    assert "a default push to a row_sparse key" in msg


@pytest.mark.parametrize("pull", ["none", "gather"])
def test_slot_cut_short_or_misplaced_names_the_worker(server, pull):
    """Rank 1 pushes only the first row of its slot; rank 0 writes into rank 1's slot
    and leaves its own empty; a push lands past every slot."""
    rng = np.random.RandomState(1)
    layout = _slots_layout("fp16", 2048, pull)     # 2 rows a slot
    assert layout.slot_rows == 2
    server.merge_layouts({7: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng)
    short = _sum([_slot_push(layout, 0, slots[0]),
                  _slot_push(layout, 1, slots[1][:layout.cols])])
    msg = _ended(server, 7, _stored(layout), short)
    assert "malformed push to parameter-server key 7 (fc: a 'slots' key of fp16, pull " \
        "%r)" % layout.pull in msg
    assert "worker rank 1's slot (rows 2-3 of the key) came with 1 of its 2 rows" in msg
    misplaced = _sum([_slot_push(layout, 0, slots[0], rows=[2, 3]),
                      _slot_push(layout, 1, slots[1])])
    msg = _ended(server, 7, _stored(layout), misplaced)
    assert "worker rank 0's slot (rows 0-1 of the key) came with 0 of its 2 rows" in msg


def test_rows_outside_every_slot_and_padding(server):
    """A push past the workers' slots (into the key's dense rows) and a slot longer
    than its payload (a layout of another size)."""
    rng = np.random.RandomState(2)
    layout = _slots_layout("fc_2bit", 4096)      # 1 row a slot, 4 rows in the key
    assert layout.rows > W * layout.slot_rows
    server.merge_layouts({8: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng)
    extra = _sum([_slot_push(layout, 0, slots[0]), _slot_push(layout, 1, slots[1]),
                  _slot_push(layout, 1, slots[1], rows=[3])])
    msg = _ended(server, 8, _stored(layout), extra)
    assert "rows 3 pushed, outside the 2 workers' slots (rows 0-1)" in msg
    assert "cannot tell which worker" in msg
    long = slots[0].copy()
    long[-1] = 1.5
    msg = _ended(server, 8, _stored(layout),
                 _sum([_slot_push(layout, 0, long), _slot_push(layout, 1, slots[1])]))
    assert "worker rank 0's slot holds more than a payload of 4096 elements of fc_2bit" in msg


@pytest.mark.parametrize("pull", ["none", "gather"])
def test_non_finite_header_names_the_worker(server, pull):
    rng = np.random.RandomState(3)
    layout = _slots_layout("fc_2bit", 40000, pull)
    server.merge_layouts({9: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng)
    slots[1][0] = np.nan
    msg = _ended(server, 9, _stored(layout),
                 _sum([_slot_push(layout, w, slots[w]) for w in range(W)]))
    assert "worker rank 1's payload header [nan] is not finite, which fc_2bit never " \
        "sends" in msg


def test_altered_or_nan_payload_names_the_worker(server):
    """Bytes that pack_bytes never writes (a zero value), and float16 NaN values (the
    fp16 codec refuses to encode a non-finite gradient)."""
    rng = np.random.RandomState(4)
    layout = _slots_layout("fc_2bit", 4096)
    server.merge_layouts({10: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng)
    slots[1][5] = 0.0
    msg = _ended(server, 10, _stored(layout),
                 _sum([_slot_push(layout, w, slots[w]) for w in range(W)]))
    assert "worker rank 1's payload does not decode: a slot payload value is not one " \
        "pack_bytes writes" in msg
    fp16 = _slots_layout("fp16", 2048)
    server.merge_layouts({11: ("fc", fp16)}, "test")
    data = [_payload_bytes(fp16, rng) for _ in range(W)]
    data[0] = data[0].copy()
    data[0].view(np.float16)[17] = np.nan
    slots = [_slot_values(fp16, d, ()) for d in data]
    msg = _ended(server, 11, _stored(fp16),
                 _sum([_slot_push(fp16, w, slots[w]) for w in range(W)]))
    assert "the payload of worker rank(s) 0 decodes to NaN or Inf, which fp16 never " \
        "sends" in msg


def test_shared_scale_sum_names_the_workers(server):
    """A 'sum' pull: workers of different shared values, and bytes altered on the way."""
    rng = np.random.RandomState(5)
    layout = _slots_layout("shared_2bit", 40000, "gather")
    assert layout.pull == "sum"
    server.merge_layouts({12: ("fc", layout)}, "test")
    slots = _good_slots(layout, rng, (0.25, 3.0, 0.3))
    slots[1][0] = 0.5
    msg = _ended(server, 12, _stored(layout),
                 _sum([_slot_push(layout, w, slots[w]) for w in range(W)]))
    assert "the workers' shared values differ (rank 0: 0.25, rank 1: 0.5)" in msg
    slots[1][0] = 0.25
    slots[1][7] = 0.0
    msg = _ended(server, 12, _stored(layout),
                 _sum([_slot_push(layout, w, slots[w]) for w in range(W)]))
    assert "worker rank 1's payload: a slot payload value is not one pack_bytes" in msg


@pytest.mark.parametrize("pull", ["none", "gather"])
def test_rows_outside_the_key_or_non_finite(server, pull):
    """conv_topk's 'rows' key: the server sees only the sum, so it says so."""
    layout = plan_chunks("conv_topk", (64, 8, 3, 3), W, 1, pull=pull, push_k=4)[0]
    server.merge_layouts({13: ("conv", layout)}, "test")
    values = np.ones((2, layout.cols), np.float32)
    push = row_sparse_push(layout, values, np.array([3, layout.rows + 2]))[0]
    msg = _ended(server, 13, _stored(layout), push)
    assert "key 13 (conv: a 'rows' key, pull %r)" % layout.pull in msg
    assert "rows %d pushed, outside the key's %d" % (layout.rows + 2, layout.rows) in msg
    values[1, 3] = np.inf
    msg = _ended(server, 13, _stored(layout),
                 row_sparse_push(layout, values, np.array([3, 4]))[0])
    assert "NaN or Inf values pushed, which conv_topk never sends; the server sees only " \
        "the sum" in msg


def test_load_round_not_whole(server):
    size = 9
    server.layouts[14] = ("load", ChunkLayout("load", 0, size, size))
    push = np.zeros(size, np.float32)
    push[0] = 3             # W = 2 workers' round + 1: an even number
    msg = _ended(server, 14, mx.nd.zeros((size,)), mx.nd.array(push))
    assert "key 14 (load: a 'load' key)" in msg
    assert "is 3.0: not 2 times a whole number from 1" in msg


def test_layout_tables_that_cannot_be_decoded_name_the_sender(server):
    """Unpickled as a server unpickles it, a table with an unknown kind or codec, a
    layout of another job (other workers' count, another server), or a broken entry
    ends the server naming the key and the worker process that sent it."""
    good = _slots_layout("fc_2bit", 4096)
    me = "worker process %d on host %s" % (os.getpid(), socket.gethostname())
    cases = [
        (ChunkLayout("zigzag", 0, 4, 4), "key 3 (fc): unknown layout kind 'zigzag'"),
        (ChunkLayout("slots", 0, 4, 4, cols=4, rows=2, slot_rows=1, slots=W,
                     codec="zstd"), "key 3 (fc): unknown codec 'zstd' for a 'slots' key"),
        (ChunkLayout("dense", 0, 4, 4, pull="scatter"), "key 3 (fc): unknown pull"),
        (plan_chunks("fc_2bit", (4096,), 3, 1)[0],
         "key 3 (fc): laid out for 3 workers' slots in a job of 2 workers (a layout of "
         "another job)"),
        (ChunkLayout("dense", 0, 4, 4, server=2), "placed on server 2 of a job of 1 "
                                                  "servers"),
        (dataclasses.replace(good, slot_rows=0), "key 3 (fc): slots of 0 rows"),
    ]
    for layout, words in cases:
        blob = pickle.dumps(ServerDecoder({3: ("fc", layout)}))
        with pytest.raises(ServerEnded) as err:
            pickle.loads(blob)
        assert "the layout table sent by the %s is malformed" % me in str(err.value)
        assert words in str(err.value), str(err.value)
    with pytest.raises(ServerEnded, match="key 3: 'fc' is not"):
        pickle.loads(pickle.dumps(ServerDecoder({3: "fc"})))
    # a key another worker laid out otherwise: the models differ
    server.merge_layouts({3: ("fc", good)}, "worker process 1 on host a")
    with pytest.raises(ServerEnded, match="workers train different models: "
                                          "parameter-server key 3 .* on the %s" % me):
        pickle.loads(pickle.dumps(ServerDecoder({3: ("fc2", good)})))


@pytest.mark.timeout(90)
def test_malformed_push_ends_a_real_job_naming_key_and_worker(tmp_path):
    """Over MXNet's parameter server: worker rank 1 pushes half of its slot. The server
    exits 3 with the key and the worker in its last words, and the launcher ends the
    job within its dead-peer bound, leaving nothing running."""
    t0 = time.monotonic()
    job, pid_file = _start_job(["-n", "2", "-s", "1", "--no-relaunch", PY,
                                os.path.join(SCRIPTS, "bad_push.py")], tmp_path, timeout=60)
    try:
        out = job.communicate(timeout=80)[0].decode("utf-8", "replace")
    finally:
        _end_job(job, pid_file)
    secs = time.monotonic() - t0
    assert job.returncode == launch.EXIT_FAILED, out
    last = out.strip().splitlines()[-1]
    assert "server 0 (pid" in last and "exited with code 3 while workers were still " \
        "running" in last, out
    assert "mxhylo server error: malformed push to parameter-server key 7 (bad_layer: a " \
        "'slots' key of fp16" in last, out
    assert "worker rank 1's slot (rows 2-3 of the key) came with 1 of its 2 rows" in last
    assert "pulled" not in out          # no worker got an aggregate
    assert secs < 60, out
