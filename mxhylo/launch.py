"""Start a parameter-server job: ``python -m mxhylo.launch -n W -s S [options] CMD...``.

Starts one scheduler, S servers and W workers, all running the same CMD (as MXNet's
tools/launch.py does: a server or scheduler process enters ps-lite's loop when it
imports mxnet), with the environment MXNet's launcher would give each role. Each
role's output is streamed with a prefix such as ``[worker 0] `` (the launch index,
which is not kv.rank: ranks are assigned by the scheduler in arrival order).

The job ends when every worker has exited 0 (servers and scheduler then stop by
themselves), or as soon as a worker fails, any server or the scheduler exits while
workers still run, --timeout passes, or the launcher gets SIGINT/SIGTERM/SIGHUP.
Then every process group still alive gets SIGTERM, and SIGKILL after --grace
seconds; the exit code is non-zero and the last line names the process, why it
ended, and its last words: MXNet's check message ("Check failed: ...") when it
printed one, else its last line. A job whose server or scheduler failed ends
within 5 s of that failure.

MXNet's start-up race: MXNet 1.9.1's parameter server rarely aborts at start-up, a
server on "Check failed: !stored.is_none(): init N first" or a worker on "Check
failed: msg.data.size() >= (size_t)2", when a key is used before rank 0's initial
value of it is stored. Nothing has trained then, so when the job's first failure
is one of these, the launcher stops it, says so in one line, and starts the whole
job again with a fresh scheduler port (unless --port): at most twice, 3 attempts
in all (--no-relaunch: never). --timeout counts for each attempt; the exit code is
the last attempt's. (Processes that import mxhylo are not exposed to the race.)

Network: ps-lite has no authentication, and the servers run what the workers send
them (MXNet's servers unpickle the optimizer; mxhylo's decoder trusts every peer):
run jobs only on a network whose hosts you trust. Every process listens on one IPv4
address, never on all interfaces: that of --interface NAME (or of DMLC_INTERFACE,
when the launching shell sets it); by default the one that reaches the scheduler:
loopback (127.0.0.1) for a local job; for an ssh job, the launching host's address
towards the hostfile's hosts, and each remote process its hostfile address.
"""
import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from mxhylo import procs

ROLES = ("scheduler", "server", "worker")

# Variables dmlc-tracker's ssh launcher copies from the launching shell to every remote
# node when they are set. (It also copies AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; we
# do not put credentials on a command line that `ps` shows: pass them with --env.)
SSH_PASSTHROUGH = ("OMP_NUM_THREADS", "KMP_AFFINITY", "LD_LIBRARY_PATH", "DMLC_INTERFACE")

EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 1, 2, 124

# A server or the scheduler that dies while workers run leaves them nothing to finish
# (their next exchange waits forever): the job then ends within this many seconds of
# the death, whatever --grace says. TEARDOWN_TAIL_S of it is kept, after the SIGTERM
# grace, for SIGKILL, reaping, the last output and the launcher's own exit.
DEAD_PEER_END_S = 5.0
TEARDOWN_TAIL_S = 2.0

# MXNet 1.9.1's start-up race in ps-lite: rarely, a server receives a worker's pull (or
# pushpull) of a key before rank 0's init of that key is stored there and aborts on
# the first check below; or a worker gets an empty answer to such a pull and aborts
# on the second. Either means a key was used before its initial value was stored,
# which in a Gluon or Module script only happens before that key's first training
# step (both initialize every key, then pull it, before they train): nothing had
# trained yet, and starting the job again loses nothing. (role, pattern searched in
# the text after "Check failed:".)
STARTUP_RACE = (("server", re.compile(r"^!stored\.is_none\(\):? *init \S+ first")),
                ("worker", re.compile(r"^msg\.data\.size\(\) >= \(size_t\)2\b")))
MAX_RELAUNCHES = 2      # so at most 3 attempts in all

# Defaults for server processes, below the shell's own variables, --env and --env-server. A server runs one small
# operation after another (sums of pushes, hylo's codecs) on its request thread; with
# OpenMP teams their idle threads spin between operations (measured: 62% of a
# server's CPU time in libgomp's wait loop, resnet50_v1b, 4 workers + 2 servers on 2
# cores), time the workers on the same cores need. One thread: exchange 0.42 s
# instead of 0.9 s per step there.
SERVER_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def server_defaults(environ):
    """SERVER_DEFAULTS that the launching shell's ``environ`` does not set itself."""
    return {k: v for k, v in SERVER_DEFAULTS.items() if k not in environ}


