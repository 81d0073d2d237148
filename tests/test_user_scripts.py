"""One user script (tests/user_scripts/train_eval.py: a small Gluon conv net on the
digits, trained a few steps, evaluated, its Trainer's states saved) run as real
multi-process jobs, the ways users start them:

* hylo over the parameter server:   python -m mxhylo.launch -n 2 -s S python SCRIPT
* hylo over Horovod:                horovodrun -np 2 -H localhost:2 --gloo python SCRIPT
* MXNet's dist_sync, unmodified:    python -m mxhylo.launch -n 2 -s S
                                        python -m mxhylo.run --kvstore dist_sync SCRIPT

The user-script matrix: a pairwise cover of the ways a script builds its net, store
and Trainer, and of the route the store takes; every case trains 2 workers in step
(bitwise equal parameters) and save_states either works or, where the Trainer's
optimizer runs on the parameter servers, says why it cannot.

The start-up soak: many short launches in a row, 2 workers + 2 servers, while two
busy loops load both cores; every launch must end well (10 launches, 100 with
--runslow).

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

from mxhylo import launch as mxhylo_launch
from mxhylo.kvstore.server_route import ServerUpdateStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "user_scripts", "train_eval.py")
BUSY = os.path.join(ROOT, "tests", "user_scripts", "busy.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
PY = sys.executable

JOB_TIMEOUT_S = 150          # the launcher's --timeout; the whole command gets 60 s more

# The launcher may start a job again when it fails by MXNet's start-up race; the soak
# measures start-up itself, so it turns that off with this flag (used only where this
# launcher has it).
NO_RELAUNCH = "--no-relaunch"
LAUNCH_HAS_NO_RELAUNCH = any(NO_RELAUNCH in action.option_strings
                             for action in mxhylo_launch.build_parser()._actions)


def _error_text(exc_type):
    try:
        ServerUpdateStore.save_optimizer_states(None, "unused")
    except exc_type as exc:
        return str(exc)
    raise AssertionError("ServerUpdateStore.save_optimizer_states saved")


# What save_states raises where the Trainer's optimizer runs on the servers: the hylo
# store's servers' route (its own message), MXNet's dist_sync (MXNet's assertion).
HYLO_SERVERS_ERROR = ("NotImplementedError", _error_text(NotImplementedError))
HYLO_SERVERS_PHRASE = "optimizer runs on the parameter servers"
DIST_SYNC_ERROR = ("AssertionError", "Cannot save states for distributed training")


# -- running a job -------------------------------------------------------------------------

def _processes_mentioning(text):
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def job_command(how, servers, script_args, no_relaunch=False):
    """The command line of a 2-worker job: how = 'ps' (hylo over the parameter
    server), 'horovod' (hylo over Horovod) or 'run' (dist_sync under mxhylo.run)."""
    if how == "horovod":
        return [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", PY, SCRIPT] + \
            script_args
    cmd = [PY, "-m", "mxhylo.launch", "-n", "2", "-s", str(servers),
           "--timeout", str(JOB_TIMEOUT_S)]
    if no_relaunch and LAUNCH_HAS_NO_RELAUNCH:
        cmd.append(NO_RELAUNCH)
    if how == "run":
        return cmd + [PY, "-m", "mxhylo.run", "--kvstore", "dist_sync", SCRIPT,
                      "--kvstore", "dist_sync"] + script_args
    return cmd + [PY, SCRIPT] + script_args


def run_job(tmp_path, how, script_args, servers=1, no_relaunch=False):
    """Run the job; returns (exit code, output, both workers' reports or None). The
    job's processes are all ended before this returns: its process group on timeout,
    and any process still naming the job's directory (each by pid)."""
    out = str(tmp_path / "report-{rank}.json")
    cmd = job_command(how, servers, script_args + ["--out", out], no_relaunch)
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
            leftover = _processes_mentioning(str(tmp_path) + os.sep)
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


# -- the user-script matrix --------------------------------------------------------------

# how: the launch (see job_command).
# route: where the Trainer's optimizer runs and what is compressed, forced by a hylo
#   store's options: 'servers' (server_update=True), 'workers' (server_update=False,
#   size_threshold=64 and no warm-up: this net's conv and dense weights compressed),
#   'workers_none' (server_update=False, nothing compressed); 'measured': the store's
#   defaults choose (a kvstore string gives Gluon's Trainer no options); 'dist_sync':
#   MXNet's store, whose optimizer runs on the servers unless update_on_kvstore=False.
FACTORS = {
    "how": ("ps", "horovod", "run"),
    "route": ("servers", "workers", "workers_none", "measured", "dist_sync"),
    "store": ("object", "string"),
    "update_on_kvstore": ("unset", "false"),
    "hybridize": (False, True),
    "batchnorm": (False, True),
    "init": ("zero_batch", "deferred"),
}

HYLO_ROUTE_OPTIONS = {
    "servers": {"server_update": True},
    "workers": {"server_update": False, "size_threshold": 64, "warmup_steps": 0},
    "workers_none": {"server_update": False, "policy": {".*": "none"}},
}


def feasible(case):
    """Whether a combination of FACTORS is a job a user can run."""
    if (case["how"] == "run") != (case["route"] == "dist_sync"):
        return False                    # dist_sync runs under mxhylo.run only
    if case["route"] == "dist_sync":
        return True
    if (case["store"] == "string") != (case["route"] == "measured"):
        return False                    # only a store object carries options
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


def case_id(case):
    return "-".join([case["how"], case["route"], case["store"],
                     "uok_" + case["update_on_kvstore"],
                     "hybrid" if case["hybridize"] else "imperative",
                     "bn" if case["batchnorm"] else "nobn", case["init"]])


def case_args(case, steps=6):
    args = ["--store", case["store"], "--update-on-kvstore", case["update_on_kvstore"],
            "--steps", str(steps)]
    if case["how"] == "run":
        pass                            # (job_command gives --kvstore dist_sync)
    elif case["store"] == "object":
        args += ["--hylo-options", json.dumps(HYLO_ROUTE_OPTIONS[case["route"]])]
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
    # the least there can be: hylo over the parameter server needs 5 (one per route,
    # and the servers' route twice, with and without BatchNorm), Horovod 3 (its 3
    # routes), dist_sync 2 (update_on_kvstore unset and False)
    assert len(CASES) == 10


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_user_script(tmp_path, case):
    """rc 0, both workers' trained parameters bitwise equal, an accuracy; save_states
    saves, except where the Trainer's optimizer runs on the servers, where it raises
    the store's error naming why (the same text whatever the net)."""
    rc, text, reports = run_job(tmp_path, case["how"], case_args(case))
    assert rc == 0 and reports, failure_text(rc, text)
    assert_workers_identical(reports)
    for report in reports:
        assert isinstance(report["accuracy"], float) and 0 <= report["accuracy"] <= 1
        on_servers = report["update_on_kvstore"][0]
        if case["route"] == "servers":
            assert on_servers, report
        elif case["route"] == "dist_sync":
            assert on_servers == (case["update_on_kvstore"] == "unset"), report
        elif case["route"] != "measured":           # 'measured': whatever was chosen
            assert not on_servers, report
        if case["how"] != "run":
            if case["route"] in ("workers", "workers_none"):
                policies = report["policies"]
                compressed = [n for n, s in policies.items() if s != "none"]
                assert bool(compressed) == (case["route"] == "workers"), policies
        saved = report["save_states"][0]
        if not on_servers:
            assert saved == {"ok": True}, saved
            continue
        want_type, want_text = DIST_SYNC_ERROR if case["how"] == "run" else \
            HYLO_SERVERS_ERROR
        assert not saved["ok"] and saved["type"] == want_type, saved
        assert saved["message"] == want_text, saved
        if case["how"] != "run":
            assert HYLO_SERVERS_PHRASE in saved["message"]


# -- the start-up soak ---------------------------------------------------------------------

SOAK_LAUNCHES = 10                # the default run
SOAK_LAUNCHES_SLOW = 100          # with --runslow
SOAK_STEPS = 2

# Spread over the launches in turn: (how, the script's arguments).
SOAK_CONFIGS = [
    # hylo over the parameter server, every default (cost model on, route measured)
    ("ps", ["--store", "object"]),
    ("ps", ["--store", "string", "--update-on-kvstore", "false"]),
    ("ps", ["--store", "object", "--deferred-init", "--hybridize"]),
    ("ps", ["--store", "object", "--hylo-options", '{"cost_model": false}', "--batchnorm"]),
    # two Trainers on one hylo store, each with half of the net's parameters
    ("ps", ["--store", "object", "--two-trainers", "--update-on-kvstore", "false"]),
    ("ps", ["--store", "object", "--two-trainers", "--hylo-options",
            '{"cost_model": false}']),
    # MXNet's dist_sync under mxhylo.run: update_on_kvstore unset, True, False
    ("run", ["--store", "string", "--batchnorm"]),
    ("run", ["--store", "object", "--update-on-kvstore", "true", "--deferred-init"]),
    ("run", ["--store", "object", "--update-on-kvstore", "false", "--hybridize"]),
    # hylo over Horovod (cost model on: its defaults)
    ("horovod", ["--store", "object", "--deferred-init"]),
]


@pytest.fixture(scope="class")
def both_cores_busy():
    """Two busy loops at normal priority for the soak's duration, ended by pid."""
    procs = [subprocess.Popen([PY, BUSY, str(3 * 3600)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def _soak_params():
    marks = lambda i: [pytest.mark.slow] if i >= SOAK_LAUNCHES else []
    return [pytest.param(i, marks=marks(i), id="launch%03d-%s" % (
        i, SOAK_CONFIGS[i % len(SOAK_CONFIGS)][0])) for i in range(SOAK_LAUNCHES_SLOW)]


@pytest.mark.usefixtures("both_cores_busy")
class TestStartupUnderLoad:
    @pytest.mark.parametrize("launch", _soak_params())
    def test_launch_trains_in_step(self, tmp_path, launch):
        """A short job (2 workers + 2 servers, 2 steps, an evaluation) started with
        both cores loaded ends with rc 0 and bitwise equal workers."""
        how, args = SOAK_CONFIGS[launch % len(SOAK_CONFIGS)]
        rc, text, reports = run_job(tmp_path, how, args + ["--steps", str(SOAK_STEPS)],
                                    servers=2, no_relaunch=True)
        assert rc == 0 and reports, "launch %d (%s %s): %s" % (
            launch, how, " ".join(args), failure_text(rc, text))
        assert_workers_identical(reports)
