"""The comm benchmark's harness: command construction, counter parsing, model shapes,
report math; as root, namespaces and one tiny end-to-end run (2 workers, 1 server)."""
import argparse
import os
import sys
import subprocess
import threading
import time

import pytest

from mxhylo.bench import comm, comm_worker, netns


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text,bps", [("1gbit", 1e9), ("100mbit", 1e8), ("10Gbit", 1e10),
                                      ("125mbps", 1e9), ("1.5mbit", 1.5e6), ("800", 800.0),
                                      ("1kibit", 1024.0)])
def test_parse_rate(text, bps):
    assert netns.parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["fast", "1gbitt", "", "-1gbit", "0mbit"])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError):
        netns.parse_rate(bad)


def test_parse_time():
    assert netns.parse_time("2ms") == pytest.approx(0.002)
    assert netns.parse_time("150us") == pytest.approx(150e-6)
    assert netns.parse_time("0.5") == pytest.approx(0.5)
    with pytest.raises(ValueError):
        netns.parse_time("soon")


def test_parse_counters():
    assert netns.parse_counters("123\n4567\n") == (123, 4567)
    for bad in ("", "12", "1 2 3", "x 2"):
        with pytest.raises(ValueError):
            netns.parse_counters(bad)


def test_counters_command_reads_sysfs_inside_namespace():
    cmd = netns.counters_command("nsA")
    assert cmd[:4] == ["ip", "netns", "exec", "nsA"]
    assert cmd[4:] == ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                       "/sys/class/net/eth0/statistics/rx_bytes"]


def test_qdisc_commands():
    (tbf,) = netns.qdisc_commands("nsA", "eth0", 1e9)
    assert tbf[:7] == ["tc", "-n", "nsA", "qdisc", "add", "dev", "eth0"]
    assert tbf[tbf.index("rate") + 1] == "1000000000bit"
    assert int(tbf[tbf.index("burst") + 1]) >= 64 * 1024
    netem, child = netns.qdisc_commands("nsA", "eth0", 1e8, delay_s=0.001)
    assert "netem" in netem and netem[netem.index("delay") + 1] == "1000us"
    assert child[child.index("parent") + 1] == "1:1" and "tbf" in child


def test_a_role_can_sit_on_a_slower_link():
    rates = netns.parse_role_rates("server1=250mbit, worker0=2gbit")
    assert rates == {"server1": 2.5e8, "worker0": 2e9} and netns.parse_role_rates("") == {}
    for bad in ("server1", "=1gbit", "server1=fast"):
        with pytest.raises(ValueError):
            netns.parse_role_rates(bad)
    roles = comm.role_names(2, 2)
    topo = netns.Topology(roles, 1e9, role_rates={"server1": 2.5e8})
    tbf = {(c[2], c[6]): c[c.index("rate") + 1] for c in topo.setup_commands()
           if c[0] == "tc" and "tbf" in c}
    assert tbf[(topo.ns("server1"), "eth0")] == tbf[(topo.hub, topo.hub_port("server1"))] \
        == "250000000bit"
    assert tbf[(topo.ns("server0"), "eth0")] == tbf[(topo.ns("worker1"), "eth0")] \
        == "1000000000bit"
    with pytest.raises(ValueError, match="server7"):
        netns.Topology(roles, 1e9, role_rates={"server7": 1e8})


def test_topology_names_carry_pid_and_stay_inside_namespaces():
    roles = comm.role_names(2, 1)
    assert roles == ["scheduler", "server0", "worker0", "worker1"]
    topo = netns.Topology(roles, 1e9)
    assert topo.prefix == "mxhcomm%d-" % os.getpid()
    assert topo.ns("worker1") == topo.prefix + "worker1"
    assert topo.addr("scheduler") == "10.203.0.1" and topo.addr("worker1") == "10.203.0.4"
    cmds = topo.setup_commands()
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert added == [topo.hub] + [topo.ns(r) for r in roles]
    # every other command targets one of our namespaces (-n NS), never the host's
    for c in cmds:
        if c[:3] != ["ip", "netns", "add"]:
            assert c[1] == "-n" and c[2].startswith(topo.prefix), c
    # both directions shaped: each role's eth0 and its hub port
    shaped = {(c[2], c[6]) for c in cmds if c[0] == "tc"}
    assert (topo.ns("server0"), "eth0") in shaped and (topo.hub, topo.hub_port("server0")) in shaped


def test_parse_list():
    assert comm.parse_list("a, b,,c") == ["a", "b", "c"]
    with pytest.raises(ValueError):
        comm.parse_list("dense_pushpull,nope", comm.ALL_MODES, "mode")


