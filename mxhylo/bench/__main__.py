"""``python -m mxhylo.bench SUBCOMMAND [options] [--json FILE] [--plot FILE]``.

Each subcommand is a module of mxhylo.bench with ``add_arguments(parser)`` and
``run(args) -> dict`` (and ``plot(record, path)`` when it draws one). The record is
printed and, with --json, written to FILE, with its PNG beside it (--plot elsewhere,
--plot '' for none). Every record says which machine it was measured on.

comm and train emulate a cluster on this machine (network namespaces behind shaped
links, root needed): a single-machine stand-in for a real network, sharing this
machine's cores between every process of the job.
"""
import argparse
import importlib
import sys

from . import modes, report

SUBCOMMANDS = {
    "comm": "one step's gradient exchange per mode: seconds and bytes against peers, in "
            "an emulated cluster (network namespaces on this machine, root)",
    "train": "real Gluon training steps per mode (step, compute, exchange, overlap), or "
             "time to accuracy (--tta), in an emulated cluster (root)",
    "accuracy": "convergence per step of the modes on the digits: nets, learning rates, "
                "budgets and seeds, jobs on this machine",
    "scale": "past one rack: pull bytes at W = 4, 16, 64 and accuracy of W simulated "
             "workers",
    "ops": "compression operators of every ISA build against memcpy",
    "io": "RecordLoader: decode throughput and the input wait of a simulated step",
    "lars": "large batches on the digits: LARS with warm-up against SGD with a scaled lr",
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mxhylo.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, text in SUBCOMMANDS.items():
        module = importlib.import_module("mxhylo.bench." + name)
        p = sub.add_parser(name, help=text, description=module.__doc__,
                           epilog=modes.table() if name in ("comm", "train", "accuracy")
                           else None, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--json", metavar="FILE", help="write the record to FILE")
        p.add_argument("--plot", metavar="FILE", default=None,
                       help="its PNG (default: beside --json; '' for none)")
        module.add_arguments(p)
        p.set_defaults(module=module)
    args = parser.parse_args(argv)
    record = args.module.run(args)
    report.write(record, args.json, report.plot_path(args), getattr(args.module, "plot", None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
