"""The benchmarks' vocabulary of modes, the emulated network, the report maths, and one
small comm run in the emulated cluster (root)."""
import argparse
import json
import math
import os

import pytest

from mxhylo.bench import comm, modes, netns, report

needs_netns = pytest.mark.skipif(not netns.namespaces_usable(),
                                 reason="needs root and iproute2 (network namespaces)")


# ----------------------------------------------------------------------------- modes

def test_hylo_is_the_stores_defaults_and_the_variants_say_what_differs(monkeypatch):
    import mxhylo
    assert modes.MODES["hylo"].options == () and modes.MODES["hylo"].switches == ()
    kv, update_on_kvstore = modes.make_store("hylo", one_process=True)
    assert kv.stats()["options"] == mxhylo.create("hylo").stats()["options"]
    assert update_on_kvstore is None
    kv, _ = modes.make_store("hylo_rule", {"warmup_steps": 3}, one_process=True)
    assert kv.stats()["options"]["cost_model"] is False
    assert kv.stats()["options"]["warmup_steps"] == 3
    from mxhylo.kvstore import hylo
    monkeypatch.setattr(hylo, "OVERLAP", True)
    kv, _ = modes.make_store("hylo_nooverlap", one_process=True)
    assert kv.overlap is False
    for name, m in modes.MODES.items():
        assert m.help and m.peer == (m.store != "hylo" and not m.sync_batchnorm), name
    assert set(modes.exchange_modes()) == {n for n, m in modes.MODES.items()
                                           if not (m.batch_schedule or m.sync_batchnorm)}
    assert set(modes.HEADLINE) <= set(modes.MODES)
    assert modes.parse_modes("dist_sync,hylo") == ["dist_sync", "hylo"]
    with pytest.raises(ValueError, match="unknown mode dense"):
        modes.parse_modes("dense,hylo")
    with pytest.raises(ValueError, match="unknown mode nope"):
        modes.parse_modes("hylo,nope")
    with pytest.raises(ValueError, match="twice"):
        modes.parse_modes("hylo,hylo")


def test_speedups_are_against_the_baselines_and_the_fastest_peer():
    per_mode = {"dist_sync": {"seconds": 2.0}, "dist_sync_fp16": {"seconds": 1.25},
                "horovod_fp16": {"seconds": 1.6}, "mxnet_2bit": {"status": "failed: x"},
                "hylo": {"seconds": 0.5}}
    report.compare(per_mode, "seconds", ("dist_sync", "horovod_dense"))
    hylo = per_mode["hylo"]
    assert hylo["best_peer"] == "dist_sync_fp16"
    assert hylo["speedup_vs_best_peer"] == pytest.approx(2.5)
    assert hylo["speedup_vs_dist_sync"] == pytest.approx(4.0)
    assert "speedup_vs_horovod_dense" not in hylo            # it did not run
    assert "best_peer" not in per_mode["mxnet_2bit"]
    alone = report.compare({"hylo": {"seconds": 1.0}}, "seconds")
    assert alone["hylo"]["speedup_vs_best_peer"] is None


def _rate(seconds):
    results = {m: report.compare({k: {"seconds": v} for k, v in per.items()}, "seconds",
                                 ("dist_sync",)) for m, per in seconds.items()}
    return {"results": results, "date": "d", "machine": {}, "notes": [],
            "config": {"workers": 4, "servers": 2}}


def test_a_sweep_tables_every_rate_and_holds_hylo_to_its_bar(tmp_path):
    per_rate = {"1gbit": _rate({"m": {"dist_sync": 4.0, "dist_sync_fp16": 2.5,
                                      "hylo_rule": 1.0, "hylo": 1.05}}),
                "none": _rate({"m": {"dist_sync": 1.0, "dist_sync_fp16": 1.25,
                                     "hylo_rule": 0.5, "hylo": 1.1}})}
    out = report.sweep("comm", ["1gbit", "none"], per_rate)
    assert out["sweep"]["m"]["hylo"] == {"1gbit": pytest.approx(4.0 / 1.05),
                                         "none": pytest.approx(1.0 / 1.1)}
    assert out["sweep_vs_best_peer"]["m"]["hylo"]["1gbit"] == pytest.approx(2.5 / 1.05)
    assert out["sweep_checks"]["m@1gbit"]["ok"]      # faster than dist_sync, 0.95 of rule
    slow = out["sweep_checks"]["m@none"]
    assert not slow["ok"] and slow["speedup"] < 1.0
    assert any("BELOW the bar" in line for line in out["table"])
    report.plot_sweep(dict(out, machine={"cpu": "X"}), str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- network

@pytest.mark.parametrize("text,bps", [("1gbit", 1e9), ("100mbit", 1e8), ("125mbps", 1e9),
                                      ("1.5mbit", 1.5e6), ("800", 800.0)])
def test_rates_read_as_tc_reads_them(text, bps):
    assert netns.parse_rate(text) == pytest.approx(bps)


def test_bad_rates_and_times_are_refused_and_none_is_unshaped():
    for bad in ("fast", "1gbitt", "", "0mbit"):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)
    assert netns.parse_time("2ms") == pytest.approx(0.002)
    assert math.isinf(netns.parse_rate("none"))
    assert netns.qdisc_commands("ns", "eth0", math.inf) == []
    (netem,) = netns.qdisc_commands("ns", "eth0", math.inf, delay_s=0.001)
    assert "netem" in netem and "tbf" not in netem