def test_modes_registered():
    assert set(comm_worker.MODES) == set(comm.ALL_MODES)
    assert comm_worker.MODES["mxnet_2bit"].push_then_pull
    assert comm_worker.MODES["mxnet_2bit"].compression == {"type": "2bit", "threshold": 0.5}
    assert not comm_worker.MODES["dense_pushpull"].push_then_pull
    # the float16 peers run by default, beside the other peers
    for mode in ("dist_sync_fp16", "horovod_fp16"):
        assert mode in comm.ALL_MODES and comm.is_peer(mode)
        assert mode in _comm_args([]).modes.split(",")
    assert not comm.is_peer("hylo_auto") and comm.is_peer("mxnet_2bit")


def _comm_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    comm.add_arguments(parser)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- shapes

def test_block_shapes_keys_follow_collect_params_and_skip_null_grads():
    from mxnet import gluon
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3), gluon.nn.BatchNorm(), gluon.nn.Dense(5))
    shapes = comm.block_shapes(net, image_size=8)
    names = [s["name"] for s in shapes]
    assert not any("running" in n for n in names)        # BN statistics: grad_req 'null'
    assert shapes[0]["shape"] == [4, 3, 3, 3]
    assert shapes[-2]["shape"] == [5, 4 * 6 * 6] and shapes[-1]["shape"] == [5]
    # keys are the indices among all parameters (running_mean/var included), as Trainer
    keys = [s["key"] for s in shapes]
    assert keys == sorted(keys) and keys[-1] == len(list(net.collect_params().values())) - 1


def test_model_shapes_gluoncv():
    shapes = comm.model_shapes("cifar_resnet20_v1", image_size=32)
    summary = comm.model_summary(shapes, 4, 2, 1e9)
    assert summary["num_keys"] == len(shapes) > 20
    assert summary["dense_bytes"] == 4 * sum(comm.numel(s["shape"]) for s in shapes)
    assert 0 < summary["largest_key"]["fraction"] < 1


# ----------------------------------------------------------------------------- report math

def test_dense_pull_floor():
    # 100 MB model, 4 workers, 2 servers: each server sends 50 MB to 4 workers at 125 MB/s
    assert comm.dense_pull_floor(100e6, 4, 2, 1e9) == pytest.approx(1.6)
    assert comm.dense_pull_floor(100e6, 4, 4, 1e9) == pytest.approx(0.8)


def _worker(index, starts, secs, stats_before=None, stats=None):
    return {"index": index, "init_s": 0.5, "warmup": [{"start": 0.0, "seconds": 9.0}],
            "steps": [{"start": a, "seconds": b} for a, b in zip(starts, secs)],
            "stats_before": stats_before, "stats": stats}


def test_step_seconds_and_summary():
    results = [_worker(0, [10.0, 20.0, 30.0], [1.0, 2.0, 1.5]),
               _worker(1, [10.1, 20.0, 30.0], [1.2, 1.0, 1.4])]
    slowest, span = comm.step_seconds(results)
    assert slowest == [1.2, 2.0, 1.5]
    assert span == pytest.approx([1.3, 2.0, 1.5])
    before = {"scheduler": (0, 0), "server0": (0, 0), "worker0": (100, 200),
              "worker1": (0, 0)}
    after = {"scheduler": (10, 10), "server0": (600, 300), "worker0": (400, 500),
             "worker1": (300, 300)}
    res = comm.summarise_job(results, before, after, steps=3)
    assert res["seconds"] == 1.5 and res["warmup_seconds"] == [9.0]
    wire = res["wire"]
    assert wire["push_bytes_per_step"] == pytest.approx((300 + 300) / 3)
    assert wire["pull_bytes_per_step"] == pytest.approx((300 + 300) / 3)
    assert wire["server_tx_bytes_per_step"] == pytest.approx(200)
    assert wire["per_role_per_step"]["scheduler"] == {"tx": pytest.approx(10 / 3),
                                                      "rx": pytest.approx(10 / 3)}
    assert "hylo" not in res


def test_hylo_summary_uses_deltas_over_timed_steps():
    results = [_worker(i, [0, 1], [0.1, 0.1],
                       stats_before={"bytes_pushed": 100, "bytes_pulled": 1000},
                       stats={"bytes_pushed": 300, "bytes_pulled": 3000, "steps": 3,
                              "timing": {"encode": 0.1}})
               for i in range(2)]
    res = comm.summarise_job(results, None, None, steps=2)
    assert res["hylo"]["bytes_pushed_per_step"] == pytest.approx(200)
    assert res["hylo"]["bytes_pulled_per_step"] == pytest.approx(2000)
    assert res["hylo"]["timing"] == [{"encode": 0.1}] * 2
    assert res["hylo"]["worker0_stats"]["steps"] == 3