# ----------------------------------------------------------------------------- environment

def role_env(role, num_workers, num_servers, root_uri, root_port, launcher="local",
             task_id=None, node_host=None):
    """The variables MXNet's tools/launch.py (dmlc-tracker) sets for one process.

    scheduler (always started on the launching host): DMLC_ROLE, DMLC_PS_ROOT_URI,
    DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER.
    local worker/server: those plus DMLC_TASK_ID (workers 0..W-1, then servers W..W+S-1)
    and DMLC_JOB_CLUSTER=local.
    ssh worker/server: those five plus DMLC_NODE_HOST (the host from the hostfile);
    no DMLC_TASK_ID. Nothing in mxhylo reads DMLC_TASK_ID: kv.rank comes from the
    scheduler and differs from it.
    """
    if role not in ROLES:
        raise ValueError("role must be one of %s, not %r" % (ROLES, role))
    env = {"DMLC_ROLE": role,
           "DMLC_PS_ROOT_URI": str(root_uri),
           "DMLC_PS_ROOT_PORT": str(root_port),
           "DMLC_NUM_WORKER": str(num_workers),
           "DMLC_NUM_SERVER": str(num_servers)}
    if role == "scheduler":
        return env
    if launcher == "local":
        env["DMLC_TASK_ID"] = str(task_id)
        env["DMLC_JOB_CLUSTER"] = "local"
    elif launcher == "ssh":
        env["DMLC_NODE_HOST"] = str(node_host)
    else:
        raise ValueError("launcher must be 'local' or 'ssh', not %r" % launcher)
    return env


def parse_env_pairs(items, option, environ=None):
    """['A:1', 'B'] -> {'A': '1', 'B': <B from the environment>} (MXNet's --env forms)."""
    environ = os.environ if environ is None else environ
    out = {}
    for item in items:
        if ":" in item:
            key, value = item.split(":", 1)
        elif item in environ:
            key, value = item, environ[item]
        else:
            raise SystemExit("mxhylo.launch: %s %s: give NAME:VALUE, or the name of a "
                             "variable set in this shell" % (option, item))
        if not key:
            raise SystemExit("mxhylo.launch: %s %r: empty variable name" % (option, item))
        out[key] = value
    return out


def user_overrides(args, role):
    """Variables from --env (every role) then --env-server/--env-worker (that role).

    Applied after the DMLC_* variables, so they can override them: the tests point
    workers at a wrong scheduler port this way.
    """
    env = parse_env_pairs(args.env, "--env")
    if role == "server":
        env.update(parse_env_pairs(args.env_server, "--env-server"))
    elif role == "worker":
        env.update(parse_env_pairs(args.env_worker, "--env-worker"))
    return env


# ----------------------------------------------------------------------------- commands

def local_argv(command):
    """argv for a local child: several words run as given; one word is shell text.

    ``mxhylo.launch -n 2 python train.py --lr 0.1`` execs python directly (quoting
    preserved); ``mxhylo.launch -n 2 'cd x && python train.py'`` runs ``bash -c``.
    Like dmlc-tracker, an executable in the current directory named without a
    slash is run as ./NAME when nothing of that name is on PATH.
    """
    command = list(command)
    if len(command) == 1 and any(ch in command[0] for ch in " \t;&|<>()$`'\"*?"):
        return ["bash", "-c", command[0]]
    first = command[0]
    if "/" not in first and shutil.which(first) is None and os.path.isfile(first):
        command[0] = "./" + first
    return command


def command_text(command):
    """The command as shell text (one word is already shell text; several are quoted)."""
    return command[0] if len(command) == 1 else shlex.join(command)


def node_address(host):
    """DMLC_NODE_HOST for a hostfile entry: its IPv4 address when the name resolves here.

    ps-lite binds its socket to DMLC_NODE_HOST, and a name there fails ("bind
    failed", seen with 'localhost'); dmlc-tracker passes the entry as written, so a
    hostfile of names only works with it if the names are addresses. A name that
    does not resolve here (e.g. an ssh alias) is passed on as written.
    """
    try:
        return socket.gethostbyname(host)
    except (socket.gaierror, UnicodeError):
        return host


def read_hostfile(path):
    """[(host, port)] from a hostfile: one 'host', 'host:port' or 'host slots=N' a line."""
    hosts = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            line = line.split("slots=", 1)[0].strip()
            host, _, port = line.partition(":")
            hosts.append((host, port or "22"))
    if not hosts:
        raise SystemExit("mxhylo.launch: hostfile %s lists no hosts" % path)
    return hosts


