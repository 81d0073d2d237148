"""The test run's options and markers.

Tests live in folders by what they need: unit/ (numpy and the operators, no store),
integration/ (a hylo store and MXNet in this process), distributed/ (jobs of several
processes started as users start them; the scripts those jobs run are in
distributed/jobs/), and bench/ (the benchmark harness, python -m mxhylo.bench, not the
product). Each test is marked with its folder's name, so ``-m unit`` or
``-m "not bench"`` selects by kind. ``--runslow`` adds the heavier runs.
"""
import os

import pytest

KINDS = ("unit", "integration", "distributed", "bench")
# Kinds whose tests start jobs of several processes. The default run (pytest.ini: two
# xdist workers, --dist loadgroup) runs them one at a time on one worker, as they
# were written to run (each job's processes share the machine's cores), while the other
# worker runs the tests of one process.
JOBS = ("distributed", "bench")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = os.path.basename(os.path.dirname(str(item.fspath)))
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
        if kind in JOBS:
            # one after another, on one xdist worker: see JOBS
            item.add_marker(pytest.mark.xdist_group("jobs"))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="heavier run: opt in with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