def test_speedups_and_table(tmp_path):
    per_mode = {"dense_pushpull": {"status": "ok", "seconds": 2.0},
                "mxnet_2bit": {"status": "ok", "seconds": 4.0},
                "hylo": {"status": "skipped: no"}}
    comm.add_speedups(per_mode, floor_s=1.0)
    assert per_mode["dense_pushpull"]["speedup_vs_dense_pushpull"] == 1.0
    assert per_mode["mxnet_2bit"]["speedup_vs_dense_pushpull"] == 0.5
    assert per_mode["mxnet_2bit"]["x_dense_pull_floor"] == 4.0
    report = {"results": {"m": per_mode},
              "models": {"m": {"dense_pull_floor_s": 1.0}},
              "config": {"modes": ["dense_pushpull", "mxnet_2bit", "hylo"], "workers": 4,
                         "servers": 2, "rate": "1gbit", "gradients": "N(0, 0.01)"},
              "machine": {"hostname": "h"}, "date": "2024-01-01T00:00:00"}
    text = "\n".join(comm.format_table(report))
    assert "0.50x" in text and "skipped" in text and "dense-pull floor" in text
    assert "best peer (fastest non-hylo mode): dense_pushpull, 2.000" in text
    comm.write_plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_speedup_against_the_best_peer_of_the_run(tmp_path):
    """A hylo mode's speedup is stated against the fastest non-hylo mode of the run (here
    the float16 peer), beside the existing one over dense_pushpull."""
    per_mode = {"dense_pushpull": {"status": "ok", "seconds": 2.0},
                "dist_sync_fp16": {"status": "ok", "seconds": 1.25},
                "mxnet_2bit": {"status": "failed: x"},
                "horovod_fp16": {"status": "ok", "seconds": 1.6},
                "hylo": {"status": "ok", "seconds": 0.5},
                "hylo_auto": {"status": "ok", "seconds": 1.0}}
    comm.add_speedups(per_mode, floor_s=1.0)
    assert comm.best_peer(per_mode, "seconds") == ("dist_sync_fp16", 1.25)
    assert per_mode["hylo"]["best_peer"] == "dist_sync_fp16"
    assert per_mode["hylo"]["speedup_vs_best_peer"] == pytest.approx(2.5)
    assert per_mode["hylo"]["speedup_vs_dense_pushpull"] == pytest.approx(4.0)
    assert per_mode["hylo_auto"]["speedup_vs_best_peer"] == pytest.approx(1.25)
    assert per_mode["dense_pushpull"]["speedup_vs_best_peer"] == pytest.approx(0.625)
    assert "speedup_vs_best_peer" not in per_mode["mxnet_2bit"]
    report = {"results": {"m": per_mode}, "models": {"m": {"dense_pull_floor_s": 1.0}},
              "config": {"modes": list(per_mode), "workers": 4, "servers": 2,
                         "rate": "1gbit", "gradients": "N(0, 0.01)"},
              "machine": {"hostname": "h"}, "date": "2026-01-01T00:00:00"}
    lines = comm.format_table(report)
    assert lines[0].split()[2:6] == ["s/exch", "speedup", "vs", "peer"]
    row = [l for l in lines if l.split()[1:2] == ["hylo"]][0].split()
    assert row[3:5] == ["4.00x", "2.50x"]
    best = [l for l in lines if "best peer" in l][0]
    assert "dist_sync_fp16, 1.250 s/exch" in best and "hylo 2.50x" in best \
        and "hylo_auto 1.25x" in best
    comm.write_plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    alone = comm.add_speedups({"hylo": {"status": "ok", "seconds": 1.0}}, 1.0)
    assert alone["hylo"]["speedup_vs_best_peer"] is None


def test_job_timeout_grows_with_model():
    small = comm.job_timeout({"dense_pull_floor_s": 0.1, "dense_bytes": 1e6}, 4, 3, 1)
    big = comm.job_timeout({"dense_pull_floor_s": 9.0, "dense_bytes": 5.5e8}, 4, 3, 1)
    assert 120 < small < big


# ----------------------------------------------------------------------------- worker sync

def test_file_sync_barrier_and_mark(tmp_path):
    n = 3
    order = []

    def worker(i):
        s = comm_worker.FileSync(str(tmp_path), n, i, timeout=20, poll=0.001)
        time.sleep(0.05 * i)
        s.barrier()
        order.append(("after", i))
        if i == 0:
            s.mark("start")
            order.append(("acked", i))
        s.barrier("x")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    mark = tmp_path / "mark-start"
    for _ in range(2000):
        if mark.exists():
            break
        time.sleep(0.005)
    assert mark.exists()
    (tmp_path / "mark-start.ack").touch()
    for t in threads:
        t.join(20)
    assert all(not t.is_alive() for t in threads)
    assert len(order) == n + 1


