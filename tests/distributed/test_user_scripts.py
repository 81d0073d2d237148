"""One user script (tests/distributed/jobs/train_eval.py: a small Gluon conv net on a
synthetic image set, trained 3 steps, evaluated, its Trainer's states saved) run as
real multi-process jobs of 2 workers (and 1 server where there are servers), the ways
users start them:

* hylo over the parameter server:   python -m mxhylo.launch -n 2 -s 1 python SCRIPT
* hylo over Horovod:                horovodrun -np 2 -H localhost:2 --gloo python SCRIPT
* MXNet's dist_sync, unmodified:    python -m mxhylo.launch -n 2 -s 1
                                        python -m mxhylo.run --kvstore dist_sync SCRIPT

The cases are a pairwise cover of the ways a script builds its net, store and Trainer,
of the route the store takes and of hylo's cost model (FACTORS). Each case is one
launch of the start-up soak too: every launch runs on shared cores (with the job's own
processes, more runnable processes than cores: beside the default run's other tests,
and under --runslow beside a busy loop), without the launcher's relaunch, and must end
with rc 0 and both workers' trained parameters bitwise equal; and as a matrix case, evaluate, and have
save_states work on either route of the hylo store (MXNet's dist_sync with updates on
the servers raises its own assertion). The default run launches the cases of
DEFAULT_CASES once (7 launches: together every level of every factor, every launch
with each route it takes, and every launch with hylo's cost model running and not);
--runslow launches the whole list 10 times (100 launches).

Every job has a timeout (the launcher's own and one on the whole command), the
launcher and horovodrun pick free ports, all files go to the test's temporary
directory, and no process of a job may outlive it.
"""
import itertools
from fractions import Fraction
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from proc_helpers import processes_mentioning

