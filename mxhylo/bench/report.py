"""What every benchmark record holds and how it is written: the JSON, a PNG beside it,
and the machine it was measured on (once per record, under 'machine')."""
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys

from .modes import mode

CPU_FEATURES = re.compile(r"avx512[a-z_0-9]*|avx2|fma|f16c")


def cpu_features(cpuinfo_text):
    """Sorted distinct AVX2/AVX-512/FMA/F16C flags of a /proc/cpuinfo text."""
    return sorted(set(CPU_FEATURES.findall(cpuinfo_text)))


def machine():
    """The machine and software a record was measured with."""
    import mxnet
    import mxhylo
    info = {"hostname": socket.gethostname(), "kernel": platform.release(),
            "python": platform.python_version(), "cores": os.cpu_count(), "cpu": None,
            "cpu_features": None, "mxnet": mxnet.__version__, "mxhylo": mxhylo.__version__,
            "ops_isa": os.environ.get("MXHYLO_ISA", "").strip() or "native",
            "loadavg": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        info["cpu_features"] = cpu_features(text)
        info["cpu"] = next((l.split(":", 1)[1].strip() for l in text.splitlines()
                            if l.startswith("model name")), None)
    except OSError:
        pass
    try:
        tree = os.path.dirname(os.path.dirname(os.path.abspath(mxhylo.__file__)))
        res = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        if res.returncode == 0:
            info["git"] = res.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def options(args):
    """The options of a command line, as a record's config."""
    return {k: v for k, v in vars(args).items() if k not in ("module", "json", "plot")}


def new(suite, config, notes=()):
    return {"suite": suite,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(), "config": config, "notes": list(notes)}


def logger(suite):
    def log(msg):
        print("[%s] %s" % (suite, msg), file=sys.stderr, flush=True)
    return log


def spread(values):
    """{'n', 'mean', 'sd', 'min', 'median', 'max', 'values'} of the numbers given
    (None among them skipped), or None."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    return {"n": len(v), "mean": statistics.mean(v),
            "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "min": min(v),
            "median": statistics.median(v), "max": max(v), "values": v}


def compare(per_mode, key, baselines=(), prefix=""):
    """For every mode with a ``key`` (seconds): ``speedup_vs_B`` = B's seconds over the
    mode's for each baseline B that ran, ``best_peer`` (the fastest peer: a mode not
    of the hylo store) and ``speedup_vs_best_peer``; names prefixed by ``prefix``."""
    ran = {m: r[key] for m, r in per_mode.items() if r.get(key)}
    peers = {m: v for m, v in ran.items() if mode(m).peer}
    best = min(peers, key=peers.get) if peers else None
    for m, v in ran.items():
        r = per_mode[m]
        for b in baselines:
            if b in ran:
                r[prefix + "speedup_vs_" + b] = ran[b] / v
        r[prefix + "best_peer"] = best
        r[prefix + "speedup_vs_best_peer"] = peers[best] / v if best else None
    return per_mode


def x(value):
    return "%.2fx" % value if value else "-"


def mb(value):
    return "%.1f" % (value / 1e6) if value is not None else "-"


# ----------------------------------------------------------------------------- files

def plot_path(args):
    """--plot, else beside --json with .png, else None ('' : no plot)."""
    if getattr(args, "plot", None) is not None:
        return args.plot or None
    json_path = getattr(args, "json", None)
    return os.path.splitext(json_path)[0] + ".png" if json_path else None


def write(report, json_path=None, png=None, plot=None):
    """Draws ``plot(report, png)`` when both are given, then prints the report and writes
    it to ``json_path``."""
    if png and plot is not None:
        plot(report, png)
        report["plot"] = png
    text = json.dumps(report, indent=2, sort_keys=True, default=str)
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")


class RunLog:
    """Runs as they end, one JSON line each, beside the record: a study stopped early
    keeps what it measured, and ``resume`` reuses them ({id: run} in ``done``)."""

    def __init__(self, path, resume=False):
        self.path, self.done = path, {}
        if path and resume and os.path.exists(path):
            with open(path) as f:
                self.done = {r["id"]: r for r in map(json.loads, filter(str.strip, f))}
        elif path and os.path.exists(path):
            os.remove(path)

    def add(self, run):
        self.done[run["id"]] = run
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(run, default=str) + "\n")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path, title):
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    pyplot().close(fig)


def caption(report, what):
    m = report["machine"]
    return "%s\n%s (%s), %s cores, MXNet %s, mxhylo %s" % (
        what, m.get("cpu") or "?", " ".join(f for f in m.get("cpu_features") or []
                                             if f in ("avx2", "avx512f")),
        m.get("cores"), m.get("mxnet"), m.get("git") or m.get("mxhylo") or "?")


# ----------------------------------------------------------------------------- sweeps

def sweep(suite, rates, per_rate, baseline="dist_sync", default="hylo"):
    """The record of a bandwidth sweep (one record per rate in ``per_rate``): each mode's
    speedup over ``baseline`` and over the best peer against the rate, and the bar of
    ``default``: at least the baseline's speed and 0.9 of the best other hylo mode."""
    first = per_rate[rates[0]]
    out = dict(first, suite=suite + "_sweep", config=dict(first["config"], rates=rates),
               rates=per_rate, baseline=baseline, default_mode=default)
    for k in ("results", "table", "models"):
        out.pop(k, None)
    for name, key in (("sweep", "speedup_vs_" + baseline),
                      ("sweep_vs_best_peer", "speedup_vs_best_peer")):
        out[name] = {}
        for rate, rep in per_rate.items():
            for model, per_mode in rep["results"].items():
                for m, r in per_mode.items():
                    out[name].setdefault(model, {}).setdefault(m, {})[rate] = r.get(key)
    checks = out["sweep_checks"] = {}
    for model, per_mode in out["sweep"].items():
        for rate, sp in per_mode.get(default, {}).items():
            others = [v[rate] for m, v in per_mode.items()
                      if m != default and not mode(m).peer and v.get(rate)]
            best = max(others) if others else None
            vs = sp / best if sp and best else None
            checks["%s@%s" % (model, rate)] = {
                "speedup": sp, "best_other_hylo": best, "vs_best_other_hylo": vs,
                "ok": bool(sp and sp >= 1.0 and (vs is None or vs >= 0.9))}
    out["table"] = sweep_table(out)
    return out


