"""When each layer's gradient exists: MXNet's engine tells the store, layer by layer.

``loss.backward()`` returns at once; MXNet's engine then writes the gradients one
operator at a time, the last layers' first. For every layer of an exchange the store
pushes one tiny engine operation that reads the layer's gradient arrays and writes
none: the engine's own dependency tracking runs it as soon as those arrays are
written (no polling), and it writes a record into a pipe. The store's Python thread
reads the pipe, blocked without the GIL, and so wakes for whichever gradient exists
next: it encodes and pushes layers in the order backward produces them, while
backward goes on (the overlap), and never waits for one gradient while another could
already travel.

The operation is a C function of mxhylo's operator library (``hylo_notify_ready`` in
ops/src/hylo_ops.cc): it takes no GIL, so the engine thread running backward never
waits for Python. It is pushed with the engine's ``kNoSkip`` property: when backward
failed, the engine still runs it, and the encode that reads the gradient raises the
engine's error instead of the store waiting out its bound. Without the operator
library (the NDArray reference backend) there are no notifications: ``available()``
is False and the store takes the layers in the order it was given.

Records: 8 bytes, ``generation << 32 | index`` (native byte order). The pipe is one
per process and never closed: an engine operation still queued when a store goes
away must not write into a file descriptor that was reused meanwhile.
"""
import ctypes
import os
import select
import threading
import time

from mxnet.base import _LIB, check_call

# mxnet/engine.h FnProperty::kNoSkip: run even when an input carries an exception
_FN_NO_SKIP = ctypes.c_int(7)
_RECORD = 8


class _Context(ctypes.Structure):
    """MXNet's Context (include/mxnet/base.h): device type id and device id."""
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


class _Pipe:
    """The process's notification pipe; records read for other watches are kept."""

    def __init__(self, callback):
        self.read_fd, self.write_fd = os.pipe()
        self.callback = ctypes.c_void_p(callback)
        self.lock = threading.Lock()
        self.generation = 0
        self.pending = {}        # generation -> indices read for it, not yet taken

    def new_generation(self):
        with self.lock:
            self.generation = (self.generation + 1) & 0xFFFF
            self.pending[self.generation] = []
            return self.generation

    def take(self, generation, timeout):
        """The next index notified for ``generation``, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                mine = self.pending.get(generation)
                if mine:
                    return mine.pop(0)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready, _, _ = select.select([self.read_fd], [], [], 0)
                if ready:
                    self._read()
                    continue
            select.select([self.read_fd], [], [], min(left, 1.0))   # no lock held

    def _read(self):
        data = os.read(self.read_fd, 4096 * _RECORD)        # whole records: atomic writes
        for i in range(0, len(data), _RECORD):
            record = int.from_bytes(data[i:i + _RECORD], "little")
            gen, index = record >> 32, record & 0xFFFFFFFF
            if gen in self.pending:          # a finished watch's records are dropped
                self.pending[gen].append(index)

    def forget(self, generation):
        with self.lock:
            self.pending.pop(generation, None)


_pipe = []      # [_Pipe] once made
_pipe_lock = threading.Lock()


def available():
    """Whether gradients can be watched here: mxhylo's operator library is loaded."""
    return _process_pipe() is not None


def _process_pipe():
    if _pipe:
        return _pipe[0]
    with _pipe_lock:
        if not _pipe:
            from .. import ops
            callback = None
            if ops.backend() == "cpp":
                callback = ops.build.notify_ready_address()
            _pipe.append(_Pipe(callback) if callback else None)
        return _pipe[0]


class ReadyOrder:
    """The layers of one exchange, in the order their gradients are written.

    groups: per layer, the NDArrays it waits for (a layer on several devices is ready
    when all are written); names: per layer, for errors. Iterating yields each index
    once, as the engine writes that layer's arrays; ``timeout`` bounds the wait for
    one (seconds): past it, a TimeoutError names the layers still not written.
    """

    def __init__(self, groups, names, timeout):
        pipe = _process_pipe()
        if pipe is None:
            raise RuntimeError("gradient readiness needs mxhylo's operator library "
                               "(ops.backend() is %r)" % _backend_name())
        self.pipe, self.names, self.timeout = pipe, list(names), float(timeout)
        self.generation = pipe.new_generation()
        for index, arrays in enumerate(groups):
            self._watch(index, arrays)

    def _watch(self, index, arrays):
        handles = (ctypes.c_void_p * len(arrays))(*[a.handle.value for a in arrays])
        ctx = arrays[0].context
        context = _Context(ctx.device_typeid, ctx.device_id)
        param = (self.pipe.write_fd << 48) | (self.generation << 32) | index
        check_call(_LIB.MXEnginePushSyncND(
            self.pipe.callback, ctypes.c_void_p(param), None, ctypes.byref(context),
            handles, len(arrays), None, 0, ctypes.byref(_FN_NO_SKIP), 0,
            ctypes.c_char_p(b"hylo_gradient_ready")))

    def __iter__(self):
        seen = set()
        try:
            while len(seen) < len(self.names):
                index = self.pipe.take(self.generation, self.timeout)
                if index is None:
                    waiting = [n for i, n in enumerate(self.names) if i not in seen]
                    raise TimeoutError(
                        "no gradient of %d layer(s) was written within %.0f s (%s%s): "
                        "backward is stuck or was never run" % (
                            len(waiting), self.timeout, ", ".join(waiting[:5]),
                            ", ..." if len(waiting) > 5 else ""))
                seen.add(index)
                yield index
        finally:
            self.pipe.forget(self.generation)


def _backend_name():
    from .. import ops
    return ops.backend()
