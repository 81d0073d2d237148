"""``python -m mxhylo.bench SUITE [options] --json FILE``: the benchmarks.

Each suite is a module of mxhylo.bench with ``add_arguments(parser)`` and
``run(args) -> dict``; the dict is printed and, with --json, written to FILE.
Speed is only ever measured here, side by side in one run, never in tests.
"""
import argparse
import importlib
import json
import sys

SUITES = {
    "ops": "compression operators: C++ vs NDArray reference vs memcpy bandwidth",
    "comm": "gradient exchange over MXNet's parameter server in shaped network namespaces",
    "io": "RecordLoader decode throughput and input wait with a simulated step",
    "accuracy": "convergence per step: dense vs hylo modes over nets, learning rates, budgets and seeds on the digits",
    "lars": "large-batch study on the digits: LARS with warmup vs SGD with scaled lr",
    "scale": "past one rack: pull bytes at W = 4, 16, 64 and accuracy of W simulated workers",
    "train": "real Gluon training steps (or time to accuracy, --tta) per kvstore in shaped "
             "network namespaces",
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mxhylo.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True)
    for name, help_text in SUITES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", metavar="FILE", help="write the report to FILE")
        try:
            module = importlib.import_module("mxhylo.bench." + name)
        except ModuleNotFoundError as err:
            if err.name != "mxhylo.bench." + name:
                raise
            p.set_defaults(module=None)
            continue
        module.add_arguments(p)
        p.set_defaults(module=module)
    args = parser.parse_args(argv)
    if args.module is None:
        parser.error("benchmark suite %r is not available in this build" % args.suite)
    report = args.module.run(args)
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
