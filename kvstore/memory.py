"""Residual memory: what a worker has not sent yet, per layer (error feedback).

Each compressed layer owns a float32 residual of its parameter's shape that the
compression operators read and update in place (residual <- gradient + residual - sent),
a few scalars of codec state (the adaptive 2-bit threshold), and, with momentum
correction (kvstore.momentum), two more arrays per layer. All of it is part of a
checkpoint: resuming without it changes the next steps' gradients.
"""
import mxnet as mx
import numpy as np


# float32 arrays of a layer's shape besides the residual (kvstore.momentum)
ARRAY_FIELDS = ("velocity", "previous_aggregate")


class ResidualMemory:
    """Per-layer float32 residuals, state arrays and codec scalars, by parameter name."""

    def __init__(self):
        self._residuals = {}
        self._scalars = {}
        self._arrays = {}

    def residual(self, name, like):
        """The residual of layer ``name``: float32, shape and context of NDArray ``like``.

        Created as zeros on first use; a checkpoint loaded earlier fills it instead.
        """
        res = self._residuals.get(name)
        if res is None:
            res = mx.nd.zeros(like.shape, ctx=like.context, dtype=np.float32)
            self._residuals[name] = res
        elif res.shape != like.shape:
            raise ValueError("residual of layer %r has shape %s but its gradient has shape "
                             "%s (a checkpoint of another model?)" % (name, res.shape, like.shape))
        elif res.context != like.context:
            res = self._residuals[name] = res.as_in_context(like.context)
        return res

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
        """The residual of layer ``name``, or None if it has none yet."""
        return self._residuals.get(name)

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
        """Everything as a dict of str -> NDArray (the format of mx.nd.save)."""
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

    def save(self, fname):
        mx.nd.save(fname, self.state_dict())

    def load(self, fname):
        state = mx.nd.load(fname)
        # mx.nd.save of an empty dict loads back as an empty list
        self.load_state_dict(state if isinstance(state, dict) else {})
