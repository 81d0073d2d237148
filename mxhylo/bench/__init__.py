"""Benchmarks: python -m mxhylo.bench {ops,comm,train,accuracy,lars,io} (JSON + PNG)."""
import os


def plot_path(args):
    """Where a benchmark draws its PNG: --plot, else next to --json, else nowhere."""
    return args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
