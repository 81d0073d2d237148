"""Stages around a codec: what a layer's gradient goes through before and after its
exchange, composed per layer by the plan (BytePS composes its compressors the same
way: error feedback and momentum as decorators around the codec).

A stage has two calls, with the Step of the exchange (the residual memory, and the
Trainer's momentum for this step, or None):

* ``encode(layer, grad, step, **fused)`` -> Payload: what this worker sends;
* ``finish(layer, aggregate, step)``: after the exchange, rewrite the float32
  aggregate in place (or remember something).

Fused stages. A codec whose class lists a stage's work in ``fuses`` (fc_2bit and
shared_2bit: ``("velocity", "bound")``) does that work inside its own operator
(ops.encode_2bit: one operator and two passes over the layer where the stages
would run four operators and six or seven passes, bitwise the same results). The
stage then hands its part down as a keyword instead of running it: MomentumCorrection
passes ``velocity=`` (a kvstore.momentum.Velocity) and BoundedResidual ``bound=``, and
the codec receives them with the plain gradient. What the stages compute does not
change; only where.

``chain(decision, compressors, warmup_steps)`` builds a layer's stages, outermost
first:

    WarmUp -> MomentumCorrection -> BoundedResidual -> ErrorFeedback(codec)

* ErrorFeedback: the codec encodes gradient + residual and leaves in the residual what
  it did not send. The fold, the selection and the residual update run as one fused
  kernel (mxhylo.ops): one pass over the layer, which is why the residual is handed to
  the codec rather than added here.
* BoundedResidual: after the codec, each row of the residual (an output filter of a
  conv weight, an output unit of a dense one) keeps at most the norm of the same row
  of this step's input times the row's mean wait (1 for 2-bit, O/k for top-k: a
  filter sent every O/k steps holds that many steps by design); the rest is dropped. Why: the residual is what error feedback
  delivers late, and near the edge of stability a late delivery is what tips a run
  over (a filter that waited 20 steps lands as one 20-step burst, amplified by
  momentum). Why it holds: with ||r_i|| <= ||u_i|| after every step (u the step's
  input), what row i can send at the next step is at most ||u'_i|| + ||u_i||: this
  step's input and one step's backlog, never a burst of many. The update a row
  receives is then within twice the one dense training applies at the same step, so
  the delay cannot amplify itself through momentum. Under momentum correction u is
  the velocity, which already carries the momentum; under Adam or LARS it is the
  gradient, which those optimizers normalise again. What is dropped is the part of
  old gradients the codec could not keep up with (error feedback stops conserving
  the sum exactly, as with DGC's local clipping). Measured: conv_net (no BatchNorm,
  lr 0.05 constant) in one process, 5 seeds: 96.4% mean / 93.3% worst without the
  bound, 98.0% / 96.0% with it, dense 98.5% / 97.6%; with the bound, 2-bit layers need
  no warm-up (top-k layers still do: ``warmup_steps``).
* MomentumCorrection (kvstore.momentum): with MXNet's momentum SGD, the codec sends
  the velocity, and the aggregate is corrected so that the optimizer's momentum does
  not apply twice. Only where a Trainer's step gives a momentum.
* WarmUp: a compressed layer's first ``warmup_steps`` exchanges travel dense (plain
  gradients, nothing held back): early training is where error feedback's delay
  costs the most.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import ops
from . import momentum as momentum_correction
from .memory import ResidualMemory


@dataclass
class Step:
    """What the stages of one exchange share: memory (the layers' residuals and codec
    state) and momentum (kvstore.momentum.MomentumContext of the Trainer's step, or
    None: no momentum correction this step)."""
    memory: ResidualMemory
    momentum: Optional[object] = None


class ErrorFeedback:
    """The codec itself, with its residual (see the module docstring). A layer planned
    dense after it was compressed (a re-plan) sends what its codec still held, once:
    nothing waits in a residual no codec reads. ``fused``: the outer stages' work the
    codec does in its own pass (module docstring), passed on to it."""

    def __init__(self, codec):
        self.codec = codec

    def encode(self, layer, grad, step, **fused):
        send = grad
        if layer.plan.strategy == "none":
            owed = step.memory.pop_codec_state(layer.plan.name)
            if owed is not None:
                send = grad.astype(np.float32, copy=False) + owed
        return self.codec.encode(layer.plan, send, step.memory, **fused)

    def finish(self, layer, aggregate, step):
        """Nothing to do after the exchange."""


class BoundedResidual:
    """The codec with error feedback, its residual bounded row by row (see the module
    docstring): ||r[i]|| <= ROW_BOUND * ||input[i]|| for every row i after each encode.
    The input is what the codec encoded this step (the velocity under momentum
    correction, else the gradient). With a codec that fuses the bound, the codec
    applies it in its own pass."""

    def __init__(self, inner, fused):
        self.inner, self.fused = inner, fused

    def encode(self, layer, grad, step, **fused):
        plan = layer.plan
        bound = ROW_BOUND * mean_wait(plan)
        if self.fused:
            return self.inner.encode(layer, grad, step, bound=bound, **fused)
        payload = self.inner.encode(layer, grad, step, **fused)
        velocity = fused.get("velocity")
        encoded = grad if velocity is None else velocity.out
        ops.bound_rows(step.memory.residual(plan.name, grad), encoded, bound)
        return payload

    def finish(self, layer, aggregate, step):
        self.inner.finish(layer, aggregate, step)


# what a row of the residual may hold: this many times the norm of its row of the
# step's input, times the steps the codec makes a row wait on average (BoundedResidual)
ROW_BOUND = 1.0


def mean_wait(plan):
    """Steps a row of the layer waits between two sends, on average: 1 where every row
    travels every step (2-bit), O/k for top-k's k of O filters a step. A top-k filter
    holds its wait's worth by design; bounding it to one step (measured: time to
    accuracy on the digits, resnet18, 6 seeds) cost 0.97 point of final accuracy
    against dist_sync."""
    if plan.strategy == "conv_topk":
        return plan.shape[0] / float(plan.k)
    return 1.0


class MomentumCorrection:
    """Compress the velocity m * u + g, and hand the optimizer the corrected aggregate
    (kvstore.momentum). Before the velocity is formed, what the layer holds (its
    velocity and a compressed layer's residual) is brought to this step's units of
    learning rate times rescale_grad (kvstore.momentum, "Units"). Passes through where
    the step has no momentum."""

    def __init__(self, inner, fused):
        self.inner, self.fused = inner, fused

    def encode(self, layer, grad, step):
        if step.momentum is None:
            return self.inner.encode(layer, grad, step)
        name = layer.plan.name
        ratio = momentum_correction.step_ratio(name, step.memory, step.momentum)
        if ratio is not None and ratio != 1.0 and layer.plan.strategy != "none":
            residual = step.memory.residual(name, grad)
            residual *= ratio       # held back at the last step's lr: in this step's units
        if self.fused:          # the codec forms the velocity in its own pass
            velocity = momentum_correction.velocity(name, grad, step.memory, step.momentum,
                                                    ratio)
            payload = self.inner.encode(layer, grad, step, velocity=velocity)
            momentum_correction.keep_velocity(name, velocity.out, step.memory)
            return payload
        velocity = momentum_correction.accumulate(name, grad, step.memory, step.momentum,
                                                  ratio)
        payload = self.inner.encode(layer, velocity, step)
        momentum_correction.keep_velocity(name, velocity, step.memory)
        return payload

    def finish(self, layer, aggregate, step):
        if step.momentum is not None:
            momentum_correction.correct(layer.plan.name, aggregate, step.memory,
                                        step.momentum)
        self.inner.finish(layer, aggregate, step)


class WarmUp:
    """A compressed layer's first ``steps`` exchanges travel dense (``dense``: the
    'none' codec), counted per layer in the memory (so checkpointed)."""

    def __init__(self, inner, dense, steps):
        self.inner, self.dense, self.steps = inner, dense, steps

    def warming(self, layer, memory):
        return (memory.scalar(layer.plan.name, "warmup_done") or 0) < self.steps

    def encode(self, layer, grad, step):
        if self.warming(layer, step.memory):
            return self.dense.encode(layer.plan, grad, step.memory)
        return self.inner.encode(layer, grad, step)

    def finish(self, layer, aggregate, step):
        name = layer.plan.name
        done = step.memory.scalar(name, "warmup_done") or 0
        if done < self.steps:
            step.memory.set_scalar(name, "warmup_done", done + 1)
            return
        self.inner.finish(layer, aggregate, step)


def chain(plan, compressors, warmup_steps, memory):
    """The stages of a layer planned as LayerPlan ``plan`` (outermost first; see the
    module docstring). Momentum correction wraps a compressed layer, and a dense one
    whose velocity lived here before a re-plan (its velocity then runs on and goes out
    whole each step: the optimizer's momentum buffer stays the telescoped sum it was,
    which is dense momentum SGD exactly once nothing is owed)."""
    codec = compressors[plan.strategy]
    stages = ErrorFeedback(codec)
    compressed = plan.strategy != "none"
    if compressed:
        stages = BoundedResidual(stages, "bound" in codec.fuses)
    if compressed or memory.scalar(plan.name, "previous_rescale") is not None:
        stages = MomentumCorrection(stages, compressed and "velocity" in codec.fuses)
    if compressed and warmup_steps:
        stages = WarmUp(stages, compressors["none"], warmup_steps)
    return stages