def sweep_table(out):
    rates = out["config"]["rates"]
    lines = []
    for title, name in (("speedup over %s" % out["baseline"], "sweep"),
                        ("speedup over the best peer", "sweep_vs_best_peer")):
        lines.append("%-14s %-16s %s   (%s)" % ("model", "mode", " ".join(
            "%9s" % r for r in rates), title))
        for model, per_mode in out[name].items():
            for m, by_rate in per_mode.items():
                if name == "sweep" or not mode(m).peer:
                    lines.append("%-14s %-16s " % (model, m) + " ".join(
                        "%9s" % x(by_rate.get(r)) for r in rates))
    for name, c in sorted(out["sweep_checks"].items()):
        lines.append("%s: %s %s over %s, %s of the best other hylo mode" % (
            name, out["default_mode"], x(c["speedup"]), out["baseline"],
            "%.2f" % c["vs_best_other_hylo"] if c["vs_best_other_hylo"] else "-")
            + ("" if c["ok"] else "  BELOW the bar"))
    return lines


def plot_sweep(out, path):
    plt = pyplot()
    rates, models = out["config"]["rates"], list(out["sweep"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for m, by_rate in out["sweep"][model].items():
            ax.plot(range(len(rates)), [by_rate.get(r) or float("nan") for r in rates],
                    marker="o", lw=2.5 if m == out["default_mode"] else 1.2, label=m)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(rates)))
        ax.set_xticklabels(["unshaped" if r == "none" else r for r in rates])
        ax.set(title=model, xlabel="link rate", yscale="log",
               ylabel="speedup over %s (x)" % out["baseline"])
        ax.legend(fontsize=7)
    cfg = out["config"]
    save(fig, path, caption(out, "%s: %d workers, %d servers" % (
        out["suite"].replace("_", " "), cfg["workers"], cfg["servers"])))
