"""Horovod jobs in the benchmarks' network namespaces (bench comm, bench train).

horovodrun starts its processes through ssh (or locally, in its own namespace), so the
benchmarks start them themselves, as they start ps-lite's roles (mxhylo.bench.jobs):
one worker process per worker namespace, with the environment horovodrun's Gloo mode
gives each process (horovod/runner/gloo_run.py: create_slot_env_vars and
create_run_env_vars):

* HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE,
  HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE and HOROVOD_HOSTNAME, from horovodrun's slot
  assignment (horovod.runner.common.util.hosts.get_host_assignments): every worker
  namespace is a host of one slot, named by its address, so local rank 0 of local
  size 1, cross rank = rank of cross size W (:func:`slot_env`);
* HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT (Horovod's HTTP rendezvous server),
  HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE=eth0 (the
  namespace's one link: Gloo's ring runs over the shaped links) and
  HOROVOD_GLOO_TIMEOUT_SECONDS (:func:`run_env`).

The rendezvous server is horovodrun's own (horovod.runner.http.http_server's
RendezvousHTTPServer, initialised with the same slot plan). The benchmark process lives
in the host's namespace, which has no route to the namespaces' subnet (the bridge sits
in a hub namespace with no address), so the server runs as a child process in the
scheduler's namespace, unused otherwise in these modes: ``python -I horovod_jobs.py
rendezvous ...`` (run by path, isolated: it imports neither mxhylo nor mxnet). It
writes a ready file once it listens (workers wait for it before hvd.init) and exits
by itself once every worker has written its result; Gloo needs it only while the
workers connect (hvd.init). It is a child of the same launch.Job as the workers
(process group, time limit, teardown, no orphans). There are no servers and no
ps-lite scheduler in these modes.

This module imports only the standard library at the top, so that it runs as a script.
"""
import argparse
import collections
import os
import sys
import time

HOROVOD_MODES = ("horovod_dense", "horovod_fp16", "hylo_horovod")
IFACE = "eth0"                      # mxhylo.bench.netns.DEV
READY_FILE = "rendezvous.ready"
RENDEZVOUS_PORT_OFFSET = 1000       # rendezvous port = the job's ps-lite port + this
GLOO_TIMEOUT_S = 300                # hvd.init waits this long for every peer


def horovod_available():
    """Whether horovod.mxnet is installed and built (its extension module present),
    without importing it."""
    import importlib.util
    try:
        return importlib.util.find_spec("horovod.mxnet.mpi_lib") is not None
    except (ImportError, ValueError):
        return False


def slot_env(rank, hosts):
    """horovodrun's per-process variables (gloo_run.create_slot_env_vars) of ``rank``,
    ranks given in order by ``hosts`` (one entry per process: its host name). As
    horovod's get_host_assignments: a host's processes take consecutive ranks, the local
    rank counts them within the host, the cross rank counts the hosts that have that
    local rank."""
    hosts = list(hosts)
    if not 0 <= rank < len(hosts):
        raise ValueError("rank %d out of range for %d processes" % (rank, len(hosts)))
    order = list(collections.OrderedDict.fromkeys(hosts))
    for h in order:          # horovod assigns ranks host by host
        idx = [i for i, x in enumerate(hosts) if x == h]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError("the processes of host %s must have consecutive ranks" % h)
    host = hosts[rank]
    local_rank = hosts[:rank].count(host)
    local_size = hosts.count(host)
    with_local = [h for h in order if hosts.count(h) > local_rank]
    return {"HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(len(hosts)), "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(with_local.index(host)),
            "HOROVOD_CROSS_SIZE": str(len(with_local))}


def run_env(rendezvous_addr, rendezvous_port, iface=IFACE, timeout_s=GLOO_TIMEOUT_S):
    """horovodrun --gloo's job-wide variables (gloo_run.create_run_env_vars) and the
    Gloo time limit of hvd.init."""
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": str(rendezvous_addr),
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(int(rendezvous_port)),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": iface, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout_s))}


