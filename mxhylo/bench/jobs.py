"""The benchmarks' one job runner.

A job is a parameter-server job (scheduler, servers, workers) or a Horovod job (W
processes with horovodrun's Gloo environment, no servers), as the mode says
(mxhylo.bench.modes). Every worker runs ``python -m mxhylo.bench.worker CONFIG`` and
writes JOB_DIR/result-RANK.json. A job has a time limit, and nothing of it outlives it
(process groups, SIGTERM then SIGKILL, the children die with the harness).

Where it runs:

* in the emulated cluster (a netns.Topology): each process in its role's namespace,
  run by mxhylo.launch's Job, which here also answers the workers' requests (marks) to
  read every role's interface counters and CPU seconds around their timed steps. For
  Horovod, each worker gets the variables horovodrun's Gloo mode would give it
  (:func:`slot_env`, :func:`run_env`) and horovodrun's own rendezvous server runs in
  the scheduler's namespace (rendezvous.py);
* on this machine (no topology): ``python -m mxhylo.launch`` or ``horovodrun``, or
  with no servers one process and no job.
"""
import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from . import netns, rendezvous, report
from .modes import mode
from .. import launch, procs

PS_PORT = 9091                 # inside the namespaces, which only this run uses
RENDEZVOUS_PORT_OFFSET = 1000
GLOO_TIMEOUT_S = 300


class JobError(RuntimeError):
    def __init__(self, msg, log_tail=""):
        super().__init__(msg)
        self.log_tail = log_tail


class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the benchmark: clean up and leave (exit 130)."""


def horovod_available():
    """Whether horovod.mxnet is built here (without importing it)."""
    import importlib.util
    try:
        return importlib.util.find_spec("horovod.mxnet.mpi_lib") is not None
    except (ImportError, ValueError):
        return False


def clean_env(environ=None):
    """The environment without DMLC_*, PS_* and HOROVOD_* (a child must get only its own
    role's), Python unbuffered."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if not k.startswith(("DMLC_", "PS_", "HOROVOD_"))}
    out["PYTHONUNBUFFERED"] = "1"
    return out


def slot_env(rank, hosts):
    """horovodrun's per-process variables (gloo_run.create_slot_env_vars) of ``rank``,
    ``hosts`` naming each rank's host: a host's ranks are consecutive, the local rank
    counts them within the host, the cross rank the hosts having that local rank."""
    if not 0 <= rank < len(hosts):
        raise ValueError("rank %d out of range for %d processes" % (rank, len(hosts)))
    order = list(collections.OrderedDict.fromkeys(hosts))
    for h in order:
        idx = [i for i, x in enumerate(hosts) if x == h]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError("the processes of host %s must have consecutive ranks" % h)
    host = hosts[rank]
    local = hosts[:rank].count(host)
    cross = [h for h in order if hosts.count(h) > local]
    return {"HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(len(hosts)), "HOROVOD_LOCAL_RANK": str(local),
            "HOROVOD_LOCAL_SIZE": str(hosts.count(host)),
            "HOROVOD_CROSS_RANK": str(cross.index(host)), "HOROVOD_CROSS_SIZE": str(len(cross))}


def run_env(addr, port, iface=netns.DEV, timeout_s=GLOO_TIMEOUT_S):
    """horovodrun --gloo's job-wide variables (gloo_run.create_run_env_vars)."""
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": str(addr),
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(int(port)), "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface,
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout_s))}


