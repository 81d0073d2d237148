"""Parameter-server jobs in network namespaces, for the benchmarks (bench comm, bench
train): mxhylo.launch's own process handling (procs.Child, launch.Job: process groups,
a time limit, teardown, signals), started with ``ip netns exec`` per role, plus the
interface-counter marks the workers ask for around their timed steps."""
import json
import os
import signal
import sys

from . import horovod_jobs, netns
from .. import launch, procs


def clean_env():
    """This process's environment without DMLC_*/PS_* (an inherited DMLC_ROLE would make
    a child a parameter-server node; the harness sets each role's own)."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("DMLC_") or k.startswith("PS_"))}


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the benchmark: clean up and leave (exit 130)."""


class JobError(RuntimeError):
    def __init__(self, msg, log_tail=""):
        super().__init__(msg)
        self.log_tail = log_tail


def group_cpu_seconds(pgid):
    """CPU seconds (user + system, every thread) used so far by the live processes of
    process group ``pgid`` (a job's child leads its own group), from /proc; 10 ms steps
    (the kernel's clock ticks)."""
    tick = float(os.sysconf("SC_CLK_TCK"))
    total = 0
    for pid in [pgid] + [p for p in procs.group_members(pgid) if p != pgid]:
        try:
            with open("/proc/%d/stat" % pid, "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])      # utime, stime
    return total / tick


class NetnsJob(launch.Job):
    """mxhylo.launch's Job (process groups, time limit, teardown, signals) that also
    answers the workers' counter marks (``mark-NAME`` files in ``sync_dir``): it reads
    every role's interface counters and the CPU seconds of every role's processes
    (``cpu[NAME]``: child name -> seconds), and acknowledges with ``mark-NAME.ack``."""

    def __init__(self, children, topo, sync_dir, **kwargs):
        super().__init__(children, **kwargs)
        self.topo, self.sync_dir = topo, sync_dir
        self.counters, self.counter_errors, self.cpu = {}, [], {}

    def _serve_marks(self):
        try:
            names = os.listdir(self.sync_dir)
        except OSError:
            return
        for name in names:
            if not name.startswith("mark-") or name.endswith((".ack", ".tmp")):
                continue
            mark = name[len("mark-"):]
            if mark in self.counters:
                continue
            self.cpu[mark] = {c.name: group_cpu_seconds(c.pid)
                              for c in self.children if c.pid is not None}
            try:
                self.counters[mark] = self.topo.all_counters()
            except (netns.NetnsError, ValueError) as err:
                self.counters[mark] = None
                self.counter_errors.append("%s: %s" % (mark, err))
            open(os.path.join(self.sync_dir, name + ".ack"), "w").close()

    def _check(self):
        self._serve_marks()
        return super()._check()


def job_children(topo, num_workers, num_servers, port, config_path, job_dir, worker_module,
                 worker_threads=1, python=None):
    """procs.Child objects of one job: ``ip netns exec NS python ...`` per role, with the
    DMLC_* variables of mxhylo.launch's role_env (each node's own DMLC_NODE_HOST, as
    for a remote host) and its server defaults (one OpenMP thread). Workers run
    ``python -m WORKER_MODULE --config C --index I --out O``; worker_threads: their
    OMP_NUM_THREADS (0: not set)."""
    python = python or sys.executable
    base = clean_env()
    base["PYTHONUNBUFFERED"] = "1"
    sched = topo.addr("scheduler")
    children = []
    for role in topo.roles:
        kind = "scheduler" if role == "scheduler" else role.rstrip("0123456789")
        env = dict(base)
        if kind == "scheduler":
            env.update(launch.role_env("scheduler", num_workers, num_servers, sched, port))
            env["DMLC_NODE_HOST"] = sched
        else:
            env.update(launch.role_env(kind, num_workers, num_servers, sched, port, "ssh",
                                       node_host=topo.addr(role)))
        if kind == "server":
            env.update(launch.server_defaults(base))
        if kind == "worker":
            if worker_threads:
                env["OMP_NUM_THREADS"] = str(worker_threads)
            index = int(role[len("worker"):])
            program = [python, "-m", worker_module, "--config", config_path,
                       "--index", str(index), "--out", os.path.join(job_dir, role + ".json")]
            name = "worker %d" % index
        else:
            program = [python, "-c", "import mxnet"]
            name = kind if kind == "scheduler" else "server %s" % role[len("server"):]
        children.append(procs.Child(name, kind, topo.exec_prefix(role) + program, env))
    return children


def _tail(path, n=3000):
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_job(topo, job_dir, config, port, timeout, worker_module, worker_threads=1,
            marks=(), launcher="ps"):
    """One job of ``worker_module`` workers (their settings in ``config``, written to
    JOB_DIR/config.json); returns (worker results, {mark: interface counters},
    {mark: {child name ('worker 0', 'server 1', ...): CPU seconds at the mark}}).
    ``marks``: counter marks every run must have asked for. ``launcher``: 'ps' (a
    parameter-server job: scheduler, servers, workers) or 'horovod' (W workers with
    horovodrun's Gloo environment and a rendezvous server, no servers:
    mxhylo.bench.horovod_jobs); the workers find 'rendezvous_ready' in the config then."""
    W, S = config["num_workers"], config["num_servers"]
    sync_dir = os.path.join(job_dir, "sync")
    os.makedirs(sync_dir)
    config = dict(config, sync_dir=sync_dir, barrier_timeout=timeout, launcher=launcher)
    if launcher == "horovod":
        config["rendezvous_ready"] = os.path.join(job_dir, horovod_jobs.READY_FILE)
    elif launcher != "ps":
        raise ValueError("launcher must be 'ps' or 'horovod', got %r" % (launcher,))
    config_path = os.path.join(job_dir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    if launcher == "horovod":
        children = horovod_jobs.job_children(
            topo, W, port, config_path, job_dir, worker_module, worker_threads,
            gloo_timeout_s=max(60, min(int(timeout), horovod_jobs.GLOO_TIMEOUT_S)))
    else:
        children = job_children(topo, W, S, port, config_path, job_dir, worker_module,
                                worker_threads)
    log_path = os.path.join(job_dir, "job.log")
    with open(log_path, "w") as log:
        job = NetnsJob(children, topo, sync_dir, timeout=timeout, grace=5.0,
                       shutdown_timeout=30.0, out=log, err=log)
        code = job.run()
    if job.stop_signal is not None:
        if job.stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Interrupted("signal %d" % job.stop_signal)
    if code != 0:
        tail = _tail(log_path)
        reason = [l for l in tail.splitlines() if "job FAILED" in l]
        msg = reason[-1].split("] ", 1)[-1] if reason else "exit code %d" % code
        if "SIGKILL" in msg and "did not stop" not in tail:
            msg += (" (nothing in the job sent it: most likely the kernel's OOM killer, "
                    "see dmesg; a smaller --batch-size or fewer workers need less memory)")
        raise JobError(msg, tail)
    results = []
    for i in range(W):
        path = os.path.join(job_dir, "worker%d.json" % i)
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as err:
            raise JobError("worker %d's result %s: %s" % (i, path, err), _tail(log_path))
    if job.counter_errors:
        raise JobError("interface counters: " + "; ".join(job.counter_errors))
    missing = [m for m in marks if m not in job.counters]
    if missing:
        raise JobError("the workers never asked for the counter reads %s" % missing,
                       _tail(log_path))
    return results, job.counters, job.cpu