from mxhylo import launch as mxhylo_launch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "jobs", "train_eval.py")
BUSY = os.path.join(ROOT, "tests", "distributed", "jobs", "busy.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
PY = sys.executable

# Busy loops beside --runslow's soak: one (a job of 2 workers, a server and a scheduler
# already outnumbers 2 cores, and a second loop doubled the module's CPU). The default
# run adds none: its launches share the cores with the run's other xdist worker
# (pytest.ini), and a loop there cost the run about 40 CPU-seconds.
BUSY_LOOPS_SLOW = 1
JOB_TIMEOUT_S = 150          # the launcher's --timeout; the whole command gets 60 s more
STEPS = 3

# The launcher may start a job again when it fails by MXNet's start-up race; the soak
# measures start-up itself, so it turns that off with this flag (used only where this
# launcher has it).
NO_RELAUNCH = "--no-relaunch"
LAUNCH_HAS_NO_RELAUNCH = any(NO_RELAUNCH in action.option_strings
                             for action in mxhylo_launch.build_parser()._actions)


# What save_states raises where the Trainer's optimizer runs on the servers under
# MXNet's dist_sync (MXNet's assertion); the hylo store saves on either route.
DIST_SYNC_ERROR = ("AssertionError", "Cannot save states for distributed training")


# -- running a job -------------------------------------------------------------------------

def job_command(how, script_args):
    """The command line of a 2-worker job: how = 'ps' (hylo over the parameter
    server), 'horovod' (hylo over Horovod) or 'run' (dist_sync under mxhylo.run); 1
    server where there are servers, no relaunch."""
    if how == "horovod":
        return [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", PY, SCRIPT] + \
            script_args
    cmd = [PY, "-m", "mxhylo.launch", "-n", "2", "-s", "1", "--timeout", str(JOB_TIMEOUT_S)]
    if LAUNCH_HAS_NO_RELAUNCH:
        cmd.append(NO_RELAUNCH)
    if how == "run":
        return cmd + [PY, "-m", "mxhylo.run", "--kvstore", "dist_sync", SCRIPT,
                      "--kvstore", "dist_sync"] + script_args
    return cmd + [PY, SCRIPT] + script_args


def run_job(tmp_path, how, script_args):
    """Run the job; returns (exit code, output, both workers' reports or None). The
    job's processes are all ended before this returns: its process group on timeout,
    and any process still naming the job's directory (each by pid)."""
    out = str(tmp_path / "report-{rank}.json")
    cmd = job_command(how, script_args + ["--out", out])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    leftover = []
    try:
        text, _ = proc.communicate(timeout=JOB_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        text += "\n[test] the job's command timed out after %d s" % (JOB_TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.time() + 10         # (a process may still be exiting)
        while time.time() < deadline:
            leftover = processes_mentioning(str(tmp_path) + os.sep)
            if not leftover:
                break
            time.sleep(0.2)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not leftover, "processes of the job outlived it: %s\n%s" % (leftover, text[-3000:])
    paths = [out.format(rank=r) for r in (0, 1)]
    reports = [json.load(open(p)) for p in paths] if all(map(os.path.exists, paths)) \
        else None
    return proc.returncode, text, reports


def failure_text(rc, text):
    """Each process's first error lines, then the output's tail."""
    errors = [line for line in text.splitlines() if re.search(
        r"Error|error|Check failed|terminate|what\(\)|Abort|Traceback|timed out|race", line)]
    return "exit code %s; error lines:\n%s\n--- tail:\n%s" % (
        rc, "\n".join(errors[:30]), text[-2500:])


def assert_workers_identical(reports):
    assert [r["rank"] for r in reports] == [0, 1], reports
    for key in ("sha256", "checksum"):
        assert reports[0][key] == reports[1][key], (
            "the workers' trained parameters differ (%s): %s" % (key, reports))


# -- the cases ---------------------------------------------------------------------------

# how: the launch (see job_command).
# route: where the Trainer's optimizer runs, by a hylo store's server_update option:
#   'servers' (True), 'workers' (False, with size_threshold=64 and no warm-up: this
#   net's conv and dense weights compressed), 'auto' (the store chooses: both routes
#   timed with the cost model; the workers without it, and where the servers cannot
#   update: no servers (Horovod), update_on_kvstore=False; a kvstore string gives
#   Gluon's Trainer no options, so always this); 'dist_sync': MXNet's store, whose
#   optimizer runs on the servers unless update_on_kvstore=False.
# cost_model: hylo's option: 'auto' (its default: on over the parameter server and
#   Horovod, unless options make the plan explicit, as the 'workers' route's
#   size_threshold does) or 'off' (cost_model=False).
# update_on_kvstore: the Trainer's argument: unset, False, or True (dist_sync only: a
#   hylo store takes no optimizer, and Gluon refuses True).
# init: a forward before the Trainer is made ('zero_batch'), or none ('deferred').
FACTORS = {
    "how": ("ps", "horovod", "run"),
    "route": ("servers", "workers", "auto", "dist_sync"),
    "cost_model": ("auto", "off"),
    "store": ("object", "string"),
    "update_on_kvstore": ("unset", "false", "true"),
    "hybridize": (False, True),
    "batchnorm": (False, True),
    "init": ("zero_batch", "deferred"),
    # (no two Trainers on one store: a hylo store serves one; the second raises ValueError)
}

HYLO_ROUTE_OPTIONS = {
    "servers": {"server_update": True},
    "workers": {"server_update": False, "size_threshold": 64, "warmup_steps": 0},
    "auto": {},
}

# update_on_kvstore=True makes explicit what dist_sync does with it unset: one
# combination, not crossed with the other factors (crossed, the cover would need 11
# cases, one launch more than the list's 10).
UPDATE_ON_KVSTORE_TRUE = {"how": "run", "store": "object", "init": "deferred",
                          "hybridize": False, "batchnorm": False}


def feasible(case):
    """Whether a combination of FACTORS is a job to launch."""
    if (case["how"] == "run") != (case["route"] == "dist_sync"):
        return False                    # dist_sync runs under mxhylo.run only
    if case["route"] == "dist_sync" and case["cost_model"] != "auto":
        return False                    # (no hylo option there)
    if case["update_on_kvstore"] == "true":
        return all(case[k] == v for k, v in UPDATE_ON_KVSTORE_TRUE.items())
    if case["route"] == "dist_sync":
        return True
    if case["store"] == "string" and not (case["route"] == case["cost_model"] == "auto"):
        return False                    # only a store object carries options
    if case["route"] == "workers":
        return case["cost_model"] == "auto"   # its explicit options keep the model off
    if case["route"] == "servers":
        # Horovod has no servers; update_on_kvstore=False keeps the optimizer on the
        # workers (server_update=True then refuses)
        return case["how"] == "ps" and case["update_on_kvstore"] == "unset"
    return True


def _pairs(case):
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(case, 2)}


def pairwise_cases(factors, allowed):
    """A pairwise cover of ``factors`` (name -> levels) within ``allowed``: every pair
    of levels of two factors that some allowed combination has appears in a case.
    Greedy: take the allowed combination that covers the most of the pairs not covered
    yet, each pair weighted by 1 / the number of allowed combinations that have it
    (pairs few combinations can cover are taken first; the first in product order on
    ties, the weights summed exactly), until none is left."""
    combos = [dict(zip(factors, levels)) for levels in itertools.product(*factors.values())]
    combos = [c for c in combos if allowed(c)]
    holders = {}
    for combo in combos:
        for pair in _pairs(combo):
            holders[pair] = holders.get(pair, 0) + 1
    uncovered = set(holders)
    cases = []
    while uncovered:
        best = max(combos, key=lambda c: sum(Fraction(1, holders[p])     # (exact: the
                                             for p in _pairs(c) & uncovered))  # same ties)
        cases.append(best)
        uncovered -= _pairs(best)
    return cases


CASES = pairwise_cases(FACTORS, feasible)
REPEATS_SLOW = 10          # --runslow: the case list this many times (100 launches)


def runs_cost_model(case):
    """Whether hylo's cost model runs in the job (MXNet's dist_sync has none; the
    workers' route's explicit options keep it off)."""
    return case["how"] != "run" and case["cost_model"] == "auto" and \
        case["route"] != "workers"


def _features(case):
    return {(name, level) for name, level in case.items()} | {
        ("how+route", (case["how"], case["route"])),
        ("how+cost model runs", (case["how"], runs_cost_model(case)))}


def default_cases(cases):
    """The cases of the default run: greedily, the case with the most features not
    taken yet (the first on ties), until every feature of ``cases`` is taken; the
    features: each factor's level, each launch with a route, each launch with its
    cost model running or not."""
    left = set().union(*map(_features, cases))
    chosen = []
    while left:
        best = max(cases, key=lambda c: len(_features(c) & left))
        chosen.append(best)
        left -= _features(best)
    return chosen


DEFAULT_CASES = default_cases(CASES)


def case_id(case):
    return "-".join([case["how"], case["route"], "cost_" + case["cost_model"],
                     case["store"], "uok_" + case["update_on_kvstore"],
                     "hybrid" if case["hybridize"] else "imperative",
                     "bn" if case["batchnorm"] else "nobn", case["init"]])


def hylo_options(case):
    options = dict(HYLO_ROUTE_OPTIONS[case["route"]])
    if case["cost_model"] == "off":
        options["cost_model"] = False
    return options


def case_args(case):
    args = ["--store", case["store"], "--update-on-kvstore", case["update_on_kvstore"],
            "--steps", str(STEPS)]
    if case["how"] == "run":
        pass                            # (job_command gives --kvstore dist_sync)
    elif case["store"] == "object":
        args += ["--hylo-options", json.dumps(hylo_options(case))]
    if case["hybridize"]:
        args.append("--hybridize")
    if case["batchnorm"]:
        args.append("--batchnorm")
    if case["init"] == "deferred":
        args.append("--deferred-init")
    return args


def test_the_cases_cover_every_feasible_pair():
    combos = [dict(zip(FACTORS, levels)) for levels in itertools.product(*FACTORS.values())]
    wanted = set().union(*(_pairs(c) for c in combos if feasible(c)))
    assert wanted == set().union(*map(_pairs, CASES))
    assert all(feasible(c) for c in CASES)
    # the least there can be: the servers' route 2 (with BatchNorm and without), the
    # workers' route 2 (over the parameter server and over Horovod), the store's
    # choice 3 (a kvstore string over each, and cost_model=False over Horovod, where
    # it has no other route), dist_sync 3 (update_on_kvstore unset, False, True)
    assert len(CASES) == 10


def test_the_default_launches_cover_every_level_route_and_cost_model():
    assert set().union(*map(_features, DEFAULT_CASES)) == \
        set().union(*map(_features, CASES))
    assert all(c in CASES for c in DEFAULT_CASES) and len(DEFAULT_CASES) == 7


def test_the_cases_cover_the_soak():
    """The launches spread over every Trainer construction, launch and cost model
    setting the start-up soak asks for."""
    for factor in ("how", "store", "update_on_kvstore", "init", "cost_model"):
        assert {c[factor] for c in CASES} == set(FACTORS[factor]), factor
    hylo = [c for c in CASES if c["how"] != "run"]
    assert {c["cost_model"] for c in hylo} == {"auto", "off"}
    assert any(c["cost_model"] == "auto" and c["store"] == "string" for c in hylo)


# -- the launches, under load ------------------------------------------------------------

@pytest.fixture(scope="module")
def cores_busy(request):
    """BUSY_LOOPS_SLOW busy loops at normal priority while this module's launches run
    under --runslow (none in the default run), each ended by its pid at teardown (a
    failed test included)."""
    procs = []
    loops = BUSY_LOOPS_SLOW if request.config.getoption("--runslow") else 0
    try:
        for _ in range(loops):
            procs.append(subprocess.Popen([PY, BUSY, str(3 * 3600)],
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def _launches():
    """Each case once (DEFAULT_CASES in the default run), then --runslow's further
    repeats of the list."""
    params = []
    for repeat in range(REPEATS_SLOW):
        for i, case in enumerate(CASES):
            launch = repeat * len(CASES) + i
            slow = repeat or case not in DEFAULT_CASES
            params.append(pytest.param(case, marks=[pytest.mark.slow] if slow else [],
                                       id="launch%03d-%s" % (launch, case_id(case))))
    return params


def expected_on_servers(case):
    """Whether the Trainer's optimizer must run on the servers; None: the store's
    measurement chooses."""
    if case["route"] == "dist_sync":
        return case["update_on_kvstore"] != "false"
    if case["route"] != "auto":
        return case["route"] == "servers"
    if case["how"] == "ps" and case["update_on_kvstore"] == "unset" and \
            case["cost_model"] == "auto":
        return None
    return False        # no servers, update_on_kvstore=False, or no cost model


@pytest.mark.parametrize("case", _launches())
def test_user_script_under_load(tmp_path, cores_busy, case):
    """Launched on shared cores (beside a busy loop under --runslow): rc 0 (no
    relaunch), both workers' trained parameters bitwise equal, an accuracy from the
    evaluation forward, the route and cost model the options ask for; save_states
    saves on either route of the hylo store, and raises MXNet's assertion under
    dist_sync with updates on the servers."""
    rc, text, reports = run_job(tmp_path, case["how"], case_args(case))
    assert all(p.poll() is None for p in cores_busy), "a busy loop ended"
    assert rc == 0 and reports, "%s %s: %s" % (case["how"], " ".join(case_args(case)),
                                               failure_text(rc, text))
    assert_workers_identical(reports)
    want_on_servers = expected_on_servers(case)
    for report in reports:
        assert isinstance(report["accuracy"], float) and 0 <= report["accuracy"] <= 1
        on_servers = report["update_on_kvstore"]
        if want_on_servers is not None:
            assert on_servers == want_on_servers, report
        if case["how"] != "run":
            assert report["route"]["route"] == ("servers" if on_servers else "workers"), \
                report
            assert report["cost_model"] == (case["cost_model"] == "auto" and
                                            case["route"] != "workers"), report
            if "policies" in report:
                compressed = [n for n, s in report["policies"].items() if s != "none"]
                # size_threshold=64 compresses the conv and dense weights; the
                # default threshold is above every layer of this net
                assert bool(compressed) == (case["route"] == "workers"), report
        saved = report["save_states"]
        if not on_servers or case["how"] != "run":
            assert saved == {"ok": True}, saved
            continue
        want_type, want_text = DIST_SYNC_ERROR
        assert not saved["ok"] and saved["type"] == want_type, saved
        assert saved["message"] == want_text, saved
