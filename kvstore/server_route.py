"""The servers' route: a dense exchange with the Trainer's optimizer on the parameter
servers, as MXNet's dist_sync does it, through hylo's own keys.

Where compressing would not pay (a fast network; kvstore.hylo's ``server_update``
option decides), the best a hylo store can give its Trainer is what dist_sync gives:
the workers push dense gradients, the servers sum them and run the optimizer once
(not every worker: W times less update work in the job), and the workers pull the
new weights, every key an engine operation that starts as soon as backward has
written its gradient. A worker process can hold only one native dist_sync store (a
second one hangs at its start), so this store travels in keys of the hylo store's
own: each parameter cut as MXNet cuts a dist_sync key and its pieces placed on the
least-loaded servers (kvstore.ps_keys.KeyTable.update_keys), each piece a key of
kind 'update' whose server runs the optimizer on it (kvstore.server).

The hylo store owns this route and stays the Trainer's store: the Trainer is told to
update on the kvstore (Gluon then skips its own update), and the store's step pushes
each parameter's gradients and pulls its new weights through here. Beyond dist_sync:
the parameters' lr_mult and wd_mult are honoured on the servers, and a learning rate
(or any other optimizer setting) changed on the Trainer reaches them before the next
step's pushes (``sync_optimizer``). Like dist_sync, the optimizer's state lives on the
servers; unlike dist_sync, ``trainer.save_states`` and ``load_states`` work: a worker
reads the servers' state through mailbox keys of its own, a window at a time (rank 0
may save alone), and every worker pushes a file's state in windows to load it
(kvstore.server says how). The file is the one Gluon writes where the optimizer runs
on the workers (MXNet's Updater states: a pickle of ({parameter index: state},
optimizer)), so a checkpoint saved on either route loads on either: which route a job
takes depends on what it measures, and a resumed job may take the other one.

The pieces are pulled into a copy of each parameter that the store owns, and that copy
is copied whole into the parameter's arrays: never a piece into a view of a parameter.
oneDNN (MKLDNN) reorders a conv weight into its own layout in the parameter's array
during an inference forward (and back only at the next training forward, which may run
after the step's pulls were queued); MXNet cannot write such an array through a view
(``Check failed: !is_view``), while a whole-array copy takes any layout, as dist_sync's
pulls do.
"""
import pickle
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .plan import ELEMENTWISE_OPTIMIZERS
from .server import RouteOptimizer, _as_list, rebuild_state, state_arrays, state_stream


@dataclass
class RouteUpdater:
    """What Gluon's Trainer.load_states reads the optimizer it goes on with from
    (``kvstore._updater.optimizer``) where the optimizer runs on the kvstore."""
    optimizer: object


