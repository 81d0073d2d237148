"""The servers' state in checkpoints: residuals of compressed pulls ('layer', '2bit'),
moved through the layers' own keys.

Saving: every worker switches the servers to mode 'dump' (kvstore.server.MODES),
pushes an empty row to every compressed-pull key and pulls its state rows
(kvstore.wire.state_values); then back to 'run'. Loading: the state waits until the
next exchange (the keys may not exist yet), then rank 0 pushes it in mode 'load'.
Modes switch between two barriers, so no worker pushes while a server changes mode.
Save and load are collective: every worker calls them at the same step.
"""
import threading

import mxnet as mx
import numpy as np

from .wire import empty_push, read_state, row_sparse_push, state_values


class ServerCheckpoint:
    """Saves and restores the servers' state through a KeyTable's keys.

    collective_timeout: seconds a worker waits at a barrier for the other workers
    before it fails (ps-lite's barrier has no limit of its own).
    """

    def __init__(self, keys, collective_timeout):
        self.keys = keys
        self.kv = keys.kv
        self.rank = keys.rank
        self.collective_timeout = float(collective_timeout)
        self._pending_state = {}  # from a checkpoint, restored at the next exchange
        self._pending_replace = False

    @property
    def pending(self):
        """Whether a loaded state waits for the next exchange."""
        return bool(self._pending_state) or self._pending_replace

    def server_state(self):
        """The servers' residuals and thresholds, for a checkpoint (every worker calls
        this at the same point, like a pushpull).

        Returns {layer name: (residual numpy of the layer's shape, [threshold or None
        per chunk])}.
        """
        chunks = self.keys.compressed_pull_chunks()
        if not chunks:
            return {}
        self._server_mode("dump")
        bufs = []
        for _, c in chunks:
            self.kv.push(c.pskey, empty_push(c.layout)[0])
            buf = mx.nd.sparse.zeros("row_sparse", c.layout.key_shape)
            self.kv.row_sparse_pull(c.pskey, out=buf, row_ids=mx.nd.arange(
                c.layout.state_rows, dtype=np.int64))
            bufs.append(buf)
        state = {}
        for (name, c), buf in zip(chunks, bufs):
            piece, threshold = read_state(c.layout, buf.data.asnumpy())
            shape = self.keys.layer_shapes[name]
            residual, thresholds = state.setdefault(
                name, (np.zeros(int(np.prod(shape)), np.float32), []))
            residual[c.layout.offset:c.layout.offset + c.layout.size] = piece
            if c.layout.pull == "fc_2bit":
                thresholds.append(threshold)
        self._server_mode("run")
        return {name: (r.reshape(self.keys.layer_shapes[name]), t)
                for name, (r, t) in state.items()}

    def load_server_state(self, state):
        """Replace the servers' state with what server_state returned (layers absent
        from it start anew); done by the next exchange (restore_pending). Every worker
        calls it; rank 0's values are the ones used."""
        self._pending_state = dict(state)
        self._pending_replace = True

    def restore_pending(self):
        """Send the pending state: at the first exchange after load_server_state to
        every compressed-pull chunk (zeros where the state has no entry), later to the
        chunks of layers that were not initialised yet then."""
        chunks = [(name, c) for name, c in self.keys.compressed_pull_chunks()
                  if self._pending_replace or name in self._pending_state]
        self._pending_replace = False
        if not chunks:
            return
        shapes = self.keys.layer_shapes
        for name, _ in chunks:       # checked before any server changes mode
            residual = self._pending_state.get(name, (None, []))[0]
            if residual is not None and np.shape(residual) != shapes[name]:
                raise ValueError("server residual of layer %r in the checkpoint has shape "
                                 "%s, the layer %s" % (name, np.shape(residual), shapes[name]))
        self._server_mode("load")
        for name, c in chunks:
            residual, thresholds = self._pending_state.get(name, (None, []))
            if residual is None:
                residual = np.zeros(shapes[name], np.float32)
            if self.rank == 0:
                t = None
                if c.layout.pull == "fc_2bit":
                    # thresholds are per chunk; another chunking measures them anew
                    same = [other for n, other in chunks if n == name]
                    t = thresholds[same.index(c)] if len(thresholds) == len(same) else None
                piece = np.asarray(residual, np.float32).reshape(-1)[
                    c.layout.offset:c.layout.offset + c.layout.size]
                push = row_sparse_push(c.layout, state_values(c.layout, piece, t),
                                       np.arange(c.layout.state_rows, dtype=np.int64))
            else:
                push = empty_push(c.layout)
            self.kv.push(c.pskey, push[0])
        self._server_mode("run")
        for name, _ in chunks:
            self._pending_state.pop(name, None)

    def _server_mode(self, mode):
        """Switch every server to ``mode`` (kvstore.server.MODES) between two barriers:
        no worker pushes before every server has switched."""
        mx.nd.waitall()      # a push is asynchronous: this worker's last ones must be done
        self._barrier(mode)
        if self.rank == 0:
            self.keys.send_layouts(mode)
        self._barrier(mode)

    def _barrier(self, mode):
        """ps-lite's barrier, with a time limit: it has none, and a worker that alone
        saves or loads a checkpoint would otherwise wait for the others forever."""
        done = threading.Event()

        def wait():
            self.kv._barrier()
            done.set()

        threading.Thread(target=wait, name="mxhylo-barrier", daemon=True).start()
        if not done.wait(self.collective_timeout):
            raise RuntimeError(
                "worker %d waited %.0f s for the other workers to %s the servers' residuals "
                "(compress_pull): save_residuals / load_residuals are collective, every "
                "worker calls them at the same step (LARSTrainer.save_states / load_states "
                "on every rank)" % (self.rank, self.collective_timeout,
                                    "save" if mode == "dump" else "load"))