def test_file_sync_times_out(tmp_path):
    s = comm_worker.FileSync(str(tmp_path), 2, 0, timeout=0.1)
    with pytest.raises(TimeoutError, match="barrier"):
        s.barrier()


# ----------------------------------------------------------------------------- capability

def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in netns.check_capable()
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    comm.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        comm.run(parser.parse_args([]))
    assert "needs root" in str(exc.value.code)


needs_netns = pytest.mark.skipif(not netns.namespaces_usable(),
                                 reason="needs root and iproute2 to create network namespaces")


@needs_netns
def test_topology_create_counters_destroy():
    topo = netns.Topology(["scheduler", "worker0"], 1e8)
    with topo:
        mine = netns.own_namespaces(topo.prefix)
        assert sorted(mine) == sorted([topo.hub, topo.ns("scheduler"), topo.ns("worker0")])
        ping = subprocess.run(topo.exec_prefix("worker0") + [
            sys.executable, "-c",
            "import socket; s = socket.create_connection(('%s', 9), timeout=2)"
            % topo.addr("scheduler")], capture_output=True, text=True, timeout=30)
        assert "refused" in ping.stderr.lower()          # reached the scheduler's namespace
        tx, rx = topo.counters("worker0")
        assert tx > 0 and rx > 0
    assert netns.own_namespaces(topo.prefix) == []


# default run: bench comm's harness in pieces (above: a real topology's counters, the
# step and byte summaries, speedups and tables); its modes' exchanges in real jobs
# (dist_sync_fp16's sum: test_bench_fp16.py; MXNet's 2-bit over the servers:
# test_examples.py, PushThenPull; dense_pushpull is dist_sync's pushpull)
@pytest.mark.slow
@needs_netns
def test_end_to_end_tiny(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    comm.add_arguments(parser)
    args = parser.parse_args([
        "-n", "2", "-s", "1", "--rate", "100mbit", "--models", "cifar_resnet20_v1",
        "--image-size", "32", "--modes", "dense_pushpull,mxnet_2bit,dist_sync_fp16",
        "--steps", "3",
        "--timeout", "150", "--json", str(tmp_path / "comm.json")])
    report = comm.run(args)
    assert netns.own_namespaces("mxhcomm%d-" % os.getpid()) == []
    res = report["results"]["cifar_resnet20_v1"]
    dense_bytes = report["models"]["cifar_resnet20_v1"]["dense_bytes"]
    assert res["dense_pushpull"]["status"] == "ok", res["dense_pushpull"]
    assert res["mxnet_2bit"]["status"] == "ok", res["mxnet_2bit"]
    dense = res["dense_pushpull"]
    assert dense["seconds"] > 0 and len(dense["seconds_steps"]) == 2
    # each worker pushes and pulls the whole model; headers add a few percent
    assert 2 * dense_bytes <= dense["wire"]["push_bytes_per_step"] < 2.3 * dense_bytes
    assert 2 * dense_bytes <= dense["wire"]["pull_bytes_per_step"] < 2.3 * dense_bytes
    # 2-bit: 16x fewer push bytes, dense pull
    two = res["mxnet_2bit"]["wire"]
    assert two["push_bytes_per_step"] < 0.25 * dense["wire"]["push_bytes_per_step"]
    assert two["pull_bytes_per_step"] >= 2 * dense_bytes
    # float16 both ways: half of dense_pushpull's bytes (plus headers)
    half = res["dist_sync_fp16"]
    assert half["status"] == "ok", half.get("log_tail", half["status"])
    for way in ("push_bytes_per_step", "pull_bytes_per_step"):
        assert dense_bytes <= half["wire"][way] < 1.2 * dense_bytes, way
    assert report["mode_descriptions"]["dist_sync_fp16"]
    assert half["best_peer"] in ("dense_pushpull", "mxnet_2bit", "dist_sync_fp16")
    assert (tmp_path / "comm.png").exists()


def test_synthetic_gradients_scale_and_seed():
    shapes = [(300, 4000), (16, 3, 3, 3), (7,)]
    g = comm_worker.synthetic_gradients(shapes, 0.01, seed=1, pool=10007)
    assert [a.shape for a in g] == shapes
    big = g[0].asnumpy()
    assert abs(big.std() - 0.01) < 0.001 and abs(big.mean()) < 0.001
    again = comm_worker.synthetic_gradients(shapes, 0.01, seed=1, pool=10007)
    other = comm_worker.synthetic_gradients(shapes, 0.01, seed=2, pool=10007)
    assert (again[1].asnumpy() == g[1].asnumpy()).all()
    assert not (other[1].asnumpy() == g[1].asnumpy()).all()
