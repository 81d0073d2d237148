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

# Every process the tests start imports MXNet, whose numpy_op_fallback imports
# distutils; with setuptools installed, setuptools' distutils shim answers that import
# by importing all of setuptools (about 0.3 CPU-seconds a process, 70-90 of the default
# run's). The standard library's distutils (Python 3.11) serves MXNet's version checks
# alike. Inherited by the xdist workers and every job they start.
os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")

KINDS = ("unit", "integration", "distributed", "bench")
# The default run (pytest.ini) spreads the tests over two xdist workers, jobs of several
# processes included: a job may run beside another job or beside one-process tests.
# The run is bound by CPU either way (2 cores kept busy); every job's bounds (its
# launcher's --timeout, the store's stall watchdog) allow for the shared cores.


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = os.path.basename(os.path.dirname(str(item.fspath)))
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="heavier run: opt in with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
