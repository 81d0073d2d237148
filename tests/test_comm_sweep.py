"""bench comm's bandwidth sweep: unshaped links, the speedup table and the bar's check."""
import math

from mxhylo.bench import comm, netns


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


def test_sweep_table_and_checks():
    report = {"config": {"rates": ["1gbit", "none"]}, "rates": {
        "1gbit": _rate_report({"m": {"dense_pushpull": 4.0, "hylo_gather": 1.0,
                                     "hylo_auto": 1.05}}),
        "none": _rate_report({"m": {"dense_pushpull": 1.0, "hylo_gather": 1.25,
                                    "hylo_auto": 1.0}})}}
    report["sweep"] = comm.sweep_table(report)
    assert report["sweep"]["m"]["hylo_auto"] == {"1gbit": 4.0 / 1.05, "none": 1.0}
    checks = comm.sweep_checks(report)
    assert checks["m@1gbit"]["ok"]                   # 3.8x dense, 0.95 of the best
    assert checks["m@none"]["ok"]                    # 1.0x dense, better than gather
    assert checks["m@none"]["vs_best_fixed"] == 1.0 / 0.8
    report["rates"]["none"] = _rate_report({"m": {"dense_pushpull": 1.0, "hylo_gather": 0.5,
                                                  "hylo_auto": 1.1}})
    report["sweep"] = comm.sweep_table(report)
    slow = comm.sweep_checks(report)["m@none"]
    assert not slow["ok"] and slow["speedup"] < 1.0
    report["sweep_checks"] = comm.sweep_checks(report)
    lines = comm.format_sweep(report)
    assert any("BELOW the bar" in line for line in lines)


def test_failed_mode_is_a_gap_not_a_number():
    report = {"config": {"rates": ["1gbit"]}, "rates": {
        "1gbit": _rate_report({"m": {"dense_pushpull": 2.0, "hylo_auto": 1.0}})}}
    report["rates"]["1gbit"]["results"]["m"]["hylo_gather"] = {"status": "failed: x"}
    report["sweep"] = comm.sweep_table(report)
    assert report["sweep"]["m"]["hylo_gather"] == {"1gbit": None}
    check = comm.sweep_checks(report)["m@1gbit"]
    assert check["ok"] and check["best_fixed_hylo"] is None