def remote_command(workdir, exports, command):
    """The shell text one ssh session runs on the remote host.

    ``exec bash -c 'cd DIR && export K=V ... && { ...CMD... }'``: dmlc-tracker sends
    ``export ...; cd DIR; CMD`` to whatever the login shell is; we pin bash (job
    control and kill semantics differ in dash) and a failed cd stops there. CMD runs as a
    background job in its own process group (set -m) next to a watcher that stops
    that group when the session's stdin closes. The launcher closes it at teardown,
    and a dropped connection closes it too; without the watcher, killing the local
    ssh would leave the remote command running (no tty, so no SIGHUP reaches it).
    The shell's own job notices ("Terminated", ...) go to /dev/null (fd 4 keeps the
    session's stderr for CMD). The session's exit code is CMD's.
    """
    assigns = " ".join("%s=%s" % (k, shlex.quote(str(v))) for k, v in exports.items())
    inner = ("cd %s && export %s && { exec 4>&2 2>/dev/null; set -m; "
             "{ %s ; } </dev/null 2>&4 4>&- & p=$!; "
             "{ cat >/dev/null; kill -TERM -- -$p; sleep 5; kill -KILL -- -$p; } "
             ">/dev/null 4>&- & w=$!; "
             "wait $p; rc=$?; kill -- -$w; exit $rc; }"
             % (shlex.quote(workdir), assigns, command_text(command)))
    return "exec bash -c " + shlex.quote(inner)


def ssh_argv(host, port, remote, ssh_program="ssh"):
    """argv for one ssh child: ssh -o StrictHostKeyChecking=no -p PORT HOST 'REMOTE'."""
    return shlex.split(ssh_program) + ["-o", "StrictHostKeyChecking=no", "-p", str(port),
                                       host, remote]


# ----------------------------------------------------------------------------- where roles listen

LOOPBACK = "127.0.0.1"
SIOCGIFADDR = 0x8915        # linux/sockios.h: an interface's (first) IPv4 address
IFNAMSIZ = 16               # linux/if.h: interface names are shorter than this, in bytes


class BindError(ValueError):
    """The roles cannot be bound as asked (an unknown interface, conflicting options)."""


def interface_ipv4(name):
    """The IPv4 address (dotted quad) of this host's interface ``name``, or None when
    no interface has that name or it has no IPv4 address (Linux's SIOCGIFADDR: the
    interface's first address)."""
    raw = name.encode()
    if not raw or len(raw) >= IFNAMSIZ or b"\0" in raw:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            ifreq = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", raw))
        except OSError:
            return None
    # struct ifreq: the name (16 bytes), then a sockaddr_in (family, port, address)
    return socket.inet_ntoa(ifreq[IFNAMSIZ + 4:IFNAMSIZ + 8])


def interfaces():
    """[(name, IPv4 address or None)] of this host's interfaces, by index."""
    return [(name, interface_ipv4(name)) for _, name in socket.if_nameindex()]


def interface_of(address):
    """The name of the interface whose IPv4 address is ``address``, or None."""
    for name, ipv4 in interfaces():
        if ipv4 == address:
            return name
    return None


def interface_address(name, label=None):
    """``name``'s IPv4 address; BindError naming it (as ``label`` says where it came
    from, default '--interface NAME') and listing this host's interfaces when it has
    none (ps-lite listens on IPv4 only) or does not exist."""
    address = interface_ipv4(name)
    if address is not None:
        return address
    found = interfaces()
    listing = ", ".join("%s (%s)" % (n, a or "no IPv4 address") for n, a in found)
    why = ("the interface has no IPv4 address (ps-lite listens on IPv4 only)"
           if name in [n for n, _ in found] else "this host has no interface of that name")
    raise BindError("%s: %s; this host's interfaces: %s"
                    % (label or "--interface " + name, why, listing))


