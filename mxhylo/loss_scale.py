"""Loss scaling for float16 training: keep small gradients above fp16's underflow.

The loss is multiplied by ``scale`` before backward, so every gradient is ``scale``
times too big; the optimizer divides it out again in float32 (through its
``rescale_grad``), where nothing underflows. A dynamic scaler halves the scale when
a step produced an Inf/NaN gradient (that step is skipped) and doubles it after a run
of ``growth_interval`` good steps, so the scale sits just under the overflow limit.

The scalers here only keep the number; :class:`mxhylo.LARSTrainer` decides when a
step overflowed (:func:`all_finite`) and calls :meth:`update`.
"""
import math

import mxnet as mx

# multi_all_finite takes at most a few hundred arrays per call in MXNet 1.9.1
# (300 crashed the process, 200 did not); stay well below.
_FINITE_CHUNK = 100


def all_finite(arrays):
    """True when no element of any NDArray in ``arrays`` is Inf or NaN.

    ``arrays``: a list of NDArrays of any float dtype (float16 included) on any
    contexts. Uses MXNet's ``multi_all_finite`` (the AMP kernel), one flag per
    context, and blocks once to read the flags.
    """
    by_ctx = {}
    for arr in arrays:
        by_ctx.setdefault(arr.context, []).append(arr)
    flags = []
    for ctx, group in by_ctx.items():
        flag = mx.nd.ones((1,), ctx=ctx)
        for lo in range(0, len(group), _FINITE_CHUNK):
            chunk = group[lo:lo + _FINITE_CHUNK]
            mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=False, out=flag)
        flags.append(flag)
    return all(bool(f.asscalar()) for f in flags)


class StaticLossScaler(object):
    """A fixed loss scale. ``update`` does nothing; overflowing steps are not skipped."""

    dynamic = False

    def __init__(self, scale):
        scale = float(scale)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError("loss scale must be a positive finite number, got %r" % scale)
        self._scale = scale

    @property
    def scale(self):
        """The factor the loss is multiplied by (float)."""
        return self._scale

    def update(self, overflow):  # pylint: disable=unused-argument
        """No-op: a static scale never changes."""

    def state_dict(self):
        """Picklable state, for checkpoints."""
        return {"kind": "static", "scale": self._scale}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned."""
        if state.get("kind") != "static":
            raise ValueError("checkpoint holds a %r loss scaler, this trainer has a static one"
                             % state.get("kind"))
        self._scale = float(state["scale"])


class DynamicLossScaler(object):
    """Loss scale that backs off on overflow and grows after a run of good steps.

    Parameters
    ----------
    init_scale : float
        Starting scale (2**16, as MXNet's AMP).
    growth_factor : float
        Multiplier applied after ``growth_interval`` consecutive good steps (> 1).
    backoff_factor : float
        Multiplier applied on an overflowing step (between 0 and 1; 0.5 halves).
    growth_interval : int
        Number of consecutive good steps before the scale grows (2000, as AMP).
    min_scale, max_scale : float
        Bounds of the scale (max 2**24, as AMP: beyond that even fp32 sums risk overflow).

    Attributes
    ----------
    num_skipped : int
        Steps skipped because of overflow since construction (checkpointed).
    """

    dynamic = True

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, min_scale=1.0, max_scale=2.0 ** 24):
        if not (0 < min_scale <= init_scale <= max_scale and math.isfinite(max_scale)):
            raise ValueError("need 0 < min_scale <= init_scale <= max_scale < inf, got "
                             "%r, %r, %r" % (min_scale, init_scale, max_scale))
        if not growth_factor > 1:
            raise ValueError("growth_factor must be > 1, got %r" % growth_factor)
        if not 0 < backoff_factor < 1:
            raise ValueError("backoff_factor must be in (0, 1), got %r" % backoff_factor)
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError("growth_interval must be a positive integer, got %r"
                             % growth_interval)
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.good_steps = 0      # consecutive good steps since the last change
        self.num_skipped = 0

    @property
    def scale(self):
        """The factor the loss is multiplied by now (float)."""
        return self._scale

    def update(self, overflow):
        """Account one step: ``overflow`` True shrinks the scale, False counts a good step."""
        if overflow:
            self._scale = max(self.min_scale, self._scale * self.backoff_factor)
            self.good_steps = 0
            self.num_skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self._scale = min(self.max_scale, self._scale * self.growth_factor)
                self.good_steps = 0

    def state_dict(self):
        """Picklable state, for checkpoints."""
        return {"kind": "dynamic", "scale": self._scale, "good_steps": self.good_steps,
                "num_skipped": self.num_skipped}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned."""
        if state.get("kind") != "dynamic":
            raise ValueError("checkpoint holds a %r loss scaler, this trainer has a dynamic one"
                             % state.get("kind"))
        self._scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.num_skipped = int(state["num_skipped"])


def make_loss_scaler(spec):
    """Build a scaler from the trainer's ``loss_scale`` argument.

    ``'dynamic'`` -> :class:`DynamicLossScaler` with defaults; a positive number ->
    :class:`StaticLossScaler`; ``None`` -> None (no scaling); a scaler object is
    returned as is (that is how to configure a dynamic scaler).
    """
    if spec is None:
        return None
    if isinstance(spec, (DynamicLossScaler, StaticLossScaler)):
        return spec
    if isinstance(spec, str):
        if spec == "dynamic":
            return DynamicLossScaler()
        raise ValueError("loss_scale must be 'dynamic', a positive number, None or a "
                         "DynamicLossScaler, got %r" % spec)
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise TypeError("loss_scale must be 'dynamic', a positive number, None or a "
                        "DynamicLossScaler, got %r" % (spec,))
    return StaticLossScaler(spec)
