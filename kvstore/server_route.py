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
servers.

The pieces are pulled into a copy of each parameter that the store owns, and that copy
is copied whole into the parameter's arrays: never a piece into a view of a parameter.
oneDNN (MKLDNN) reorders a conv weight into its own layout in the parameter's array
during an inference forward (and back only at the next training forward, which may run
after the step's pulls were queued); MXNet cannot write such an array through a view
(``Check failed: !is_view``), while a whole-array copy takes any layout, as dist_sync's
pulls do.
"""
import pickle

import numpy as np

from .server import RouteOptimizer, _as_list


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
        self._sent = None       # the optimizer last sent, pickled

    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers for every parameter (sent at once)."""
        self._sent = None
        self.sync_optimizer(optimizer)

    def sync_optimizer(self, optimizer):
        """Send ``optimizer`` to the servers if any of its settings changed since it was
        last sent (its learning rate, say): called before every step's pushes. The
        servers keep their optimizer state and update counts (kvstore.server)."""
        state = pickle.dumps(optimizer)     # (MXNet's pickling drops param_dict)
        if state == self._sent and self._keys.layouts_sent:
            return
        mults = {c.pskey: (float(self._params[i].lr_mult), float(self._params[i].wd_mult))
                 for i, chunks in self._chunks.items() for c in chunks}
        self._keys.send_route(RouteOptimizer(pickle.loads(state), mults))
        self._sent = state

    def broadcast(self, key, value, out, priority=0):
        """Store rank 0's ``value`` of parameter ``key`` on the servers (in the pieces
        the optimizer will update) and pull it into every array of ``out``."""
        for k, v, o in zip(*_as_lists(key, value, out)):
            if k in self._chunks:
                raise ValueError("parameter %d (%s) is already on the servers"
                                 % (k, self._name(k)))
            if v[0].dtype != np.float32:
                raise ValueError("parameter %s is %s: the servers' route updates float32 "
                                 "weights only" % (self._name(k), np.dtype(v[0].dtype).name))
            # rank 0's keys start from views of the array given here, and MXNet
            # pulls into them: the store's copy, never a view of the parameter (MXNet
            # neither sends from nor writes through a view of a oneDNN-layout weight)
            weights = v[0].copy()
            self._chunks[k] = self._keys.update_keys(self._name(k), weights)
            self._weights[k] = weights
            self._pulls[k] = pull_targets(weights, self._chunks[k])
            self._sent = None       # the new keys' multipliers go with the next send
            self._move(k, None, o, priority)

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


def pull_targets(weights, chunks):
    """Where the servers' weights of each piece land: per Chunk of ``chunks`` (kind
    'update': elements lo..hi of the flat parameter) the view (hi - lo,) of
    ``weights``, the store's own copy of the parameter (no array a user reads)."""
    flat = weights.reshape((-1,))
    return [flat[c.layout.lo:c.layout.hi] for c in chunks]


def _as_lists(key, value, out):
    """(keys, per key the list of values, per key the list of outputs)."""
    if isinstance(key, (list, tuple)):
        return list(key), [_as_list(v) for v in value], [_as_list(o) for o in out]
    return [key], [_as_list(value)], [_as_list(out)]
