"""A job command that plays MXNet's start-up race for the launcher's tests, without MXNet.

Run as every role by ``python -m mxhylo.launch`` (it reads DMLC_ROLE, DMLC_TASK_ID,
DMLC_NUM_WORKER and DMLC_PS_ROOT_PORT). It does not import mxnet: a server or
scheduler would enter ps-lite there. Settings come from the environment:

FAKE_LOG            file every process appends to: ``start PORT NAME`` when it starts,
                    ``abort WALLTIME NAME`` just before it aborts. The launcher gives
                    each attempt a fresh scheduler port, so the distinct ports, in
                    order, are the attempts.
FAKE_FAIL_ATTEMPTS  how many attempts fail (default 1); later ones all exit 0.
FAKE_FAILER         'server' (default) or 'worker': index 0 of that role fails, by
                    printing a glog check line and a stack trace, then aborting.
FAKE_CHECK          the text after "Check failed:" (default: the race's check for
                    that role).
FAKE_IGNORE_TERM    '1': the processes that wait ignore SIGTERM, as a process does
                    whose main thread is blocked in ps-lite while a Python handler
                    waits to run.
On a failing attempt every other process waits (at most 20 s, then exits 1).
"""
import os
import resource
import signal
import sys
import time

RACE_CHECKS = {
    "server": ("../src/kvstore/kvstore_dist_server.h:611", "!stored.is_none(): init 5 first"),
    "worker": ("../3rdparty/ps-lite/include/ps/kv_app.h:624",
               "msg.data.size() >= (size_t)2 (0 vs. 2)"),
}


def my_name():
    """'scheduler', 'worker I' or 'server I', as the launcher names this process."""
    role = os.environ["DMLC_ROLE"]
    if role == "scheduler":
        return role
    task, workers = int(os.environ["DMLC_TASK_ID"]), int(os.environ["DMLC_NUM_WORKER"])
    return "%s %d" % (role, task if role == "worker" else task - workers)


def log_line(text):
    """Append one line to FAKE_LOG (one small O_APPEND write: lines do not mix)."""
    fd = os.open(os.environ["FAKE_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def attempt_number(port):
    """1 + the number of distinct scheduler ports logged before this one."""
    ports = []
    with open(os.environ["FAKE_LOG"]) as f:
        for line in f:
            fields = line.split()
            if fields[0] == "start" and fields[1] not in ports:
                ports.append(fields[1])
    return ports.index(port) + 1


def abort_like_mxnet(name, role):
    """Print what MXNet prints when a CHECK fails in a ps-lite thread, then abort."""
    where, default_check = RACE_CHECKS[role]
    check = os.environ.get("FAKE_CHECK", default_check)
    sys.stderr.write("terminate called after throwing an instance of 'dmlc::Error'\n"
                     "  what():  [16:28:21] %s: Check failed: %s\nStack trace:\n"
                     % (where, check))
    for i in range(25):         # longer than the launcher's tail of 20 lines
        sys.stderr.write("  [bt] (%d) /usr/lib/libmxnet.so(+0x%x) [0x7f%010x]\n"
                         % (i, 0x1000 * i, i))
    sys.stderr.write("\n")
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))    # no core file
    log_line("abort %.3f %s" % (time.time(), name.replace(" ", "-")))
    os.abort()


def main():
    name, role = my_name(), os.environ["DMLC_ROLE"]
    port = os.environ["DMLC_PS_ROOT_PORT"]
    log_line("start %s %s" % (port, name.replace(" ", "-")))
    attempt = attempt_number(port)
    if attempt > int(os.environ.get("FAKE_FAIL_ATTEMPTS", "1")):
        print("%s: attempt %d, done" % (name, attempt))
        return 0
    failer = os.environ.get("FAKE_FAILER", "server")
    if name == failer + " 0":
        time.sleep(0.3)         # the others are up by then
        abort_like_mxnet(name, role)
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("%s: attempt %d, waiting" % (name, attempt))
    time.sleep(20)
    return 1


if __name__ == "__main__":
    sys.exit(main())
