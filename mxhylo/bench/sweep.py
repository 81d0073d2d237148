"""A bandwidth sweep: one benchmark report per link rate (``--rate 100mbit,1gbit,...``),
then each mode's speedup over the benchmark's baseline against bandwidth, the bar for
hylo's default at every rate, and a PNG. Shared by bench comm (baseline dense
pushpull, default 'hylo_auto') and bench train (baseline dist_sync, default 'hylo').

Beside the speedups over the baseline, the hylo modes' speedups over the best peer of
each rate's run (the fastest mode not named hylo*: what a user would run instead;
``speedup_vs_best_peer`` of the per-rate reports) are tabled too.

The bar: at every rate, the default is at least ``min_vs_dense`` x the baseline and at
least ``min_vs_best`` of the best fixed hylo mode that ran (any other mode whose name
starts with 'hylo').
"""


def sweep_report(suite, rates, per_rate, baseline, auto):
    """The sweep's report from ``per_rate`` ({rate: that rate's report}, each with
    'results': {model: {mode: {'status', 'speedup_vs_<baseline>', ...}}})."""
    first = per_rate[rates[0]]
    report = {"suite": suite + "_sweep", "date": first["date"], "machine": first["machine"],
              "config": dict(first["config"], rate=None, rates=rates),
              "baseline": baseline, "default_mode": auto, "rates": per_rate}
    report["sweep"] = sweep_table(report)
    report["sweep_vs_best_peer"] = sweep_table(report, "speedup_vs_best_peer")
    report["sweep_checks"] = sweep_checks(report)
    return report


def sweep_table(report, key=None):
    """{model: {mode: {rate: speedup over the baseline, or None where it did not run}}};
    ``key``: another speedup of the per-rate results (default speedup_vs_<baseline>)."""
    key = key or "speedup_vs_" + report["baseline"]
    table = {}
    for rate, rep_ in report["rates"].items():
        for model, per_mode in rep_["results"].items():
            for mode, res in per_mode.items():
                table.setdefault(model, {}).setdefault(mode, {})[rate] = \
                    res.get(key) if res.get("status") == "ok" else None
    return table


def sweep_checks(report, min_vs_dense=1.0, min_vs_best=0.9):
    """Per model and rate: the default's speedup, the best fixed hylo mode's, their
    ratio, and whether the bar holds."""
    auto = report["default_mode"]
    checks = {}
    for model, per_mode in report["sweep"].items():
        if auto not in per_mode:
            continue
        for rate, speedup in per_mode[auto].items():
            fixed = [per_mode[m].get(rate) for m in per_mode
                     if m.startswith("hylo") and m != auto and per_mode[m].get(rate)]
            best = max(fixed) if fixed else None
            vs_best = speedup / best if speedup and best else None
            checks["%s@%s" % (model, rate)] = {
                "speedup": speedup, "best_fixed_hylo": best, "vs_best_fixed": vs_best,
                "ok": bool(speedup and speedup >= min_vs_dense
                           and (vs_best is None or vs_best >= min_vs_best))}
    return checks


def format_sweep(report):
    rates = report["config"]["rates"]
    lines = ["speedup over %s by rate:" % report["baseline"],
             "%-14s %-16s " % ("model", "mode") + " ".join("%9s" % r for r in rates)]
    for model, per_mode in report["sweep"].items():
        for mode, by_rate in per_mode.items():
            lines.append("%-14s %-16s " % (model, mode) + " ".join(
                "%8.2fx" % by_rate[r] if by_rate.get(r) else "%9s" % "-" for r in rates))
    vs_peer = report.get("sweep_vs_best_peer") or {}
    rows = [(model, mode, by_rate) for model, per_mode in vs_peer.items()
            for mode, by_rate in per_mode.items()
            if mode.startswith("hylo") and any(by_rate.values())]
    if rows:
        lines.append("speedup over the best peer of each run (fastest non-hylo mode):")
        for model, mode, by_rate in rows:
            lines.append("%-14s %-16s " % (model, mode) + " ".join(
                "%8.2fx" % by_rate[r] if by_rate.get(r) else "%9s" % "-" for r in rates))
    for name, c in sorted(report["sweep_checks"].items()):
        lines.append("%-28s %s: %.2fx %s, %s of the best fixed hylo mode" % (
            name, "ok" if c["ok"] else "BELOW the bar", c["speedup"] or 0,
            report["baseline"], "%.2f" % c["vs_best_fixed"] if c["vs_best_fixed"] else "-"))
    return lines


def write_sweep_plot(report, path):
    """One panel per model: each mode's speedup over the baseline against the rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates, auto = report["config"]["rates"], report["default_mode"]
    models = list(report["sweep"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    xs = list(range(len(rates)))
    for ax, model in zip(axes[0], models):
        for mode, by_rate in report["sweep"][model].items():
            ys = [by_rate.get(r) or float("nan") for r in rates]
            ax.plot(xs, ys, marker="o", lw=2.5 if mode == auto else 1.2,
                    label=mode + (" (default)" if mode == auto else ""))
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xticks(xs)
        ax.set_xticklabels(["unshaped" if r == "none" else r for r in rates])
        ax.set_title(model)
        ax.set_xlabel("link rate")
        ax.set_ylabel("speedup over %s (x)" % report["baseline"])
        ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    cfg = report["config"]
    fig.suptitle("%s: %d workers, %d servers, %s, %s" % (
        report["suite"].replace("_", " "), cfg["workers"], cfg["servers"],
        "AVX-512" if any(f.startswith("avx512") for f in
                         report["machine"].get("cpu_features") or []) else "AVX2 or less",
        report["date"][:10]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