def source_address(address):
    """The address of this host the kernel sends from to reach IPv4 ``address`` (a
    connected UDP socket: no packet is sent). OSError when no route leads there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        return sock.getsockname()[0]


def reaching_address(hosts):
    """The one address of this host from which it reaches every host of ``hosts``
    ([(host, port)], a hostfile's) that resolves here; dmlc-tracker's choice
    (procs.host_ip('ip')) when none does. BindError when they are reached from
    different addresses: the scheduler listens on one."""
    sources = {}
    for host, _ in hosts:
        try:
            sources.setdefault(source_address(node_address(host)), []).append(host)
        except OSError:         # a name that does not resolve here (an ssh alias)
            continue
    if not sources:
        return procs.host_ip("ip")
    if len(sources) > 1:
        raise BindError(
            "the hostfile's hosts are reached from different addresses of this host (%s), "
            "and the scheduler listens on one: give --interface NAME or --host-ip ADDRESS"
            % "; ".join("%s from %s" % (", ".join(h), a) for a, h in sorted(sources.items())))
    return next(iter(sources))


@dataclass(frozen=True)
class Binding:
    """Where the processes of a job listen (ps-lite: one socket each).

    scheduler_uri: DMLC_PS_ROOT_URI, where the scheduler listens (on the launching
    host) and every process finds it; address: the IPv4 address the launching host's
    processes listen on (DMLC_NODE_HOST); interface: the interface holding it
    (DMLC_INTERFACE; None when no interface's first address is it); remote_interface:
    the interface ssh processes listen on, each on its own host (DMLC_INTERFACE with
    no DMLC_NODE_HOST); None: each on its hostfile address, as dmlc-tracker.
    """
    scheduler_uri: str
    address: str
    interface: Optional[str] = None
    remote_interface: Optional[str] = None

    def local_env(self):
        """The variables that bind a process of the launching host."""
        env = {"DMLC_NODE_HOST": self.address}
        if self.interface:
            env["DMLC_INTERFACE"] = self.interface
        return env

    def describe(self):
        """'127.0.0.1 (lo)' for the launcher's log."""
        return self.address + (" (%s)" % self.interface if self.interface else "")


def job_binding(args, environ):
    """The Binding of the job ``args`` describes; BindError when it cannot be made.

    The interface is --interface's, else DMLC_INTERFACE's of the launching shell; then
    every process listens on its IPv4 address (on ssh hosts, that of their interface of
    that name). Without one: a local job on loopback (or --host-ip's address), an ssh
    job's launching host on the address that reaches the hostfile's hosts (or --host-ip's)
    and the remote processes on their hostfile addresses.
    """
    name = args.interface
    label = "--interface %s" % name
    if not name and environ.get("DMLC_INTERFACE"):
        name = environ["DMLC_INTERFACE"]
        label = "DMLC_INTERFACE=%s (set in this shell; --interface overrides it)" % name
    if name:
        address = interface_address(name, label)
        if args.host_ip != "auto" and node_address(procs.host_ip(args.host_ip)) != address:
            raise BindError("--host-ip %s is not the address of %s, %s: the scheduler "
                            "listens on its address; give one of the two"
                            % (args.host_ip, label, address))
        return Binding(address, address, name,
                       name if args.launcher == "ssh" else None)
    if args.host_ip != "auto":
        uri = procs.host_ip(args.host_ip)
    elif args.launcher == "local":
        uri = LOOPBACK
    else:
        uri = reaching_address(read_hostfile(args.hostfile))
    address = node_address(uri)
    return Binding(uri, address, interface_of(address))


# ----------------------------------------------------------------------------- the plan

def plan_children(args, root_uri, root_port, environ=None, binding=None):
    """The Child objects of the job, scheduler first, then workers, then servers.

    binding: a Binding whose variables every process gets (after dmlc-tracker's, before
    --env's); None: dmlc-tracker's variables alone, where ps-lite picks the address.
    """
    environ = dict(os.environ if environ is None else environ)
    bound = binding.local_env() if binding is not None else {}
    # Children's output goes through a pipe; unbuffered Python keeps the lines flowing
    # as they are printed instead of in 8 KiB blocks (a user's value is kept).
    extra = {} if "PYTHONUNBUFFERED" in environ else {"PYTHONUNBUFFERED": "1"}
    W, S = args.num_workers, args.num_servers
    children = []

    sched_env = dict(environ)
    sched_env.update(role_env("scheduler", W, S, root_uri, root_port))
    sched_env.update(bound)     # (the scheduler itself listens on DMLC_PS_ROOT_URI)
    sched_env.update(extra)
    sched_env.update(user_overrides(args, "scheduler"))
    children.append(procs.Child("scheduler", "scheduler", local_argv(args.command), sched_env))

    if args.launcher == "local":
        # dmlc-tracker's local launcher: task ids 0..W-1 are workers, W..W+S-1 servers.
        for task_id in range(W + S):
            role = "worker" if task_id < W else "server"
            index = task_id if role == "worker" else task_id - W
            env = dict(environ)
            env.update(role_env(role, W, S, root_uri, root_port, "local", task_id=task_id))
            env.update(bound)
            env.update(extra)
            if role == "server":
                env.update(server_defaults(environ))
            env.update(user_overrides(args, role))
            children.append(procs.Child("%s %d" % (role, index), role,
                                        local_argv(args.command), env))
        return children

    # ssh: dmlc-tracker starts servers first, then workers, host = hosts[i % len(hosts)].
    hosts = read_hostfile(args.hostfile)
    workdir = args.sync_dst_dir or os.getcwd()
    for i in range(W + S):
        role = "server" if i < S else "worker"
        index = i if role == "server" else i - S
        host, port = hosts[i % len(hosts)]
        exports = {k: environ[k] for k in SSH_PASSTHROUGH if k in environ}
        exports.update(role_env(role, W, S, root_uri, root_port, "ssh",
                                node_host=node_address(host)))
        if binding is not None and binding.remote_interface:
            # ps-lite prefers DMLC_NODE_HOST: without it, it reads the interface's address
            del exports["DMLC_NODE_HOST"]
            exports["DMLC_INTERFACE"] = binding.remote_interface
        # The remote shell does not inherit ours: pass the setting along either way.
        exports["PYTHONUNBUFFERED"] = environ.get("PYTHONUNBUFFERED", "1")
        if role == "server":
            exports.update(server_defaults(exports))
        exports.update(user_overrides(args, role))
        argv = ssh_argv(host, port, remote_command(workdir, exports, args.command), args.ssh)
        child = procs.Child("%s %d" % (role, index), role, argv, dict(environ),
                            host=host, keep_stdin=True)
        child.remote_env = exports      # what the remote process gets (for --dry-run)
        children.append(child)
    return children


def sync_dirs(args, log):
    """--sync-dst-dir: rsync the current directory to every host first (as dmlc-tracker)."""
    for host, port in sorted(set(read_hostfile(args.hostfile))):
        argv = ["rsync", "-az", "--rsh=%s -o StrictHostKeyChecking=no -p %s" % (args.ssh, port),
                os.getcwd() + "/", "%s:%s" % (host, args.sync_dst_dir)]
        log("rsync %s -> %s:%s" % (os.getcwd(), host, args.sync_dst_dir))
        rc = subprocess.call(argv)
        if rc != 0:
            raise SystemExit("mxhylo.launch: rsync to %s failed (%s)"
                             % (host, procs.describe_returncode(rc)))


# ----------------------------------------------------------------------------- failures

def check_message(line):
    """The text after the last "Check failed:" in a glog line, or None without one."""
    if line is None or procs.CHECK_MARK not in line:
        return None
    return line.rsplit(procs.CHECK_MARK, 1)[1].strip()


def last_words(child, limit=300):
    """What a dead process last said, quoted, for the final message, or None.

    MXNet's check message when it printed one (the stack trace after it says less),
    else its last non-empty line.
    """
    check = check_message(child.last_check)
    text = procs.CHECK_MARK + " " + check if check is not None else child.last_line
    if not text:
        return None
    text = text.strip()
    return '"%s"' % (text if len(text) <= limit else text[:limit] + "...")


def startup_race(child):
    """'server 1: "Check failed: ..."' when this failed process hit MXNet's start-up
    race (see STARTUP_RACE), else None."""
    if child is None or child.returncode in (None, 0):
        return None
    check = check_message(child.last_check)
    if check is None:
        return None
    for role, pattern in STARTUP_RACE:
        if child.role == role and pattern.search(check):
            return '%s: "%s %s"' % (child.name, procs.CHECK_MARK, check)
    return None


# ----------------------------------------------------------------------------- running

class Job:
    """Runs the planned children and decides when and how the job ends.

    may_relaunch: the caller starts the job again when it fails by MXNet's start-up
    race; run() then leaves the failure report out (``race`` says what was seen).
    """

    def __init__(self, children, timeout=None, grace=5.0, shutdown_timeout=30.0,
                 pid_file=None, out=None, err=None, may_relaunch=False):
        self.children = children
        self.timeout, self.grace, self.shutdown_timeout = timeout, grace, shutdown_timeout
        self.pid_file = pid_file
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.may_relaunch = may_relaunch
        self.lock = threading.Lock()
        self.stop_signal = None
        self.started = None
        self.race = None        # startup_race() of the failure that ended the job

    def log(self, msg):
        with self.lock:
            self.err.write("[launch] %s\n" % msg)
            self.err.flush()

    def _on_signal(self, signum, _frame):
        # Only noted here; the main loop stops the job (teardown ignores repeats).
        if self.stop_signal is None:
            self.stop_signal = signum

    def _write_pid_file(self):
        if not self.pid_file:
            return
        data = {"launcher": os.getpid(),
                "children": [{"name": c.name, "role": c.role, "pid": c.pid, "host": c.host}
                             for c in self.children if c.pid is not None]}
        tmp = self.pid_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.pid_file)

    def _start_all(self):
        # All children are forked before any pump thread starts: the preexec hook then
        # runs in a single-threaded parent, where fork+preexec is safe.
        for c in self.children:
            c.start()
        self._write_pid_file()
        self.pumps = [procs.OutputPump(c, self.out, self.lock) for c in self.children]
        for p in self.pumps:
            p.start()
        self.log("started " + ", ".join("%s pid %d" % (c.name, c.pid) for c in self.children))

    def _check(self):
        """None while the job should go on, else (exit_code, reason, culprit or None)."""
        now = time.monotonic()
        workers = [c for c in self.children if c.role == "worker"]
        others = [c for c in self.children if c.role != "worker"]
        for c in self.children:
            c.poll()
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            return 128 + self.stop_signal, "the launcher received %s" % name, None
        workers_running = any(c.returncode is None for c in workers)
        failed = [c for c in self.children if c.returncode not in (None, 0)]
        if failed:
            # The first to go is the likely cause (e.g. a server's abort, then a worker's).
            c = min(failed, key=lambda c: c.exited_at)
            when = "" if c.role == "worker" else (
                " while workers were still running" if workers_running
                else " after the workers finished")
            return EXIT_FAILED, "%s %s%s" % (
                c.describe(), procs.describe_returncode(c.returncode), when), c
        for c in others:
            # Servers and the scheduler exit 0 once every worker has reached ps-lite's
            # finalize, which can be a moment before the worker processes are gone:
            # only a clean exit that long precedes the workers' is an error.
            if (c.returncode == 0 and workers_running
                    and now - c.exited_at > self.shutdown_timeout):
                return EXIT_FAILED, "%s exited with code 0 %.0f s ago while workers are " \
                    "still running" % (c.describe(), now - c.exited_at), c
        if self.timeout and now - self.started > self.timeout:
            running = ", ".join(c.name for c in self.children if c.returncode is None)
            return EXIT_TIMEOUT, "the job ran past --timeout %g s (still running: %s)" % (
                self.timeout, running), None
        if not workers_running:
            if all(c.returncode is not None for c in others):
                return 0, "all workers finished", None
            last = max(c.exited_at for c in workers)
            if now - last > self.shutdown_timeout:
                running = ", ".join(c.describe() for c in others if c.returncode is None)
                self.log("warning: %s still running %g s after all workers finished "
                         "(a worker that skipped ps-lite's finalize leaves them waiting); "
                         "stopping them" % (running, self.shutdown_timeout))
                return 0, "all workers finished", None
        return None

    def run(self):
        """Start the children, watch them, tear down; returns the launcher's exit code."""
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        self.started = time.monotonic()
        self.pumps = []
        try:
            self._start_all()
            while True:
                verdict = self._check()
                if verdict is not None:
                    break
                time.sleep(0.1)
        except Exception as exc:        # a launcher bug or a failed start must still
            verdict = (EXIT_FAILED, "the launcher failed: %s: %s"   # stop what started
                       % (type(exc).__name__, exc), None)
        finally:
            # Also reached on KeyboardInterrupt/SystemExit raised inside the loop.
            if "verdict" not in locals():
                verdict = (EXIT_FAILED, "the launcher was interrupted", None)
            if verdict[0] != 0:
                self.log("stopping the job: %s" % verdict[1])
                for c in self.children:
                    if c.stopped():
                        self.log("%s is stopped (process state T: SIGSTOP or a debugger): "
                                 "it answered no one" % c.describe())
            end_by = self._end_by(verdict[2])
            procs.teardown(self.children, self._teardown_grace(end_by), self.log)
            self._join_pumps(end_by)
            for s, h in previous.items():
                signal.signal(s, h)
        if verdict[0] == EXIT_FAILED and self.stop_signal is None:
            self.race = startup_race(verdict[2])
        if self.race and self.may_relaunch:
            return verdict[0]           # the caller says so and starts the job again
        return self._report(*verdict)

    def _end_by(self, culprit):
        """When the job must be over: DEAD_PEER_END_S after a server or the scheduler
        failed (its workers can only wait for it), else None (no bound)."""
        if culprit is None or culprit.role == "worker" or culprit.returncode in (None, 0):
            return None
        return culprit.exited_at + DEAD_PEER_END_S

    def _teardown_grace(self, end_by):
        """--grace, cut short so that a job with a dead server still ends by end_by."""
        if end_by is None:
            return self.grace
        return max(0.0, min(self.grace, end_by - TEARDOWN_TAIL_S - time.monotonic()))

    def _join_pumps(self, end_by):
        """Let the output pumps copy what is left (the processes are gone: their pipes
        end), for at most 2 s in all, or until shortly before end_by."""
        deadline = time.monotonic() + 2.0
        if end_by is not None:
            deadline = max(time.monotonic() + 0.2, min(deadline, end_by - 0.5))
        for p in self.pumps:
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def _report(self, code, reason, culprit):
        """Log how the job ended; the last line names the culprit and its last words."""
        elapsed = time.monotonic() - self.started
        if code == 0:
            self.log("job finished OK in %.1f s" % elapsed)
            return 0
        if culprit is not None and culprit.tail:
            self.log("last output of %s:\n%s" % (
                culprit.name, "\n".join("    " + l for l in list(culprit.tail)[-10:])))
        words = last_words(culprit) if culprit is not None else None
        if words:
            reason += ": " + words
        if self.race:
            reason += " (MXNet's start-up race)"
        self.log("job FAILED after %.1f s: %s" % (elapsed, reason))
        return code


# ----------------------------------------------------------------------------- command line

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mxhylo.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m mxhylo.launch -n 2 -s 2 python train.py --kvstore dist_sync\n"
               "  python -m mxhylo.launch -n 4 -s 2 python -m mxhylo.run train_imagenet.py\n"
               "  python -m mxhylo.launch -n 4 -s 4 --launcher ssh -H hosts python -m "
               "mxhylo.run train.py\n"
               "  python -m mxhylo.launch -n 4 -s 4 --launcher ssh -H hosts --interface "
               "eth1 python train.py\n\n"
               "environment (as MXNet's tools/launch.py): DMLC_ROLE, DMLC_PS_ROOT_URI, "
               "DMLC_PS_ROOT_PORT,\nDMLC_NUM_WORKER, DMLC_NUM_SERVER; local: DMLC_TASK_ID, "
               "DMLC_JOB_CLUSTER=local;\nssh: DMLC_NODE_HOST. Also PYTHONUNBUFFERED=1 "
               "unless already set, and where each process listens:\nDMLC_NODE_HOST "
               "and DMLC_INTERFACE (see --interface).\n\n"
               "security: ps-lite has no authentication and the servers trust what "
               "every peer sends;\nrun jobs only on a trusted network, bound to it "
               "with --interface.")
    p.add_argument("-n", "--num-workers", type=int, required=True,
                   help="number of worker processes")
    p.add_argument("-s", "--num-servers", type=int,
                   help="number of server processes (default: the number of workers)")
    p.add_argument("--launcher", choices=("local", "ssh"), default="local",
                   help="start processes on this machine (default) or over ssh on the "
                        "hosts of --hostfile")
    p.add_argument("-H", "--hostfile",
                   help="ssh launcher: file with one host, host:port or 'host slots=N' a line")
    p.add_argument("--sync-dst-dir",
                   help="ssh launcher: rsync the current directory to this directory on "
                        "every host first and run there (default: run in the current "
                        "directory's path)")
    p.add_argument("--ssh", default="ssh",
                   help="ssh program (and options) for the ssh launcher (default: ssh)")
    p.add_argument("--interface", metavar="NAME",
                   help="every process listens on this network interface's IPv4 address "
                        "(DMLC_INTERFACE and DMLC_NODE_HOST; the scheduler on its "
                        "DMLC_PS_ROOT_URI): on this host and, with --launcher ssh, on "
                        "each host's interface of that name. Default: DMLC_INTERFACE of "
                        "this shell if set, else the address that reaches the scheduler: "
                        "127.0.0.1 for a local job; for an ssh job this host's address "
                        "towards the hostfile's hosts, and each host's hostfile address. "
                        "Never all interfaces")
    p.add_argument("--host-ip", default="auto",
                   help="scheduler address given to every process: 'auto' (default: see "
                        "--interface), 'ip' (the host's address, as MXNet's launcher), "
                        "'dns', or an address")
    p.add_argument("--port", type=int, default=0,
                   help="scheduler port (default: a free port, a new one at each attempt)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]",
                   help="set NAME for every process (to VALUE, or to its value here)")
    p.add_argument("--env-server", action="append", default=[], metavar="NAME:VALUE",
                   help="set NAME=VALUE for the servers (overrides DMLC_* too, and the "
                        "servers' default OMP_NUM_THREADS=1)")
    p.add_argument("--env-worker", action="append", default=[], metavar="NAME:VALUE",
                   help="set NAME=VALUE for the workers (overrides DMLC_* too)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the whole job (exit code 124) after this many seconds "
                        "(counted for each attempt)")
    p.add_argument("--no-relaunch", action="store_true",
                   help="end the job on MXNet's start-up race too, instead of starting "
                        "it again (at most %d times)" % MAX_RELAUNCHES)
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL at teardown (default 5; "
                        "after a server or the scheduler failed, less if need be: that "
                        "job ends within %g s of the failure)" % DEAD_PEER_END_S)
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long servers and scheduler may take to exit after all "
                        "workers exited 0 (then they are stopped), and how long workers "
                        "may run on after a server or the scheduler exited 0 (then the "
                        "job fails) (default 30)")
    p.add_argument("--pid-file", metavar="PATH",
                   help="write {launcher, children: [{name, role, pid, host}]} as JSON here "
                        "(rewritten at each attempt)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each process's command and DMLC_* environment; start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command every process runs (options after it are its own)")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command to run, e.g. python train.py")
    if args.num_workers < 1:
        parser.error("-n/--num-workers must be at least 1")
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.num_servers < 1:
        parser.error("-s/--num-servers must be at least 1 (a parameter-server job)")
    if args.launcher == "ssh" and not args.hostfile:
        parser.error("--launcher ssh needs -H/--hostfile")
    return args