def group_cpu_seconds(pgid):
    """CPU seconds (user + system) used so far by the live processes of group ``pgid``."""
    total = 0
    for pid in set([pgid] + procs.group_members(pgid)):
        try:
            with open("/proc/%d/stat" % pid, "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / float(os.sysconf("SC_CLK_TCK"))


class NetnsJob(launch.Job):
    """mxhylo.launch's Job that also answers the workers' marks (``mark-NAME`` files in
    ``sync_dir``): it reads every role's interface counters into ``counters[NAME]`` and
    every child's CPU seconds into ``cpu[NAME]``, then writes ``mark-NAME.ack``."""

    def __init__(self, children, topo, sync_dir, **kwargs):
        super().__init__(children, **kwargs)
        self.topo, self.sync_dir = topo, sync_dir
        self.counters, self.cpu, self.errors = {}, {}, []

    def serve_marks(self):
        for name in os.listdir(self.sync_dir):
            mark = name[len("mark-"):]
            if not name.startswith("mark-") or name.endswith((".ack", ".tmp")) \
                    or mark in self.counters:
                continue
            self.cpu[mark] = {c.name: group_cpu_seconds(c.pid) for c in self.children
                              if c.pid is not None}
            try:
                self.counters[mark] = self.topo.all_counters()
            except (netns.NetnsError, ValueError) as err:
                self.counters[mark] = None
                self.errors.append("%s: %s" % (mark, err))
            open(os.path.join(self.sync_dir, name + ".ack"), "w").close()

    def _check(self):
        self.serve_marks()
        return super()._check()


def children(topo, cfg, config_path, port, worker_threads=1):
    """procs.Child objects of one job in the emulated cluster: ``ip netns exec NS ...``
    per role, with the variables mxhylo.launch gives a remote node."""
    W, S = cfg["workers"], cfg["servers"]
    base = clean_env()
    worker = [sys.executable, "-m", "mxhylo.bench.worker", config_path]
    threads = {"OMP_NUM_THREADS": str(worker_threads)} if worker_threads else {}
    sched = topo.addr("scheduler")
    if cfg["launch"] == "horovod":
        hosts = [topo.addr("worker%d" % i) for i in range(W)]
        rport = port + RENDEZVOUS_PORT_OFFSET
        server = [sys.executable, "-I", rendezvous.__file__, str(rport), ",".join(hosts),
                  cfg["rendezvous_ready"]] + [result_path(cfg, i) for i in range(W)]
        out = [procs.Child("rendezvous", "scheduler", topo.exec_prefix("scheduler") + server,
                           base)]
        for i in range(W):
            env = dict(base, **run_env(sched, rport, timeout_s=min(cfg["timeout"],
                                                                    GLOO_TIMEOUT_S)))
            env.update(slot_env(i, hosts), **threads)
            # its own UTS namespace: the worker takes its address as host name (worker.py)
            out.append(procs.Child("worker %d" % i, "worker", topo.exec_prefix(
                "worker%d" % i) + ["unshare", "--uts", "--"] + worker, env))
        return out
    out = []
    for role in topo.roles:
        kind = role.rstrip("0123456789")
        env = dict(base)
        if kind == "scheduler":
            env.update(launch.role_env(kind, W, S, sched, port), DMLC_NODE_HOST=sched)
        else:
            env.update(launch.role_env(kind, W, S, sched, port, "ssh",
                                       node_host=topo.addr(role)))
        if kind == "server":
            env.update(launch.server_defaults(base))
        if kind == "worker":
            env.update(threads)
        program = worker if kind == "worker" else [sys.executable, "-c", "import mxnet"]
        name = kind if kind == "scheduler" else "%s %s" % (kind, role[len(kind):])
        out.append(procs.Child(name, kind, topo.exec_prefix(role) + program, env))
    return out


def result_path(cfg, rank):
    return os.path.join(cfg["job_dir"], "result-%d.json" % rank)


def tail(path, n=3000):
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def local_command(cfg, config_path, worker_threads=1):
    """The command of a job on this machine: the user's launchers (python -m
    mxhylo.launch, horovodrun), or with no servers one process."""
    worker = [sys.executable, "-m", "mxhylo.bench.worker", config_path]
    W, S = str(cfg["workers"]), str(cfg["servers"])
    if cfg["launch"] == "horovod":
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        return [horovodrun if os.path.exists(horovodrun) else "horovodrun", "--gloo",
                "-np", W, "-H", "localhost:" + W] + worker
    if cfg["servers"] == 0:
        return worker
    return [sys.executable, "-m", "mxhylo.launch", "-n", W, "-s", S, "--timeout",
            str(cfg["timeout"]), "--env", "OMP_NUM_THREADS:%d" % worker_threads] + worker


def run_local(cmd, timeout, log_path, env):
    """Runs ``cmd`` in a process group of its own that dies with the harness; stops the
    group after ``timeout``; returns its exit code (124 on timeout)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=procs.die_with_parent())
        try:
            return proc.wait(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            log.write("the job ran past its time limit of %.0f s\n" % timeout)
            return 124
        finally:
            if proc.poll() is None or procs.group_members(proc.pid):
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except OSError:
                        break
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass


def run_job(cfg, job_dir, timeout, topo=None, port=PS_PORT, worker_threads=1):
    """One job of ``cfg`` (task, mode, workers, servers and the task's settings), in
    ``topo`` or on this machine. Returns (worker results by rank, {mark: {role: (tx,
    rx)}}, {mark: {child: CPU seconds}}); JobError when it failed."""
    cfg = dict(cfg, job_dir=job_dir, sync_dir=os.path.join(job_dir, "sync"),
               timeout=timeout, launch=mode(cfg["mode"]).launch, marks=topo is not None)
    if topo is not None and cfg["launch"] == "horovod":
        cfg["rendezvous_ready"] = os.path.join(job_dir, "rendezvous.ready")
    os.makedirs(cfg["sync_dir"])
    config_path = os.path.join(job_dir, "config.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    log_path = os.path.join(job_dir, "job.log")
    counters, cpu, errors = {}, {}, []
    if topo is None:
        env = dict(clean_env(), OMP_NUM_THREADS=str(worker_threads))
        code = run_local(local_command(cfg, config_path, worker_threads), timeout,
                         log_path, env)
    else:
        with open(log_path, "w") as log:
            job = NetnsJob(children(topo, cfg, config_path, port, worker_threads), topo,
                           cfg["sync_dir"], timeout=timeout, grace=5.0,
                           shutdown_timeout=30.0, out=log, err=log)
            code = job.run()
        if job.stop_signal is not None:
            raise KeyboardInterrupt if job.stop_signal == signal.SIGINT else Interrupted()
        counters, cpu, errors = job.counters, job.cpu, job.errors
    if code != 0:
        text = tail(log_path)
        failed = [l for l in text.splitlines() if "job FAILED" in l]
        msg = failed[-1].split("] ", 1)[-1] if failed else "exit code %d" % code
        if "SIGKILL" in msg and "did not stop" not in text:
            msg += " (not sent by the job: most likely the kernel's OOM killer, see dmesg)"
        raise JobError(msg, text)
    results = []
    for rank in range(1 if cfg["servers"] == 0 and cfg["launch"] == "ps" else cfg["workers"]):
        try:
            with open(result_path(cfg, rank)) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as err:
            raise JobError("the result of rank %d: %s" % (rank, err), tail(log_path))
    if errors or (topo is not None and not {"start", "end"} <= set(counters)):
        raise JobError("interface counters: %s" % ("; ".join(errors) or "never read"),
                       tail(log_path))
    return results, counters, cpu


def over_rates(suite, args, run_rate, log):
    """``run_rate(args)`` at each rate of --rate: its record, or with several rates the
    sweep record of them all (report.sweep)."""
    rates = [r.strip() for r in str(args.rate).split(",") if r.strip()]
    reason = netns.check_capable()
    if reason:
        raise SystemExit("mxhylo.bench %s: %s" % (suite, reason))
    if len(rates) == 1:
        return run_rate(args)
    per_rate = {}
    for rate in rates:
        log("=== rate %s ===" % rate)
        per_rate[rate] = run_rate(argparse.Namespace(**dict(vars(args), rate=rate)))
    out = report.sweep(suite, rates, per_rate)
    for line in out["table"]:
        log(line)
    return out


def unavailable(name):
    """Why mode ``name`` cannot run here, as a record's status, or None."""
    if mode(name).launch == "horovod" and not horovod_available():
        return {"status": "skipped: horovod.mxnet is not installed"}
    return None


class Run:
    """One benchmark run in the emulated cluster: ``with Run(topo, keep_tmp, log) as
    run:`` creates the namespaces and a job folder (``run.tmp``), turns SIGTERM and
    SIGHUP into an interruption, and at the end, however it ends, deletes the
    namespaces and the folder (kept with ``keep_tmp`` or when ``run.failed``)."""

    def __init__(self, topo, keep_tmp, log):
        self.topo, self.keep_tmp, self.log, self.failed = topo, keep_tmp, log, False

    def __enter__(self):
        def interrupt(signum, frame):
            raise Interrupted()
        self.old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        self.tmp = tempfile.mkdtemp(prefix="mxhylo-bench-")
        netns.remove_stale()
        try:
            self.topo.create()
        except BaseException as err:
            self.__exit__(type(err), err, None)
            raise
        self.log("namespaces %s* up: %d roles" % (self.topo.prefix, len(self.topo.roles)))
        return self

    def job(self, cfg, name, timeout, port, worker_threads=1):
        """((results, counters, cpu), None) of one job in this run, or (None, its failed
        status) with its log kept."""
        job_dir = os.path.join(self.tmp, name)
        os.makedirs(job_dir)
        self.log("%s (time limit %.0f s)..." % (name, timeout))
        try:
            return run_job(cfg, job_dir, timeout, self.topo, port, worker_threads), None
        except JobError as err:
            self.failed = True
            self.log("  FAILED: %s\n%s" % (err, err.log_tail[-1500:]))
            return None, {"status": "failed: %s" % err, "log_tail": err.log_tail}

    def __exit__(self, exc_type, exc, tb):
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a cleanup cut short
        for s in self.old:                                      # would leave namespaces
            signal.signal(s, signal.SIG_IGN)
        try:
            errors = self.topo.destroy()
            if errors:
                self.log("could not delete: %s" % "; ".join(errors))
            if self.keep_tmp or self.failed:
                self.log("job files kept in " + self.tmp)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, old_int)
            for s, h in self.old.items():
                signal.signal(s, h)
        if exc_type is not None and issubclass(exc_type, netns.NetnsError):
            raise SystemExit("network namespaces: %s" % exc)
        if exc_type is not None and issubclass(exc_type, (Interrupted, KeyboardInterrupt)):
            self.log("interrupted: cleaned up")
            raise SystemExit(130)
        return False


@contextlib.contextmanager
def local_folder(keep=False):
    """A job folder on this machine, removed at the end unless ``keep``; SIGTERM and
    SIGHUP end the run like Ctrl-C (its job stopped, exit 130)."""
    def interrupt(signum, frame):
        raise Interrupted()
    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    tmp = tempfile.mkdtemp(prefix="mxhylo-bench-")
    try:
        yield tmp
    except (Interrupted, KeyboardInterrupt):
        raise SystemExit(130)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