def test_the_topology_shapes_both_ways_inside_its_own_namespaces_only():
    roles = ["scheduler", "server0", "server1", "worker0"]
    topo = netns.Topology(roles, 1e9, role_rates=netns.parse_role_rates("server1=250mbit"))
    assert topo.prefix == "mxhcomm%d-" % os.getpid()
    cmds = topo.setup_commands()
    for c in cmds:
        if c[:3] != ["ip", "netns", "add"]:
            assert c[1] == "-n" and c[2].startswith(topo.prefix), c
    tbf = {(c[2], c[6]): c[c.index("rate") + 1] for c in cmds if "tbf" in c}
    assert tbf[(topo.ns("server1"), "eth0")] == tbf[(topo.hub, topo.hub_port("server1"))] \
        == "250000000bit"
    assert tbf[(topo.ns("worker0"), "eth0")] == tbf[(topo.hub, topo.hub_port("worker0"))] \
        == "1000000000bit"
    with pytest.raises(ValueError, match="server7"):
        netns.Topology(roles, 1e9, role_rates={"server7": 1e8})


def test_wire_bytes_are_per_exchange_and_by_direction():
    before = {"scheduler": (0, 0), "server0": (0, 0), "worker0": (100, 200), "worker1": (0, 0)}
    after = {"scheduler": (10, 10), "server0": (600, 300), "worker0": (400, 500),
             "worker1": (300, 300)}
    wire = comm.wire_summary(before, after, 3)
    assert wire["push_bytes_per_step"] == pytest.approx(600 / 3)
    assert wire["pull_bytes_per_step"] == pytest.approx(600 / 3)
    assert wire["server_tx_bytes_per_step"] == pytest.approx(200)


# ----------------------------------------------------------------------------- a run

# default run: the modes' stores (above); the harness's jobs: --runslow (the harness
# is not the product)
@pytest.mark.slow
@needs_netns
def test_comm_run_records_each_mode_and_hylo_moves_fewer_bytes(tmp_path):
    """bench comm in the emulated cluster: dist_sync, hylo (the defaults; no dense warm-up
    to wait through here) and Horovod's float16 ring, 2 workers and 1 server."""
    from mxhylo.bench.__main__ import main
    path = tmp_path / "comm.json"
    main(["comm", "-n", "2", "-s", "1", "--rate", "100mbit", "--models", "cifar_resnet20_v1",
          "--image-size", "32", "--modes", "dist_sync,hylo,horovod_fp16", "--steps", "2",
          "--warmup", "0", "--timeout", "120", "--hylo-options", '{"warmup_steps": 0}',
          "--json", str(path)])
    out = json.loads(path.read_text())
    assert netns.own_namespaces("mxhcomm%d-" % os.getpid()) == []
    assert out["machine"]["cpu_features"] is not None and out["machine"]["mxnet"]
    res = out["results"]["cifar_resnet20_v1"]
    assert sorted(res) == ["dist_sync", "horovod_fp16", "hylo"]
    for m, r in res.items():
        assert r["status"] == "ok", r.get("log_tail", r["status"])
        assert r["seconds"] > 0 and len(r["seconds_steps"]) == 2
    dense = out["models"]["cifar_resnet20_v1"]["dense_bytes"]
    ds, hy, half = (res[m]["wire"] for m in ("dist_sync", "hylo", "horovod_fp16"))
    # each worker pushes and pulls the whole model; headers add a few percent
    assert 2 * dense <= ds["push_bytes_per_step"] < 2.3 * dense
    assert hy["push_bytes_per_step"] < 0.5 * ds["push_bytes_per_step"]
    assert hy["pull_bytes_per_step"] < 0.5 * ds["pull_bytes_per_step"]
    assert res["hylo"]["hylo"]["bytes_pushed_per_step"] < dense
    # float16 in a ring of two: each worker sends its half of the model twice
    assert 0.9 * dense <= half["push_bytes_per_step"] < 1.3 * dense
    assert half["server_rx_bytes_per_step"] < 2000            # no servers
    assert res["hylo"]["best_peer"] in ("dist_sync", "horovod_fp16")
    assert (tmp_path / "comm.png").read_bytes()[:4] == b"\x89PNG"


def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    parser = argparse.ArgumentParser()
    comm.add_arguments(parser)
    with pytest.raises(SystemExit, match="needs root"):
        comm.run(parser.parse_args(["--models", "x"]))