def print_plan(children):
    """--dry-run: each process's command and DMLC_* environment."""
    for c in children:
        env = getattr(c, "remote_env", c.env)
        dmlc = {k: v for k, v in env.items() if k.startswith("DMLC_")}
        print("%s: %s\n    %s" % (c.name, shlex.join(c.argv), json.dumps(dmlc, sort_keys=True)))


def run_attempt(args, binding, may_relaunch, first):
    """Plan and run the job once (where ``binding``, a Binding, says), on a fresh
    scheduler port unless --port fixes it.

    Returns (job, exit code); job.race is set when MXNet's start-up race ended it.
    """
    root_uri = binding.scheduler_uri
    root_port = args.port or procs.free_port()
    job = Job(plan_children(args, root_uri, root_port, binding=binding),
              timeout=args.timeout, grace=args.grace,
              shutdown_timeout=args.shutdown_timeout, pid_file=args.pid_file,
              may_relaunch=may_relaunch)
    where = binding.describe()
    if args.launcher == "ssh":
        where += "; remote processes on %s" % (
            "their interface " + binding.remote_interface if binding.remote_interface
            else "their hostfile addresses")
    job.log("scheduler at %s:%d; %d worker(s), %d server(s), %s launcher; listening on %s"
            % (root_uri, root_port, args.num_workers, args.num_servers, args.launcher,
               where))
    if first and args.launcher == "ssh" and args.sync_dst_dir:
        sync_dirs(args, job.log)
    return job, job.run()


def main(argv=None):
    """The launcher: run the job, again after MXNet's start-up race; the exit code."""
    args = parse_args(argv)
    try:
        binding = job_binding(args, os.environ)
    except BindError as err:        # before anything starts
        build_parser().error(str(err))
    if args.dry_run:
        print_plan(plan_children(args, binding.scheduler_uri,
                                 args.port or procs.free_port(), binding=binding))
        return 0
    attempts = 1 if args.no_relaunch else 1 + MAX_RELAUNCHES
    for attempt in range(1, attempts + 1):
        job, code = run_attempt(args, binding, attempt < attempts, attempt == 1)
        if not job.race or attempt == attempts:
            return code
        job.log("MXNet's start-up race (%s): nothing had trained yet; relaunching "
                "(attempt %d of %d)" % (job.race, attempt + 1, attempts))


if __name__ == "__main__":
    sys.exit(main())
