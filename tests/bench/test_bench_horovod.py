"""Horovod in the benchmarks: the environment of a worker in the emulated cluster against
horovodrun's own, the rendezvous server, the horovod_* modes' store; a train run of
them (--runslow)."""
import argparse
import os
import socket
import threading
import time

import numpy as np
import pytest

from mxhylo.bench import jobs, netns, rendezvous

needs_horovod = pytest.mark.skipif(not jobs.horovod_available(),
                                   reason="horovod.mxnet is not installed")


@needs_horovod
@pytest.mark.parametrize("hosts", [["10.203.0.4", "10.203.0.5", "10.203.0.6"],
                                   ["a", "a", "b"], ["a", "b", "b", "b", "c", "c"]])
def test_each_worker_gets_the_variables_horovodrun_would_give_it(hosts):
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    theirs = [create_slot_env_vars(s) for s in get_host_assignments(
        parse_hosts(rendezvous.hosts_arg(hosts)), len(hosts))]
    assert [jobs.slot_env(r, hosts) for r in range(len(hosts))] == \
        [{k: str(v) for k, v in t.items()} for t in theirs]
    ours = jobs.run_env("10.203.0.1", 10091)
    for k, v in create_run_env_vars("10.203.0.1", {"eth0": None}, 10091).items():
        if k != "NCCL_SOCKET_IFNAME":            # no GPUs
            assert ours[k] == str(v), k
    with pytest.raises(ValueError, match="consecutive"):
        jobs.slot_env(0, ["a", "b", "a"])


def test_a_horovod_job_runs_one_worker_per_namespace_and_the_rendezvous(tmp_path):
    topo = netns.Topology(["scheduler", "server0", "worker0", "worker1"], 1e9)
    cfg = {"workers": 2, "servers": 1, "launch": "horovod", "timeout": 77,
           "job_dir": str(tmp_path), "rendezvous_ready": str(tmp_path / "ready")}
    rv, *workers = jobs.children(topo, cfg, "/c.json", 9095)
    assert rv.argv[:4] == topo.exec_prefix("scheduler")
    assert rv.argv[7:] == ["10095", "%s,%s" % (topo.addr("worker0"), topo.addr("worker1")),
                           cfg["rendezvous_ready"]] + [str(tmp_path / ("result-%d.json" % i))
                                                       for i in (0, 1)]
    for i, c in enumerate(workers):
        assert c.argv[:4] == topo.exec_prefix("worker%d" % i)
        assert c.argv[-3:] == ["-m", "mxhylo.bench.worker", "/c.json"]
        assert c.env["HOROVOD_RANK"] == str(i) and c.env["HOROVOD_GLOO_IFACE"] == "eth0"
        assert c.env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == topo.addr("scheduler")
        assert c.env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "77"
        assert not any(k.startswith(("DMLC_", "PS_")) for k in c.env)


@needs_horovod
def test_the_rendezvous_serves_until_every_result_is_written(tmp_path):
    from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ready, results = str(tmp_path / "ready"), [str(tmp_path / "r0"), str(tmp_path / "r1")]
    code = []
    t = threading.Thread(target=lambda: code.append(
        rendezvous.serve(port, ["h0", "h1"], ready, results, timeout=60, poll=0.01)))
    t.start()
    try:
        for _ in range(2000):
            if os.path.exists(ready):
                break
            time.sleep(0.01)
        put_data_into_kvstore("127.0.0.1", port, "global", "0", {"x": 1})
        assert read_data_from_kvstore("127.0.0.1", port, "global", "0") == {"x": 1}
        open(results[0], "w").close()
        time.sleep(0.2)
        assert t.is_alive()
    finally:
        for p in results:
            open(p, "a").close()
        t.join(20)
    assert code == [0]


class _FakeHvd:
    """horovod.mxnet as HorovodStore uses it: allreduce_ adds 1 (the other worker's
    part) in place and records what it was given."""

    def __init__(self):
        from horovod.mxnet.compression import Compression
        self.Compression, self.calls = Compression, []

    def allreduce_(self, tensor, average, name, priority):
        self.calls.append((np.dtype(tensor.dtype).name, average, name, priority))
        tensor[:] = tensor + 1

    def broadcast_(self, tensor, root_rank, name):
        self.calls.append(("broadcast", root_rank, name))


@needs_horovod
def test_the_horovod_store_sums_in_place_or_into_outputs_and_casts_for_fp16(monkeypatch):
    import mxnet as mx
    from mxhylo.bench import modes
    from mxhylo.kvstore import transport_horovod
    hvd = _FakeHvd()
    monkeypatch.setattr(transport_horovod, "import_horovod", lambda: hvd)
    g = np.array([0.1, -2.0e-3, 3.0e-8, 60000.0], dtype=np.float32)
    dense, _ = modes.make_store("horovod_dense")
    half, update_on_kvstore = modes.make_store("horovod_fp16")
    assert update_on_kvstore is False
    grad, out = mx.nd.array(g), mx.nd.zeros(4)
    dense.pushpull(3, grad, out=out, priority=-3)                 # as bench comm
    np.testing.assert_array_equal(grad.asnumpy(), g)
    np.testing.assert_array_equal(out.asnumpy(), g + 1)
    dense.pushpull(4, [grad], priority=-4)                        # in place, as Gluon
    np.testing.assert_array_equal(grad.asnumpy(), g + 1)
    grad = mx.nd.array(g)
    half.pushpull(5, [grad], priority=-5)
    assert grad.dtype == np.float32
    np.testing.assert_array_equal(grad.asnumpy(), (g.astype(np.float16) + 1).astype(np.float32))
    assert hvd.calls == [("float32", False, "3", -3), ("float32", False, "4", -4),
                         ("float16", False, "5", -5)]
    outs = [mx.nd.zeros(4)]
    dense.broadcast(7, mx.nd.array(g), outs)
    assert hvd.calls[-1] == ("broadcast", 0, "broadcast.7")
    np.testing.assert_array_equal(outs[0].asnumpy(), g)


# default run: the Horovod jobs of the emulated cluster in test_bench_comm.py's run
# (horovod_fp16), this store above
@pytest.mark.slow
@needs_horovod
@pytest.mark.skipif(not netns.namespaces_usable(), reason="needs root (network namespaces)")
def test_train_run_with_the_horovod_peers(tmp_path):
    """gluon.Trainer over Horovod's dense ring and its float16 ring: float16 halves the
    bytes; the workers end identical."""
    from mxhylo.bench import train
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    train.add_arguments(parser)
    out = train.run(parser.parse_args([
        "-n", "2", "-s", "1", "--models", "cifar_resnet20_v1", "--image-size", "16",
        "--classes", "10", "--modes", "horovod_dense,horovod_fp16", "--steps", "1",
        "--warmup", "1", "--stream-steps", "1", "--timeout", "120"]))
    per_mode = out["results"]["cifar_resnet20_v1"]
    for m in ("horovod_dense", "horovod_fp16"):
        assert per_mode[m]["status"] == "ok", per_mode[m].get("log_tail")
        assert per_mode[m]["workers_identical"] and per_mode[m]["update_on_kvstore"] is False
    dense, half = (per_mode[m]["wire"]["push_bytes_per_step"]
                   for m in ("horovod_dense", "horovod_fp16"))
    assert 0.4 < half / dense < 0.65
