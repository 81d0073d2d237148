"""Residual memory: what a worker has not sent yet, per layer (error feedback).

Each compressed layer owns a float32 residual of its parameter's shape that the
compression operators read and update in place (residual <- gradient + residual - sent),
a few scalars of codec state (the adaptive 2-bit threshold), and, with momentum
correction (kvstore.momentum), two more arrays per layer. All of it is part of a
checkpoint: resuming without it changes the next steps' gradients.

Besides, a layer with a velocity has a spare array of its shape, not part of a
checkpoint: the next step's velocity is written there (a failed encode must keep the
old one), and the two trade places after a successful encode, so no step allocates
a layer-sized array.
"""
import mxnet as mx
import numpy as np


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
        self._spares = {}       # name -> float32 scratch of the velocity's shape

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

    def spare(self, name, like):
        """Layer ``name``'s scratch array (float32, shape and context of ``like``,
        contents undefined): where its next velocity is written."""
        arr = self._spares.get(name)
        if arr is None or arr.shape != like.shape or arr.context != like.context:
            arr = self._spares[name] = mx.nd.empty(like.shape, ctx=like.context,
                                                   dtype=np.float32)
        return arr

    def swap_velocity(self, name, velocity):
        """``velocity`` (the layer's spare, written by a successful encode) becomes
        layer ``name``'s velocity, and the velocity it replaces its spare."""
        old = self._arrays.get((name, "velocity"))
        self.set_array(name, "velocity", velocity)
        if old is not None and old is not velocity:
            self._spares[name] = old
        else:
            self._spares.pop(name, None)

    def get(self, name):
        """The residual of layer ``name``, or None if it has none yet."""
        return self._residuals.get(name)

    def pop_codec_state(self, name):
        """Forget layer ``name``'s codec state (its residual, its codec's scalars; not
        STORE_SCALARS nor the momentum arrays) and return the residual (float32
        NDArray), or None if it had none: a layer that
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
        self._spares = {}

    def save(self, fname):
        mx.nd.save(fname, self.state_dict())

    def load(self, fname):
        state = mx.nd.load(fname)
        # mx.nd.save of an empty dict loads back as an empty list
        self.load_state_dict(state if isinstance(state, dict) else {})
