"""Residual memory: what a worker has not sent yet, per layer (error feedback).

Each compressed layer owns a float32 residual of its parameter's shape that the
compression operators read and update in place (residual <- gradient + residual - sent),
a few scalars of codec state (the adaptive 2-bit threshold), and, with momentum
correction (kvstore.momentum), two more arrays per layer. All of it is part of a
checkpoint: resuming without it changes the next steps' gradients.

A codec may leave a subtraction owed on its residual (fc_2bit: ops.quantize_2bit
with defer=True reads gradient and residual once instead of twice, and the next
step's quantize pays what the last one owes in its own pass). Every other reader
gets the residual settled: residual(), get() and state_dict() pay what is owed
first, so the residual a reader sees is bitwise the one an eager codec leaves.
"""
from dataclasses import dataclass

import mxnet as mx
import numpy as np


@dataclass
class Owed:
    """What an ops.quantize_2bit(..., defer=True) left owed on a residual: its int32
    codes (for settle_2bit, exact whatever that call saw), its threshold and value
    (the next call's ``pending``, valid as it saw no non-finite element)."""
    codes: mx.nd.NDArray
    threshold: float
    value: float


# float32 arrays of a layer's shape besides the residual (kvstore.momentum)
ARRAY_FIELDS = ("velocity", "previous_aggregate")
# scalars the store keeps per layer whatever its codec (warm-up count, kvstore.momentum);
# every other scalar is its codec's state (e.g. fc_2bit's threshold)
STORE_SCALARS = ("warmup_done", "previous_rescale", "previous_lr")


class ResidualMemory:
    """Per-layer float32 residuals, state arrays and codec scalars, by parameter name."""

    def __init__(self):
        self._residuals = {}
        self._scalars = {}
        self._arrays = {}
        self._owed = {}         # name -> Owed

    def residual(self, name, like):
        """The residual of layer ``name``: float32, shape and context of NDArray ``like``,
        with nothing owed on it.

        Created as zeros on first use; a checkpoint loaded earlier fills it instead.
        """
        res, owed = self.residual_owing(name, like)
        if owed is not None:
            self._settle(name, res, owed)
        return res

    def residual_owing(self, name, like):
        """(residual, owed) of layer ``name``: the residual as residual() gives it but
        without paying what a deferred quantize owes on it, and that debt (an Owed) or
        None. The caller that passes the debt on to an operator hands the new one back
        with set_owed()."""
        res = self._residuals.get(name)
        if res is None:
            res = mx.nd.zeros(like.shape, ctx=like.context, dtype=np.float32)
            self._residuals[name] = res
        elif res.shape != like.shape:
            raise ValueError("residual of layer %r has shape %s but its gradient has shape "
                             "%s (a checkpoint of another model?)" % (name, res.shape, like.shape))
        elif res.context != like.context:
            res = self._residuals[name] = res.as_in_context(like.context)
            owed = self._owed.get(name)
            if owed is not None:
                owed.codes = owed.codes.as_in_context(like.context)
        return res, self._owed.get(name)

    def set_owed(self, name, owed):
        """Record what layer ``name``'s residual owes (an Owed), or None once an
        operator paid it."""
        if owed is None:
            self._owed.pop(name, None)
        else:
            self._owed[name] = owed

    def _settle(self, name, residual, owed):
        from .. import ops
        ops.settle_2bit(owed.codes, owed.value, residual)
        del self._owed[name]

    def array(self, name, field, like):
        """State array ``field`` (one of ARRAY_FIELDS) of layer ``name``: float32, shape
        and context of NDArray ``like``; zeros on first use."""
        if field not in ARRAY_FIELDS:
            raise ValueError("unknown state array %r (known: %s)" % (field, ARRAY_FIELDS))
        arr = self._arrays.get((name, field))
        if arr is None:
            arr = self._arrays[(name, field)] = mx.nd.zeros(like.shape, ctx=like.context,
                                                            dtype=np.float32)
        elif arr.shape != like.shape:
            raise ValueError("%s of layer %r has shape %s but its gradient has shape %s (a "
                             "checkpoint of another model?)" % (field, name, arr.shape,
                                                                like.shape))
        elif arr.context != like.context:
            arr = self._arrays[(name, field)] = arr.as_in_context(like.context)
        return arr

    def set_array(self, name, field, value):
        """Make float32 NDArray ``value`` the state array ``field`` of layer ``name``
        (the memory keeps ``value`` itself: the caller hands it over)."""
        if field not in ARRAY_FIELDS:
            raise ValueError("unknown state array %r (known: %s)" % (field, ARRAY_FIELDS))
        if value.dtype != np.float32:
            raise ValueError("state array %s of layer %r must be float32, got %s"
                             % (field, name, value.dtype))
        self._arrays[(name, field)] = value

    def get(self, name):
        """The residual of layer ``name`` (nothing owed on it), or None if it has none yet."""
        res = self._residuals.get(name)
        if res is not None and name in self._owed:
            self._settle(name, res, self._owed[name])
        return res

    def pop_codec_state(self, name):
        """Forget layer ``name``'s codec state (its residual, what is owed on it, its
        codec's scalars; not STORE_SCALARS nor the momentum arrays) and return the
        residual, settled (float32 NDArray), or None if it had none: a layer that
        leaves its codec must send it (kvstore.hylo, re-planning)."""
        res = self.get(name)
        if res is None:         # (every step of every dense layer asks: keep it cheap)
            return None
        del self._residuals[name]
        for key in [k for k in self._scalars if k[0] == name and k[1] not in STORE_SCALARS]:
            del self._scalars[key]
        return res

    def scalar(self, name, field):
        """Codec state ``field`` of layer ``name`` (a Python float), or None if unset."""
        return self._scalars.get((name, field))

    def set_scalar(self, name, field, value):
        """Set codec state ``field`` of layer ``name``; None unsets it."""
        if value is None:
            self._scalars.pop((name, field), None)
        else:
            self._scalars[(name, field)] = float(value)

    def names(self):
        """Names of layers that hold a residual."""
        return sorted(self._residuals)

    def state_dict(self):
        """Everything as a dict of str -> NDArray (the format of mx.nd.save); residuals
        settled."""
        for name in list(self._owed):
            self.get(name)
        state = {"residual/" + n: r for n, r in self._residuals.items()}
        for (name, field), arr in self._arrays.items():
            state["%s/%s" % (field, name)] = arr
        for (name, field), value in self._scalars.items():
            state["%s/%s" % (field, name)] = mx.nd.array([value], dtype=np.float64)
        return state

    def load_state_dict(self, state):
        """Replace the memory with ``state`` (from state_dict or mx.nd.load)."""
        residuals, scalars, arrays = {}, {}, {}
        for key, value in state.items():
            field, sep, name = key.partition("/")
            if not sep:
                raise ValueError("not a residual-memory checkpoint entry: %r" % (key,))
            if field == "residual":
                residuals[name] = value.astype(np.float32, copy=True)
            elif field in ARRAY_FIELDS:
                arrays[(name, field)] = value.astype(np.float32, copy=True)
            else:
                scalars[(name, field)] = float(value.asnumpy()[0])
        self._residuals, self._scalars, self._arrays = residuals, scalars, arrays
        self._owed = {}

    def save(self, fname):
        mx.nd.save(fname, self.state_dict())

    def load(self, fname):
        state = mx.nd.load(fname)
        # mx.nd.save of an empty dict loads back as an empty list
        self.load_state_dict(state if isinstance(state, dict) else {})