class ServerRoute:
    """Dense gradients pushed, the optimizer run on the servers, weights pulled.

    keys: the hylo store's kvstore.ps_keys.KeyTable (its native store and placement);
    params: the Trainer's parameters, by index (Gluon's keys), for names and their
    lr_mult / wd_mult.
    """
    kv_type = "dist_sync"

    def __init__(self, keys, params):
        self._keys = keys
        self._params = list(params)
        self._chunks = {}       # parameter index -> [Chunk] of kind 'update'
        self._weights = {}      # parameter index -> the store's copy of it (its shape)
        self._pulls = {}        # parameter index -> per Chunk, its span of that copy
        # parameter index -> (its optimizer state's structure for a weight of one
        # element, as the Trainer's optimizer made it when the parameter's keys were
        # made; that optimizer's class name)
        self._state_form = {}
        self._optimizer = None  # the Trainer's optimizer, as last given
        self._sent = None       # the optimizer last sent, pickled

    @property
    def updater(self):
        """RouteUpdater of the optimizer in force (the one loaded with the states, after
        load_states)."""
        return RouteUpdater(self._optimizer)

    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers for every parameter (sent at once)."""
        self._sent = None
        self.sync_optimizer(optimizer)

    def sync_optimizer(self, optimizer):
        """Send ``optimizer`` to the servers if any of its settings changed since it was
        last sent (its learning rate, say): called before every step's pushes. The
        servers keep their optimizer state and update counts (kvstore.server). The
        first time after the keys are made, every worker registers its mailboxes
        (collective, as the step's pushes are)."""
        self._send(optimizer)
        boxes = self._keys.state_keys
        if boxes is not None and not boxes.registered:
            keys = [k for made in boxes.mailboxes.values() for k in made]
            zeros = mx.nd.zeros((self._keys.layouts[keys[0]][1].size,))
            self._keys.kv.push(keys, [zeros] * len(keys))
            boxes.registered = True

    def _send(self, optimizer):
        """Send ``optimizer`` with the multipliers of every 'update' key (and the table
        of layouts if a key was made since) unless that was the last sent."""
        self._optimizer = optimizer
        state = pickle.dumps(optimizer)     # (MXNet's pickling drops param_dict)
        if state != self._sent or not self._keys.layouts_sent:
            if self._sent is not None:
                # The servers take the optimizer at once (a command answered by every
                # server), while the last step's pushes are engine operations that may
                # not have left yet: without this wait the new setting (a last,
                # smaller batch's rescale_grad, say) would update the previous step's
                # gradients too.
                mx.nd.waitall()
            mults = {c.pskey: (float(self._params[i].lr_mult),
                               float(self._params[i].wd_mult))
                     for i, chunks in self._chunks.items() for c in chunks}
            self._keys.send_route(RouteOptimizer(pickle.loads(state), mults))
            self._sent = state

    def broadcast(self, key, value, out, priority=0):
        """Store rank 0's ``value`` of parameter ``key`` on the servers (in the pieces
        the optimizer will update) and pull it into every array of ``out``."""
        keys, values, outs = _as_lists(key, value, out)
        for k, v in zip(keys, values):
            if k in self._chunks:
                raise ValueError("parameter %d (%s) is already on the servers"
                                 % (k, self._name(k)))
            if v[0].dtype != np.float32:
                raise ValueError("parameter %s is %s: the servers' route updates float32 "
                                 "weights only" % (self._name(k), np.dtype(v[0].dtype).name))
            if self._optimizer is None:
                raise RuntimeError("the servers' route got parameter %s before its "
                                   "optimizer: call set_optimizer first" % self._name(k))
        # rank 0's keys start from views of the arrays given here, and MXNet pulls into
        # them: the store's copies, never views of a parameter (MXNet neither sends
        # from nor writes through a view of a oneDNN-layout weight)
        copies = [v[0].copy() for v in values]
        # (an elementwise optimizer's state has the same structure for every float32
        # parameter: made once)
        form = self._template(keys[0], (1,)) if keys else None
        made = self._keys.update_keys([(self._name(k), w) for k, w in zip(keys, copies)])
        for k, weights, chunks, o in zip(keys, copies, made, outs):
            self._chunks[k] = chunks
            self._state_form[k] = (form, type(self._optimizer).__name__)
            self._weights[k] = weights
            self._pulls[k] = pull_targets(weights, self._chunks[k])
            self._sent = None       # the new keys' multipliers go with the next send
            self._move(k, None, o, priority)

    def pieces(self, key):
        """Parameter ``key``'s pieces (kvstore.ps_keys Chunks of kind 'update'), one
        parameter-server key each."""
        return self._chunks[key]

    def pushpull(self, key, value, out=None, priority=0):
        """Push the gradients ``value`` of parameter ``key`` (one per device), and pull
        the weights the servers' optimizer made into ``out``."""
        if out is None:
            raise ValueError("the servers' route pulls weights: pushpull needs out= "
                             "(the parameter's arrays)")
        if not self._keys.layouts_sent:
            raise RuntimeError("the servers' route pushed before its optimizer was sent: "
                               "call sync_optimizer first")
        for k, v, o in zip(*_as_lists(key, value, out)):
            if k not in self._chunks:
                raise ValueError("parameter %r was never broadcast to the servers" % (k,))
            self._move(k, v, o, priority)

    def _move(self, key, values, outs, priority):
        """Push ``values`` (None: nothing; gradients, a view of each per piece) into
        parameter ``key``'s pieces, pull the pieces into the store's copy of the
        parameter, and copy that whole into every array of ``outs`` (the parameter's)."""
        chunks = self._chunks[key]
        pskeys = [c.pskey for c in chunks]
        pulls = self._pulls[key]
        if values is None:
            self._keys.kv.pull(pskeys, out=pulls, priority=priority)
        else:
            # backward writes gradients in MXNet's layout (oneDNN reorders weights
            # only): their views are safe to push from
            flat_values = [v.reshape((-1,)) for v in values]
            pushes = [[f[c.layout.lo:c.layout.hi] for f in flat_values] for c in chunks]
            self._keys.kv.pushpull(pskeys, pushes, out=pulls, priority=priority)
        weights = self._weights[key]
        for o in outs:
            weights.copyto(o)       # (MXNet's engine runs it after the pulls)

    def _name(self, key):
        return self._params[key].name if 0 <= key < len(self._params) else str(key)

    def _template(self, key, shape):
        """The optimizer state the optimizer in force makes for a float32 weight of
        ``shape``; raises unless each of its arrays is of that shape (an elementwise
        optimizer's: a piece's state is then the same piece of the whole parameter's)."""
        optimizer = self._optimizer
        state = optimizer.create_state_multi_precision(key, mx.nd.zeros(shape))
        for a in state_arrays(state):
            if tuple(a.shape) != tuple(shape):
                raise ValueError(
                    "optimizer %s keeps a state array of shape %s for parameter %s of "
                    "shape %s: the servers' route keeps the state of elementwise "
                    "optimizers only" % (type(optimizer).__name__, a.shape,
                                         self._name(key), shape))
        return state

    # -- trainer.save_states and load_states ---------------------------------------------

    def save_states(self, fname, dump_optimizer=False):
        """Write ``states_data(dump_optimizer)`` to ``fname``."""
        data = self.states_data(dump_optimizer)
        with open(fname, "wb") as f:
            f.write(data)

    def states_data(self, dump_optimizer=False):
        """The servers' optimizer state of every parameter as Gluon writes a Trainer's
        (MXNet's Updater.get_states): a pickle of {parameter index:
        state} (the optimizer's structure of float32 NDArrays, each of the parameter's
        shape, on the CPU), with ``dump_optimizer`` a pair (that, the optimizer) whose
        update counts are the servers' (by parameter index). Pulls only, once this
        worker's last step has come back: one worker may save alone."""
        for weights in self._weights.values():
            weights.wait_to_read()      # the servers updated every piece this step
        made_by = {name for _, name in self._state_form.values()}
        if made_by - {type(self._optimizer).__name__}:
            raise RuntimeError(
                "the servers run optimizer %s, and the parameters' keys were made for %s: "
                "their optimizer state cannot be saved" % (
                    type(self._optimizer).__name__, ", ".join(sorted(made_by))))
        self._send(self._optimizer)     # (the servers' streams are of the keys sent)
        streams = self._streams()
        got = self._read_streams(streams)
        where = {(p.key, p.index): (server, p)
                 for server, parts in streams.items() for p in parts}
        states, counts = {}, {}
        for k in sorted(self._chunks):
            shape = self._weights[k].shape
            form = self._state_form[k][0]
            arrays = [np.zeros(shape, np.float32).reshape(-1) for _ in state_arrays(form)]
            count = 0
            for c in self._chunks[k]:
                for j in range(1 + len(arrays)):
                    server, part = where[(c.pskey, j)]
                    values = got[server][part.start:part.start + part.size]
                    if j == 0:
                        count = max(count, int(values[0]))
                    else:
                        arrays[j - 1][c.layout.lo:c.layout.hi] = values
            states[k] = rebuild_state(form, iter(
                mx.nd.array(a.reshape(shape), dtype=np.float32) for a in arrays))
            if count:
                counts[k] = count
        if dump_optimizer:
            optimizer = pickle.loads(pickle.dumps(self._optimizer))
            # the servers' counts, by parameter index as Gluon's Updater keeps them
            optimizer._all_index_update_counts = {0: counts}
            optimizer._index_update_count = counts
            optimizer.num_update = max([optimizer.begin_num_update] + list(counts.values()))
            return pickle.dumps((states, optimizer))
        return pickle.dumps(states)

    def load_states(self, fname):
        """``load_states_data`` of the file ``fname``."""
        with open(fname, "rb") as f:
            self.load_states_data(f.read(), fname)

    def load_states_data(self, data, what="the states"):
        """Load what save_states (or Gluon, where the optimizer ran on the workers)
        wrote (``data``, its bytes; ``what`` names it in errors) into the servers (collective: every worker calls this, as
        with Gluon's load_states; rank 0's file is the one loaded). The file's optimizer,
        if it has one, goes to the servers first and is the one in force after
        (``updater``); the update counts are the file's (without an optimizer, the
        servers' stay). A parameter the file has no state for starts afresh, as in
        Gluon. Raises, naming the parameter, if the file is for another model or
        another kind of optimizer."""
        states, optimizer = self._read_states(data, what)
        self.sync_optimizer(self._optimizer if optimizer is None else optimizer)
        counts = None if optimizer is None else optimizer._index_update_count
        streams = self._streams()
        if self._keys.rank == 0:
            values = {server: np.zeros(parts[-1].start + parts[-1].size, np.float32)
                      for server, parts in streams.items()}
            where = {(p.key, p.index): (server, p)
                     for server, parts in streams.items() for p in parts}
            for k in sorted(self._chunks):
                arrays = [_numpy(a).reshape(-1) for a in state_arrays(states.get(k))]
                count = None if counts is None else int(counts.get(k, 0))
                for c in self._chunks[k]:
                    server, part = where[(c.pskey, 0)]
                    values[server][part.start] = -1.0 if count is None else count + 1.0
                    for j, flat in enumerate(arrays):
                        server, part = where[(c.pskey, j + 1)]
                        values[server][part.start:part.start + part.size] = \
                            flat[c.layout.lo:c.layout.hi]
        else:
            values = {}     # (the others push zeros: the servers' sums are rank 0's)
        self._push_stream(streams, values)

    def _streams(self):
        """Server index -> its state stream (kvstore.server.state_stream) of this
        route's 'update' keys, as the servers lay it out."""
        entries = {}
        for k in self._chunks:
            arrays = len(state_arrays(self._state_form[k][0]))
            for c in self._chunks[k]:
                entries.setdefault(c.layout.server, []).append((c.pskey, c.layout.size,
                                                                arrays))
        return {server: state_stream(sorted(e)) for server, e in sorted(entries.items())}

    def _read_streams(self, streams):
        """Server -> its stream of ``streams`` (float32 numpy), read a window at a time
        through this worker's mailboxes (no other worker takes part). Before the
        mailboxes are registered no step or load has run: every state is as the
        optimizer makes it, and every count 0."""
        boxes = self._keys.state_keys
        got = {server: np.zeros(parts[-1].start + parts[-1].size, np.float32)
               for server, parts in streams.items()}
        if boxes is None or not boxes.registered:
            return got
        mine = {server: boxes.mailboxes[server][self._keys.rank] for server in got}
        # (every mailbox has the same window; a route may hold no key on server 0)
        window = self._keys.layouts[next(iter(mine.values()))][1].size
        outs = {server: mx.nd.zeros((window,)) for server in got}
        for offset in range(0, max(v.size for v in got.values()), window):
            fills = {mine[s]: offset for s, v in got.items() if offset < v.size}
            self._keys.send_fills(fills)    # (answered once every server wrote)
            servers = [s for s in got if mine[s] in fills]
            self._keys.kv.pull([mine[s] for s in servers], out=[outs[s] for s in servers])
            for server in servers:
                values = got[server]
                values[offset:offset + window] = outs[server].asnumpy()[:values.size - offset]
        return got

    def _push_stream(self, streams, values):
        """Push ``values`` (server -> its stream, rank 0; empty on the others, which push
        zeros) into the servers' 'load' keys, a window per round (collective: every
        worker pushes every round, rounds in order)."""
        loads = self._keys.state_keys.loads
        window = self._keys.layouts[loads[0]][1].size - 1
        total = max(parts[-1].start + parts[-1].size for parts in streams.values())
        for offset in range(0, total, window):
            keys, pushes = [], []
            for server in sorted(loads):
                push = np.zeros(1 + window, np.float32)
                push[0] = offset // window + 1
                mine = values.get(server, np.zeros(0, np.float32))[offset:offset + window]
                push[1:1 + mine.size] = mine
                keys.append(loads[server])
                pushes.append(mx.nd.array(push))
            self._keys.kv.push(keys, pushes)
            # every push answered, so every server took this round (a round ends when
            # all workers have pushed) before the next one's values come
            mx.nd.waitall()

    def _read_states(self, data, fname):
        """(states by parameter index, optimizer or None) of the states file ``fname``
        whose bytes are ``data``, checked against this Trainer's parameters and
        optimizer."""
        try:
            content = pickle.loads(data)
        except Exception as err:  # noqa: BLE001 - any bytes: say what was expected
            raise ValueError("%s is not a Trainer's optimizer states file (one that "
                             "trainer.save_states writes): %r" % (fname, err)) from None
        states, optimizer = content if isinstance(content, tuple) and len(content) == 2 \
            else (content, None)
        if not isinstance(states, dict) or not (
                optimizer is None or isinstance(optimizer, mx.optimizer.Optimizer)):
            raise ValueError("%s is not a Trainer's optimizer states file (one that "
                             "trainer.save_states writes): it holds a %s"
                             % (fname, type(content).__name__))
        if optimizer is not None and type(optimizer).__name__ not in ELEMENTWISE_OPTIMIZERS:
            raise ValueError("%s holds optimizer %s, which cannot run on the servers (the "
                             "servers' route runs %s)" % (
                                 fname, type(optimizer).__name__,
                                 ", ".join(ELEMENTWISE_OPTIMIZERS)))
        unknown = sorted(set(states) - set(self._chunks), key=repr)
        if unknown:
            raise ValueError(
                "%s holds optimizer states for parameter index %r, which this Trainer "
                "does not update on the servers (it has %d parameters there): the file "
                "was saved for another model" % (fname, unknown[0], len(self._chunks)))
        for k in sorted(self._chunks):
            shape = tuple(self._weights[k].shape)
            form, made_by = self._state_form[k]
            want = len(state_arrays(form))
            if optimizer is not None and type(optimizer).__name__ != made_by:
                # (the servers' keys were sized for the Trainer's optimizer's state)
                raise ValueError(
                    "%s holds the state of optimizer %s; this Trainer's optimizer is %s: "
                    "create the Trainer with the file's optimizer"
                    % (fname, type(optimizer).__name__, made_by))
            if k not in states:
                continue
            arrays = state_arrays(states[k])
            if len(arrays) != want or any(tuple(a.shape) != shape for a in arrays):
                raise ValueError(
                    "%s does not match parameter %s (index %d, shape %s, %d state arrays "
                    "of that shape): the file holds %d arrays of shapes %s for it (saved "
                    "for another model or optimizer)"
                    % (fname, self._name(k), k, shape, want, len(arrays),
                       [tuple(a.shape) for a in arrays]))
        return states, optimizer


def pull_targets(weights, chunks):
    """Where the servers' weights of each piece land: per Chunk of ``chunks`` (kind
    'update': elements lo..hi of the flat parameter) the view (hi - lo,) of
    ``weights``, the store's own copy of the parameter (no array a user reads)."""
    flat = weights.reshape((-1,))
    return [flat[c.layout.lo:c.layout.hi] for c in chunks]


def _numpy(array):
    """A state array of a states file (an NDArray, on any device) as float32 numpy."""
    if isinstance(array, mx.nd.NDArray):
        array = array.asnumpy()
    return np.asarray(array, np.float32)


def _as_lists(key, value, out):
    """(keys, per key the list of values, per key the list of outputs)."""
    if isinstance(key, (list, tuple)):
        return list(key), [_as_list(v) for v in value], [_as_list(o) for o in out]
    return [key], [_as_list(value)], [_as_list(out)]
