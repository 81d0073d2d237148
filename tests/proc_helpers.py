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