def base_env(environ=None):
    """The harness's environment without DMLC_*/PS_* (no child may become a ps-lite
    node) and without inherited HOROVOD_* (a harness started under horovodrun must not
    hand its own rank to the workers)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if not k.startswith(("DMLC_", "PS_", "HOROVOD_"))}


def worker_hosts(topo, num_workers):
    """Host names of the W worker processes in rank order: their namespaces'
    addresses (one host, one slot each)."""
    return [topo.addr("worker%d" % i) for i in range(num_workers)]


def rendezvous_port(ps_port):
    return int(ps_port) + RENDEZVOUS_PORT_OFFSET


def job_children(topo, num_workers, port, config_path, job_dir, worker_module,
                 worker_threads=1, python=None, gloo_timeout_s=GLOO_TIMEOUT_S):
    """procs.Child objects of one Horovod job: the rendezvous server in the scheduler's
    namespace (role 'scheduler': launch.Job watches it as a non-worker) and one worker
    per worker namespace, ``python -m WORKER_MODULE --config C --index I --out O`` with
    horovodrun's variables; worker_threads: their OMP_NUM_THREADS (0: not set)."""
    from .. import procs
    python = python or sys.executable
    hosts = worker_hosts(topo, num_workers)
    rport = rendezvous_port(port)
    base = base_env()
    base["PYTHONUNBUFFERED"] = "1"
    outs = [os.path.join(job_dir, "worker%d.json" % i) for i in range(num_workers)]
    server = [python, "-I", os.path.abspath(__file__), "rendezvous", "--port", str(rport),
              "--hosts", ",".join(hosts), "--ready", os.path.join(job_dir, READY_FILE),
              "--until"] + outs
    children = [procs.Child("rendezvous", "scheduler", topo.exec_prefix("scheduler") + server,
                            dict(base))]
    common = run_env(topo.addr("scheduler"), rport, IFACE, gloo_timeout_s)
    for i in range(num_workers):
        env = dict(base)
        env.update(common)
        env.update(slot_env(i, hosts))
        if worker_threads:
            env["OMP_NUM_THREADS"] = str(worker_threads)
        program = [python, "-m", worker_module, "--config", config_path, "--index", str(i),
                   "--out", outs[i]]
        # its own UTS namespace: the worker names itself HOROVOD_HOSTNAME (own_hostname)
        children.append(procs.Child("worker %d" % i, "worker", topo.exec_prefix(
            "worker%d" % i) + ["unshare", "--uts", "--"] + program, env))
    return children


def own_hostname(environ=None):
    """In a worker (own UTS namespace, see job_children): set the host name to
    HOROVOD_HOSTNAME, its namespace's address. Horovod 0.28 builds its process-set
    Gloo context on a device found from the machine's host name, not from
    HOROVOD_GLOO_IFACE: with the machine's name it resolves to 127.0.0.1 and the
    workers, each behind its own loopback, cannot connect (seen here)."""
    import socket
    env = os.environ if environ is None else environ
    socket.sethostname(env["HOROVOD_HOSTNAME"])


def wait_ready(path, timeout, poll=0.01):
    """A worker's wait for the rendezvous server's ready file (before hvd.init)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("Horovod's rendezvous server did not start within %.0f s "
                               "(%s missing)" % (timeout, path))
        time.sleep(poll)


# ----------------------------------------------------------------------------- server

def hosts_arg(hosts):
    """horovodrun's -H form of a rank-ordered host list: 'a:2,b:1'."""
    counts = collections.OrderedDict()
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    return ",".join("%s:%d" % kv for kv in counts.items())


def slot_plan(hosts):
    """Horovod's own slot plan (SlotInfo list, rank order) for ``hosts``."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    return get_host_assignments(parse_hosts(hosts_arg(hosts)), len(hosts))


def serve_rendezvous(port, hosts, ready, until, timeout=24 * 3600.0, poll=0.05):
    """Horovod's HTTP rendezvous server on ``port`` (all addresses of this namespace),
    initialised with the slot plan of ``hosts``; writes ``ready`` once listening;
    returns once every file of ``until`` exists (or after ``timeout``)."""
    import threading
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    httpd = RendezvousHTTPServer(("", int(port)), RendezvousHandler, 0)
    httpd.init(slot_plan(hosts))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    with open(ready + ".tmp", "w") as f:
        f.write("%d\n" % int(port))
    os.rename(ready + ".tmp", ready)
    print("rendezvous: listening on port %d for %d processes" % (port, len(hosts)),
          flush=True)
    deadline = time.monotonic() + timeout
    try:
        while not all(os.path.exists(p) for p in until):
            if time.monotonic() > deadline:
                print("rendezvous: gave up waiting after %.0f s" % timeout, flush=True)
                return 1
            time.sleep(poll)
    finally:
        httpd.shutdown()
        httpd.server_close()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="horovod_jobs.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rendezvous", help="Horovod's rendezvous server for one job")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hosts", required=True, help="comma-separated, one per rank")
    p.add_argument("--ready", required=True, help="file written once listening")
    p.add_argument("--until", nargs="+", required=True,
                   help="exit once all these files exist (the workers' results)")
    p.add_argument("--timeout", type=float, default=24 * 3600.0)
    args = parser.parse_args(argv)
    return serve_rendezvous(args.port, args.hosts.split(","), args.ready, args.until,
                            args.timeout)


if __name__ == "__main__":
    sys.exit(main())
