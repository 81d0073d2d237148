"""The bandwidth sweeps of bench comm and bench train (mxhylo.bench.sweep): unshaped
links, the speedup table, the bar's check, and train's --rate list."""
import argparse
import math

import pytest

from mxhylo.bench import comm, netns, sweep, train


def test_rate_none_is_unshaped():
    assert math.isinf(netns.parse_rate("none")) and math.isinf(netns.parse_rate(" None "))
    assert netns.qdisc_commands("ns", "eth0", math.inf) == []
    delayed = netns.qdisc_commands("ns", "eth0", math.inf, delay_s=0.001)
    assert len(delayed) == 1 and "netem" in delayed[0] and "tbf" not in delayed[0]
    assert netns.tbf_burst_bytes(math.inf) is None
    shaped = netns.qdisc_commands("ns", "eth0", 1e9)
    assert any("tbf" in c for c in shaped)


def _rate_report(seconds):
    """A per-rate report as run_rate makes it: {model: {mode: seconds}}."""
    results = {}
    for model, per_mode in seconds.items():
        results[model] = {m: {"status": "ok", "seconds": s} for m, s in per_mode.items()}
        comm.add_speedups(results[model], 1.0)
    return {"results": results}


def _sweep(rates):
    """A comm sweep report of {rate: per-rate report} (what sweep_report builds)."""
    return {"baseline": comm.BASELINE, "default_mode": comm.AUTO_MODE,
            "config": {"rates": list(rates)}, "rates": rates}


def test_sweep_table_and_checks():
    report = _sweep({
        "1gbit": _rate_report({"m": {"dense_pushpull": 4.0, "hylo_gather": 1.0,
                                     "hylo_auto": 1.05}}),
        "none": _rate_report({"m": {"dense_pushpull": 1.0, "hylo_gather": 1.25,
                                    "hylo_auto": 1.0}})})
    report["sweep"] = sweep.sweep_table(report)
    assert report["sweep"]["m"]["hylo_auto"] == {"1gbit": 4.0 / 1.05, "none": 1.0}
    checks = sweep.sweep_checks(report)
    assert checks["m@1gbit"]["ok"]                   # 3.8x dense, 0.95 of the best
    assert checks["m@none"]["ok"]                    # 1.0x dense, better than gather
    assert checks["m@none"]["vs_best_fixed"] == 1.0 / 0.8
    report["rates"]["none"] = _rate_report({"m": {"dense_pushpull": 1.0, "hylo_gather": 0.5,
                                                  "hylo_auto": 1.1}})
    report["sweep"] = sweep.sweep_table(report)
    slow = sweep.sweep_checks(report)["m@none"]
    assert not slow["ok"] and slow["speedup"] < 1.0
    report["sweep_checks"] = sweep.sweep_checks(report)
    lines = sweep.format_sweep(report)
    assert any("BELOW the bar" in line for line in lines)


def test_sweep_states_hylo_against_the_best_peer_of_each_rate():
    per_rate = {
        "1gbit": _rate_report({"m": {"dense_pushpull": 4.0, "dist_sync_fp16": 2.5,
                                     "hylo_auto": 1.0}}),
        "none": _rate_report({"m": {"dense_pushpull": 1.0, "dist_sync_fp16": 1.25,
                                    "hylo_auto": 1.0}})}
    for rep in per_rate.values():
        rep.update(date="2026-01-01T00:00:00", machine={},
                   config={"workers": 4, "servers": 2, "rate": None})
    report = sweep.sweep_report("comm", ["1gbit", "none"], per_rate, comm.BASELINE,
                                comm.AUTO_MODE)
    assert report["sweep_vs_best_peer"]["m"]["hylo_auto"] == {"1gbit": 2.5, "none": 1.0}
    assert report["sweep"]["m"]["hylo_auto"] == {"1gbit": 4.0, "none": 1.0}
    lines = sweep.format_sweep(report)
    at = lines.index("speedup over the best peer of each run (fastest non-hylo mode):")
    assert lines[at + 1].split() == ["m", "hylo_auto", "2.50x", "1.00x"]


def test_failed_mode_is_a_gap_not_a_number():
    report = _sweep({"1gbit": _rate_report({"m": {"dense_pushpull": 2.0,
                                                  "hylo_auto": 1.0}})})
    report["rates"]["1gbit"]["results"]["m"]["hylo_gather"] = {"status": "failed: x"}
    report["sweep"] = sweep.sweep_table(report)
    assert report["sweep"]["m"]["hylo_gather"] == {"1gbit": None}
    check = sweep.sweep_checks(report)["m@1gbit"]
    assert check["ok"] and check["best_fixed_hylo"] is None


def _train_args(**over):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_train_takes_a_list_of_rates_but_not_for_time_to_accuracy():
    parsed = train.check_args(_train_args(rate="100mbit,1gbit,none"))
    assert parsed["rates"] == ["100mbit", "1gbit", "none"]
    with pytest.raises(ValueError, match="one --rate"):
        train.check_args(_train_args(rate="1gbit,none", tta=True))
    with pytest.raises(ValueError):
        train.check_args(_train_args(rate="1gbit,fast"))


def test_train_sweep_runs_every_rate_and_checks_hylo_against_dist_sync(monkeypatch, tmp_path):
    """bench train --rate a,b: one run per rate, then the sweep of speedups over
    dist_sync with the bar on the default mode ('hylo')."""
    seen = []

    def fake_rate(args, plot=None):
        seen.append((args.rate, plot))
        step = {"100mbit": {"dist_sync": 20.0, "hylo_densepull": 15.0, "hylo": 4.0},
                "none": {"dist_sync": 1.0, "hylo_densepull": 1.2, "hylo": 1.1}}[args.rate]
        results = {"m": {mode: {"status": "ok", "step_s": s} for mode, s in step.items()}}
        train.add_speedups(results["m"])
        return {"date": "2026-11-24T00:00:00", "machine": {}, "results": results,
                "config": {"workers": 4, "servers": 2, "rate": args.rate}}

    monkeypatch.setattr(train, "run_rate", fake_rate)
    png = str(tmp_path / "sweep.png")
    report = train.run(_train_args(rate="100mbit,none", json=None, plot=png))
    assert seen == [("100mbit", ""), ("none", "")]
    assert report["plot"] == png and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert report["suite"] == "train_sweep" and report["baseline"] == "dist_sync"
    assert report["sweep"]["m"]["hylo"] == {"100mbit": 5.0, "none": 1.0 / 1.1}
    checks = report["sweep_checks"]
    assert checks["m@100mbit"]["ok"] and checks["m@100mbit"]["best_fixed_hylo"] == 20 / 15
    assert not checks["m@none"]["ok"]                 # slower than dist_sync unshaped
