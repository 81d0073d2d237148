"""Helpers shared by the tests that start jobs of several processes."""
import os


def processes_mentioning(text):
    """Pids of this machine's processes (not this one) whose command line contains
    ``text``: what a job left behind, found by a marker the test put in its command."""
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


def clean_env(**extra):
    """This environment minus any DMLC_*/PS_*/MXHYLO_* a surrounding job may have set,
    with unbuffered Python output, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "PS_", "MXHYLO_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def launched_pids(pid_file):
    """The pids mxhylo.launch --pid-file wrote (each the leader of its own process
    group)."""
    import json
    with open(pid_file) as f:
        return [c["pid"] for c in json.load(f)["children"]]


def end_groups(pids, wait_s=5):
    """Wait up to ``wait_s`` for these group leaders to end; then kill every group with a
    member left. Returns the pids that had to be killed (a test fails on them)."""
    import signal
    import time
    from mxhylo import procs
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(procs.pid_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if procs.pid_alive(p) or procs.group_members(p)]
    for p in left:
        try:
            os.killpg(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def run_quiet(cmd, timeout, cwd):
    """Run ``cmd`` to its end (at most ``timeout`` s) with one OpenMP thread a process
    (several share a small machine) and no inherited DMLC role; (exit code, output)."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DMLC_ROLE", None)
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout, cwd=cwd, env=env)
    return res.returncode, res.stdout


def run_bounded_job(cmd, folder, timeout_s, cwd):
    """Run a launcher command whose job is bounded by its own --timeout ``timeout_s``;
    (exit code, output). A launcher that outlives its bound gets SIGTERM (it tears its
    job down), then SIGKILL; any process left behind (found by ``folder``, on every
    process's command line) is killed by pid."""
    import signal
    import subprocess
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        out = "(the launcher outlived its bound)\n" + out
    finally:
        for pid in processes_mentioning(str(folder)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return proc.returncode, out
