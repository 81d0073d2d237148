"""Process helpers for ``python -m mxhylo.launch``: addresses, child processes, teardown.

Every child runs in its own process group (its own session, in fact), so that one
signal to the group reaches whatever the child started (a ``bash -c`` wrapper and
its python, a data-loading subprocess, ...), and so that a Ctrl-C typed at the
launcher's terminal reaches only the launcher, which then tears the job down in
order. Exits are detected without reaping (``waitid(WNOWAIT)``): while the exited
leader is a zombie its pid, and so its process-group id, cannot be reused by an
unrelated process, which makes the group kill at teardown safe.
"""
import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time


# ----------------------------------------------------------------------------- addresses

def free_port(host=""):
    """A TCP port that is free right now (the kernel picks it; bind-and-release).

    There is a window between this check and the scheduler binding the port; the
    kernel's ephemeral choice makes a collision unlikely, unlike scanning up from
    9091 as dmlc-tracker does, where concurrent jobs on one machine race for 9091.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def host_ip(mode="auto"):
    """The scheduler address dmlc-tracker (MXNet's tools/launch.py) would advertise.

    ``auto``/``ip``: the address the host name resolves to; when that is a loopback
    address, the address of the interface holding the default route (found with an
    unconnected UDP socket, no packet is sent). ``dns``: the fully qualified host
    name. Anything else is returned as given (an explicit address).
    """
    if mode in (None, "auto", "ip"):
        try:
            addr = socket.gethostbyname(socket.getfqdn())
        except socket.gaierror:
            addr = socket.gethostbyname(socket.gethostname())
        if addr.startswith("127."):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                try:
                    sock.connect(("10.255.255.255", 1))
                    addr = sock.getsockname()[0]
                except OSError:
                    pass        # no route at all: loopback is all there is
        return addr
    if mode == "dns":
        return socket.getfqdn()
    return mode


# ----------------------------------------------------------------------------- exit status

def describe_returncode(returncode):
    """'exited with code 3' / 'was killed by signal SIGKILL (9)' for a Popen-style code."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "signal %d" % sig
        return "was killed by signal %s (%d)" % (name, sig)
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        # A shell (bash -c, ssh's remote shell) reports its child's death as 128+N.
        try:
            name = signal.Signals(returncode - 128).name
            return "exited with code %d (its command was killed by %s)" % (returncode, name)
        except ValueError:
            pass
    return "exited with code %d" % returncode


def _proc_stat(pid):
    """(state, pgrp) of a live or zombie pid from /proc, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def pid_alive(pid):
    """True while ``pid`` exists and is not a zombie (a zombie runs nothing)."""
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def group_members(pgid):
    """Pids of the live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
                members.append(int(name))
    return members


# ----------------------------------------------------------------------------- children

# How a failed glog CHECK starts its message (MXNet, ps-lite). The line is kept apart
# from the tail: the stack trace printed after it can be longer than the tail.
CHECK_MARK = "Check failed:"


def die_with_parent():
    """preexec function: the child gets SIGKILL if the launcher dies (Linux prctl).

    A safety net for the case no handler can catch (the launcher itself SIGKILLed):
    without it the job's processes would be orphaned and block in ps-lite forever.
    Resolved in the parent so the child runs no imports between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:     # the launcher died before prctl took effect
            os._exit(137)
    return preexec


class Child:
    """One job process (scheduler, server or worker), leader of its own process group.

    name: label used in output prefixes and messages ('worker 0', 'server 1', 'scheduler').
    role: 'scheduler' | 'server' | 'worker'. argv/env: what to exec. host: where it runs
    ('local', or the ssh host). keep_stdin: give it a stdin pipe that teardown closes
    (the ssh launcher's remote side watches it to stop the remote command).
    """

    def __init__(self, name, role, argv, env, host="local", keep_stdin=False):
        self.name, self.role, self.argv, self.env = name, role, list(argv), dict(env)
        self.host, self.keep_stdin = host, keep_stdin
        self.popen = None
        self.returncode = None      # set once the exit is observed (not yet reaped)
        self.exited_at = None
        self.tail = collections.deque(maxlen=20)
        self.last_check = None      # the last line with CHECK_MARK it printed
        self.last_line = None       # the last non-empty line it printed

    @property
    def pid(self):
        return self.popen.pid if self.popen else None

    def start(self):
        self.popen = subprocess.Popen(
            self.argv, env=self.env, start_new_session=True,
            stdin=subprocess.PIPE if self.keep_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent())
        return self

    def poll(self):
        """The Popen-style return code once the process has exited, else None.

        Uses waitid(WNOWAIT): the zombie stays until reap(), keeping the pid and the
        group id reserved for our teardown.
        """
        if self.returncode is not None or self.popen is None:
            return self.returncode
        try:
            info = os.waitid(os.P_PID, self.popen.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:       # already reaped elsewhere
            info = None
            self.returncode = self.popen.poll()
            if self.returncode is not None and self.exited_at is None:
                self.exited_at = time.monotonic()
            return self.returncode
        if info is None or info.si_pid == 0:
            return None
        if info.si_code == os.CLD_EXITED:
            self.returncode = info.si_status
        else:                           # CLD_KILLED / CLD_DUMPED
            self.returncode = -info.si_status
        self.exited_at = time.monotonic()
        return self.returncode

    def close_stdin(self):
        if self.popen is not None and self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass

    def signal_group(self, sig):
        """Send ``sig`` to the child's whole process group; False when nothing is left."""
        if self.popen is None:
            return False
        try:
            os.killpg(self.popen.pid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def group_alive(self):
        """True while any non-zombie process of this child's group exists."""
        if self.popen is None:
            return False
        return bool(group_members(self.popen.pid))

    def reap(self):
        """Collect the exit status (after which the pid may be reused: no more signals)."""
        if self.popen is not None:
            self.popen.wait()
            if self.returncode is None:
                self.returncode = self.popen.returncode

    def note_output(self, line):
        """Keep what the failure report needs from one line of output (no newline)."""
        self.tail.append(line)
        if line.strip():
            self.last_line = line
        if CHECK_MARK in line:
            self.last_check = line

    def stopped(self):
        """True if this local process is stopped (state T: SIGSTOP, a debugger), which
        is how a frozen machine looks to its peers: alive, and answering nobody."""
        if self.popen is None or self.host != "local" or self.returncode is not None:
            return False
        try:
            with open("/proc/%d/stat" % self.popen.pid) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state in ("T", "t")

    def describe(self):
        where = "" if self.host == "local" else " on %s" % self.host
        return "%s (pid %s%s)" % (self.name, self.pid, where)


class OutputPump(threading.Thread):
    """Copies a child's merged stdout/stderr to ``sink`` line by line, with a prefix.

    Lines are written whole under a shared lock so that roles do not interleave
    mid-line; the last lines are kept in ``child.tail`` for the failure report.
    """

    def __init__(self, child, sink, lock):
        super().__init__(name="pump-" + child.name, daemon=True)
        self.child, self.sink, self.lock = child, sink, lock
        self.prefix = "[%s] " % child.name

    def run(self):
        stream = self.child.popen.stdout
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.child.note_output(line)
            with self.lock:
                try:
                    self.sink.write(self.prefix + line + "\n")
                    self.sink.flush()
                except (OSError, ValueError):
                    pass        # our own stdout went away: keep draining the pipe
        stream.close()


def teardown(children, grace, log):
    """Stop every child's process group: SIGTERM, ``grace`` seconds, then SIGKILL; reap.

    Groups whose leader already exited are signalled too (their leftover members,
    e.g. a command a wrapper shell started, must not survive the job). Returns the
    children whose group needed SIGKILL.
    """
    for c in children:
        c.close_stdin()
    live = [c for c in children if c.popen is not None and c.group_alive()]
    for c in live:
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(c.group_alive() for c in live):
        for c in live:
            c.poll()
        time.sleep(0.05)
    killed = [c for c in live if c.group_alive()]
    for c in killed:
        log("%s did not stop within %.0f s of SIGTERM; sending SIGKILL" % (c.describe(), grace))
        c.signal_group(signal.SIGKILL)
    for c in children:
        c.poll()
        c.reap()
    # SIGKILL is not instant: wait (briefly) until the groups are really empty.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(c.group_alive() for c in killed):
        time.sleep(0.05)
    return killed
