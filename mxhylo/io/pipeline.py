"""A background thread that fills a bounded queue with ready batches, epoch after epoch.

The producer runs ``source.epoch()`` (a generator of prepared batches), puts an
end-of-epoch marker, calls ``source.reset()`` and goes straight on with the next
epoch, so the first batches of epoch e+1 are decoded while the training loop
finishes epoch e. The queue bound (``depth`` batches) caps the memory held ahead.

The thread target holds the source, queue and stop event but never the owner object,
so an abandoned loader can be garbage-collected and its ``__del__`` stops the thread.
Exceptions raised in the thread are put on the queue and re-raised by the consumer:
they are never lost. Daemon threads plus an atexit hook mean a loader that is still
running never blocks or crashes interpreter exit.
"""
import atexit
import queue
import threading
import time
import weakref

BATCH, END, ERROR = "batch", "end", "error"
_POLL_S = 0.05  # how often blocked put/get look at the stop event / thread liveness


def _put(q, item, stop):
    """Put unless stopped; False when the stop event was set while waiting for room."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source, q, stop, counters):
    """Thread body: epochs of batches into ``q`` until ``stop`` is set or an error occurs."""
    try:
        while not stop.is_set():
            gen = source.epoch()
            while True:
                t0 = time.perf_counter()
                item = next(gen, None)
                counters["busy_s"] += time.perf_counter() - t0
                if item is None or stop.is_set():
                    break
                counters["batches"] += 1
                counters["images"] += item.size
                if not _put(q, (BATCH, item), stop):
                    return
            if stop.is_set() or not _put(q, (END, None), stop):
                return
            source.reset()
    except BaseException as err:  # noqa: B902 - everything must reach the consumer
        _put(q, (ERROR, err), stop)


class Prefetcher:
    """Runs ``source`` on a daemon thread; ``get()`` returns (kind, item) in order.

    source: object with ``epoch()`` -> iterator of items having ``.size`` (images) and
    ``reset()`` (start the next epoch). depth: queue bound in batches (>= 1).
    ``counters`` (dict) is updated by the producer: busy_s (seconds producing),
    batches, images.
    """

    def __init__(self, source, depth, name="mxhylo-io"):
        if depth < 1:
            raise ValueError("depth must be >= 1, got %r" % depth)
        self.counters = {"busy_s": 0.0, "batches": 0, "images": 0}
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, name=name, daemon=True,
                                        args=(source, self._queue, self._stop, self.counters))
        self._thread.start()
        _LIVE.add(self)

    def get(self):
        """Next (kind, item): kind BATCH, END (epoch over) or ERROR (item: the exception)."""
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return ERROR, RuntimeError("the input thread stopped without a result")

    def close(self, timeout=60.0):
        """Stop the thread and wait for it (it may be in the middle of decoding one batch).

        Raises RuntimeError when it has not stopped after ``timeout`` seconds: the
        ImageRecordIter it was using must then not be touched.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            try:  # drain so a producer blocked on a full queue sees the stop event
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(_POLL_S)
            if time.monotonic() > deadline:
                raise RuntimeError("input thread %s did not stop within %.0f s"
                                   % (self._thread.name, timeout))
        _LIVE.discard(self)

    @property
    def alive(self):
        return self._thread.is_alive()


_LIVE = weakref.WeakSet()


@atexit.register
def _stop_all():
    # Registered after mxnet's own atexit hook (mxnet is imported first), so this runs
    # before the engine shuts down: no thread is inside MXNet when it does.
    for prefetcher in list(_LIVE):
        try:
            prefetcher.close(timeout=10.0)
        except Exception:
            pass
