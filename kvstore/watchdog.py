"""A stall watchdog for exchanges over the parameter server.

ps-lite has no time limit of its own: when a server stops answering (a frozen machine,
a network partition, a process stopped with SIGSTOP), every worker waits for its pulls
forever and says nothing. The watchdog bounds one exchange instead. When an exchange
has not completed within the bound, it prints which exchange, which layer the worker
is waiting for and which keys (on which servers) are still owed, then ends the worker
(exit code 1). mxhylo.launch then tears the job down; under MXNet's tools/launch.py
the worker exits all the same. An exchange also waits on its own worker: for the next
gradient backward writes, and for that gradient's encode. A bound that passes there is
reported as this worker's own stall, not blamed on the servers.

The bound (``stall_timeout``): seconds, a fixed number; 0 or False turns the watchdog
off; None (the default) derives it from the exchanges seen so far: AUTO_FACTOR times
the slowest completed exchange, at least AUTO_MIN seconds, and FIRST_EXCHANGES_BOUND
for the first exchanges (key creation, the servers' first decode, compiling).
"""
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Tuple

AUTO_MIN = 60.0
AUTO_FACTOR = 20.0
FIRST_EXCHANGES = 3
FIRST_EXCHANGES_BOUND = 300.0


@dataclass
class Owed:
    """What one exchange still waits for: ps key -> (layer name, server)."""
    step: int
    started: float
    keys: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    waiting_for: str = ""
    on_self: bool = False        # waiting for this worker's own gradient or encode

    def describe(self, limit=12):
        """(sorted servers still owing, text listing the owed keys)."""
        servers = sorted({server for _, server in self.keys.values()})
        listed = ["%s (key %d, server %d)" % (name, key, server)
                  for key, (name, server) in sorted(self.keys.items())]
        shown = ", ".join(listed[:limit])
        if len(listed) > limit:
            shown += ", ... %d more" % (len(listed) - limit)
        return servers, shown


def check_timeout(value):
    """The stall_timeout option, validated: None, or a float >= 0 (0: off)."""
    if value is None:
        return None
    if value is False:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError("stall_timeout must be None (derived from step times), 0 (off) or "
                         "a number of seconds > 0, got %r" % (value,))
    return float(value)


class StallWatchdog:
    """Ends this worker when one exchange outlives its bound (see the module docstring).

    begin(step) / owe(key, name, server) / waiting_on_self() / waiting(what) /
    settled(key) / settled_layer(name) / end() mark an
    exchange's progress from the thread that runs it; a daemon thread checks the bound twice a
    second. ``on_stall(message)`` is what happens then (default: print and os._exit(1)).
    """

    def __init__(self, timeout=None, rank=0, on_stall=None):
        self.timeout = check_timeout(timeout)
        self.rank = rank
        self.on_stall = on_stall or _print_and_exit
        self._lock = threading.Lock()
        self._owed = None
        self._done = 0           # exchanges completed
        self._slowest = 0.0      # seconds, of a completed exchange
        self._thread = None

    @property
    def enabled(self):
        return self.timeout != 0.0

    def bound(self):
        """Seconds the current exchange may take."""
        if self.timeout:
            return self.timeout
        if self._done < FIRST_EXCHANGES:
            return FIRST_EXCHANGES_BOUND
        return max(AUTO_MIN, AUTO_FACTOR * self._slowest)

    def begin(self, step):
        """Exchange number ``step`` starts."""
        if not self.enabled:
            return
        with self._lock:
            self._owed = Owed(step, time.monotonic())
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mxhylo-stall-watchdog",
                                            daemon=True)
            self._thread.start()

    def waiting_on_self(self):
        """The thread now waits for this worker's next gradient (its backward) and that
        gradient's encode, not for a server."""
        owed = self._owed
        if owed is not None:
            owed.waiting_for, owed.on_self = "", True

    def waiting(self, what):
        """The thread now waits for ``what`` from the servers."""
        owed = self._owed
        if owed is not None:
            owed.waiting_for, owed.on_self = what, False

    def waiting_on_layer(self, name):
        """The thread now waits for layer ``name``'s aggregate (its owed keys named)."""
        owed = self._owed
        if owed is not None:
            with self._lock:
                keys = ["key %d, server %d" % (k, server)
                        for k, (n, server) in sorted(owed.keys.items()) if n == name]
            owed.waiting_for = "layer %r (%s)" % (name, "; ".join(keys) or "no key owed")
            owed.on_self = False

    def owe(self, key, name, server):
        """The exchange will wait for ps key ``key`` (of layer ``name``) from ``server``."""
        owed = self._owed
        if owed is not None:
            with self._lock:
                owed.keys[key] = (name, server)

    def settled(self, key):
        """What ps key ``key`` owed has arrived."""
        owed = self._owed
        if owed is not None:
            with self._lock:
                owed.keys.pop(key, None)

    def settled_layer(self, name):
        """Every key of layer ``name`` has arrived."""
        owed = self._owed
        if owed is not None:
            with self._lock:
                for key in [k for k, (n, _) in owed.keys.items() if n == name]:
                    del owed.keys[key]

    def end(self):
        if self._owed is None:
            return
        with self._lock:
            self._slowest = max(self._slowest, time.monotonic() - self._owed.started)
            self._done += 1
            self._owed = None

    def _watch(self):
        while True:
            time.sleep(0.5)
            with self._lock:
                owed = self._owed
                if owed is None:
                    continue
                waited = time.monotonic() - owed.started
                bound = self.bound()
                if waited <= bound:
                    continue
                message = self._message(owed, waited, bound)
                self._owed = None
            self.on_stall(message)

    def _message(self, owed, waited, bound):
        """What a stall says: the exchange, its bound, what it waits for, and whom."""
        servers, keys = owed.describe()
        head = ("mxhylo: worker %d: exchange %d (training step %d under a Trainer) has not "
                "completed after %.0f s (bound %.0f s, the stall_timeout option%s); "
                % (self.rank, owed.step, owed.step, waited, bound,
                   "" if self.timeout else ": %gx the slowest exchange so far, at least "
                   "%g s" % (AUTO_FACTOR, AUTO_MIN)))
        if owed.on_self:
            return head + (
                "waiting for this worker's own next gradient (its backward has not written "
                "it) or for that gradient's encode, not for a server. Still owed by the "
                "servers: %s. If this worker's backward takes this long, raise "
                "stall_timeout; this worker ends so that the job does not hang."
                % (keys or "nothing"))
        return head + (
            "waiting for %s. Still owed: %s. Parameter server(s) %s (ps-lite's server "
            "ranks) may be stopped, hung or unreachable, or wait for another worker's "
            "push (a worker whose own backward stalls says so); this worker ends so that "
            "the job does not hang."
            % (owed.waiting_for or "the first aggregate", keys or "nothing listed",
               ", ".join(str(s) for s in servers) or "?"))


def _print_and_exit(message):
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)
