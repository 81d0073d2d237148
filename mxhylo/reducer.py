"""Sums of float64 vectors over the W workers of a job, by key: sync BatchNorm's
round trips (mxhylo/sync_batchnorm.py).

Every worker connects to one service, sends (key, its values) and gets back the sum
over the W workers, added in rank order so that every worker receives the same
bytes. Workers give the same keys, in any order, from any thread (one connection a
thread). A worker that stops leaves the others waiting at most ``timeout`` seconds;
then their calls raise an error naming the key and the missing workers.

The service runs in a process of its own, started by the rank-0 worker
(spawn_service): inside a training process it would wait for the GIL and for that
process's turn on a CPU at each of a step's round trips (two per BatchNorm layer),
which on shared cores multiplied a resnet50 step's time. This file imports no
mxnet, so the service starts in a fraction of a second; it leaves when its parent
does.

Wire (big-endian): a connection opens with the worker's rank (u32); a call is
key length (u16), value count (u32), the key (utf-8), the values (float64); the
answer is the count (u32) and the sum (float64), or, when the count differs, that
many bytes of an error message.
"""
import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

TIMEOUT_S = 300.0

_HELLO = struct.Struct("!I")            # rank
_HEAD = struct.Struct("!HI")            # key length (bytes), values (float64 count)


# ----------------------------------------------------------------------------- the reducer

def _recv_exact(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


class _Round:
    """One key's sum in progress: rank -> values; finished sums by generation."""

    def __init__(self):
        self.generation = 0
        self.parts = {}
        self.results = {}                   # generation -> [sum, readers left]


class Reducer:
    """Sums float64 vectors over the W workers, by key (rank 0 hosts the service).

    ``sum(key, values)`` blocks until every worker has given ``values`` for ``key``
    and returns their sum (added in rank order: every worker gets the same bytes).
    Each worker calls it with the same keys, in any order, from any thread.
    """

    def __init__(self, rank, num_workers, address, timeout=TIMEOUT_S, listener=None):
        self.rank, self.num_workers = int(rank), int(num_workers)
        self.address, self.timeout = address, float(timeout)
        self._local = threading.local()
        self._rounds = {}
        self._cond = threading.Condition()
        if listener is not None:
            threading.Thread(target=self._serve, args=(listener,), daemon=True,
                             name="mxhylo-syncbn-reducer").start()

    # -- worker side
    def sum(self, key, values):
        """Sum of ``values`` (1-D float64, the same length on every worker) over the workers."""
        values = np.ascontiguousarray(values, dtype=np.float64).ravel()
        if self.num_workers == 1:
            return values.copy()
        sock = getattr(self._local, "sock", None)
        if sock is None:
            # (longer than the service's own wait, whose error names the missing workers)
            sock = socket.create_connection(self.address, timeout=self.timeout * 1.5 + 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(self.rank))
            self._local.sock = sock
        name = key.encode()
        try:
            sock.sendall(_HEAD.pack(len(name), values.size) + name + values.tobytes())
            count, = struct.unpack("!I", _recv_exact(sock, 4))
            if count != values.size:
                raise RuntimeError(_recv_exact(sock, count).decode(errors="replace"))
            return np.frombuffer(_recv_exact(sock, 8 * count), dtype=np.float64).copy()
        except (OSError, ConnectionError) as exc:
            self._local.sock = None
            raise RuntimeError(
                "sync BatchNorm: no sum for %r from the rank-0 worker's reducer at %s:%d "
                "within %g s (%s): a worker stopped or fell behind"
                % (key, self.address[0], self.address[1], self.timeout, exc)) from None

    # -- rank 0's service
    def _serve(self, listener):
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_worker, args=(conn,), daemon=True).start()

    def _serve_worker(self, conn):
        try:
            rank, = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            while True:
                klen, count = _HEAD.unpack(_recv_exact(conn, _HEAD.size))
                key = _recv_exact(conn, klen).decode()
                values = np.frombuffer(_recv_exact(conn, 8 * count), dtype=np.float64)
                try:
                    total = self._contribute(key, rank, values)
                except RuntimeError as exc:
                    msg = str(exc).encode()
                    conn.sendall(struct.pack("!I", len(msg)) + msg)
                    continue
                conn.sendall(struct.pack("!I", total.size) + total.tobytes())
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()

    def _contribute(self, key, rank, values):
        with self._cond:
            r = self._rounds.setdefault(key, _Round())
            if r.parts and next(iter(r.parts.values())).size != values.size:
                raise RuntimeError("sync BatchNorm: workers give %r different lengths "
                                   "(%d and %d): are their nets the same?"
                                   % (key, next(iter(r.parts.values())).size, values.size))
            gen = r.generation
            r.parts[rank] = values
            if len(r.parts) == self.num_workers:
                total = np.zeros_like(values)
                for k in sorted(r.parts):
                    total += r.parts[k]
                r.results[gen] = [total, self.num_workers]
                r.parts, r.generation = {}, gen + 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: gen in r.results, self.timeout):
                raise RuntimeError("sync BatchNorm: %r waited %g s for workers %s"
                                   % (key, self.timeout, sorted(
                                       set(range(self.num_workers)) - set(r.parts))))
            result = r.results[gen]
            result[1] -= 1
            if result[1] == 0:
                del r.results[gen]
            return result[0]


def spawn_service(listener, num_workers, timeout=TIMEOUT_S):
    """Run the service on ``listener`` (a bound, listening socket) in a child process;
    returns the Popen. The child ends with its parent (it checks every second)."""
    fd = listener.fileno()
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--fd", str(fd), "--workers",
         str(num_workers), "--timeout", str(timeout), "--parent", str(os.getpid())],
        pass_fds=(fd,), stdin=subprocess.DEVNULL)


def _main(argv=None):
    p = argparse.ArgumentParser(description="the sum service of sync BatchNorm")
    p.add_argument("--fd", type=int, required=True, help="the listening socket's fd")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    p.add_argument("--parent", type=int, required=True, help="leave when it is gone")
    args = p.parse_args(argv)
    listener = socket.socket(fileno=args.fd)
    service = Reducer(0, args.workers, None, args.timeout)
    threading.Thread(target=service._serve, args=(listener,), daemon=True).start()
    while os.getppid() == args.parent:
        time.sleep(1.0)


if __name__ == "__main__":
    _main()
