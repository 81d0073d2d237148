"""Momentum correction (Lin et al., "Deep Gradient Compression", ICLR 2018) for layers
whose gradients travel compressed with error feedback, under a momentum-SGD Trainer.

Why: with error feedback alone, a filter or element that waits T steps in the residual
arrives as the sum of T gradients, and only then does the Trainer's momentum start to
spread it over the next 1/(1 - m) steps: its effect comes late and in one burst. On
conv nets at common learning rates that burst is what made compressed training fall
behind dense per step or collapse (docs/BENCHMARKS.md, accuracy). DGC's remedy, done here:

* each worker keeps a velocity per compressed layer, ``u <- m * u + g``, and the codec
  compresses ``u`` (plus the residual) instead of ``g``: what leaves is momentum the
  dense run would already have applied;
* the velocity runs on as dense momentum's would: error feedback then delivers, over
  the steps, exactly the sum of the velocities, that is what dense momentum SGD
  applies, only later. DGC's *factor masking* (zero ``u`` where a value was sent) is
  not done: a value sent every T steps would restart its velocity from zero each time
  and receive (T - m (1 - m^T) / (1 - m)) / T of dense's momentum-amplified step: 46%
  at T = 12 (a conv layer sending 8% of its filters), 23% at T = 4, 10% for a 2-bit
  element sent every step (m = 0.9);
* the sum of the workers' sent velocities must reach the weights as a plain SGD step,
  not through the Trainer's momentum a second time. The store does not touch the
  optimizer; it hands it ``agg_t - m * (lr_{t-1} c_{t-1}) / (lr_t c_t) * agg_{t-1}``
  instead of ``agg_t`` (``c`` the optimizer's rescale_grad, ``lr`` its learning rate
  at that step): the optimizer's momentum buffer then telescopes to exactly
  ``-lr_t * c_t * agg_t`` for the gradient part (weight decay keeps its usual
  momentum), under any learning-rate schedule. Without the ratio of learning rates a
  decaying schedule (cosine) would leave ``m * c * (lr_{t-1} - lr_t) * agg_{t-1}`` in
  the buffer at every step: near the schedule's end, where lr_t is small, a
  leftover as large as the step itself. A step with lr 0 keeps the rescale ratio only
  (nothing can cancel there). Gradient clipping in the optimizer sees the corrected
  values, not the raw sums.

Units. The optimizer applies ``lr_t * c_t`` to what arrives at step t, whenever it was
computed. Dense momentum SGD applies each gradient at the learning rate of its own
step (its buffer holds ``lr_s c_s g_s`` sums). So what a layer holds between steps, its
velocity and a compressed layer's residual, is kept in units of the coming step:
before each step both are multiplied by ``(lr_{t-1} c_{t-1}) / (lr_t c_t)``
(:func:`step_ratio`; the velocity through ``m`` in the same pass). A gradient held back
T steps then reaches the weights with the learning rate of the step it was computed
in, and where every row is sent the store's momentum SGD is MXNet's, under any
schedule: a Dense(64) of 256 inputs, top-k sending all rows, 12 steps of a cosine
schedule, differs from dense by 1.5e-8 (4.2e-3 when the held state kept its units).

Used with gluon.Trainer's 'sgd' optimizer (momentum > 0); not with other optimizers
(LARS rescales per layer from the gradient's norm, Adam keeps its own moments), where
the store sends plain gradients. State (velocity, previous aggregate, previous
rescale) lives in the layer's ResidualMemory, so it is part of checkpoints.
"""
from dataclasses import dataclass

import mxnet as mx

from .. import ops


@dataclass(frozen=True)
class MomentumContext:
    """What the store knows of the optimizer for this step.

    momentum: the optimizer's momentum coefficient m; rescale: its rescale_grad c_t;
    lr: the learning rate it applies at this step (before per-parameter lr_mult, which
    cancels in the ratio of two steps).
    """
    momentum: float
    rescale: float
    lr: float = 1.0


def from_optimizer(optimizer):
    """The MomentumContext of a Trainer's optimizer, or None where correction does not
    apply (not MXNet's SGD, or no momentum)."""
    if type(optimizer) is not mx.optimizer.SGD:      # subclasses may update otherwise
        return None
    momentum = float(getattr(optimizer, "momentum", 0.0) or 0.0)
    if momentum <= 0.0:
        return None
    return MomentumContext(momentum, float(optimizer.rescale_grad), step_lr(optimizer))


def step_lr(optimizer):
    """The learning rate ``optimizer`` will apply in its coming update: its scheduler at
    the coming update count (Optimizer._update_count adds 1 before _get_lrs reads it),
    or its fixed lr."""
    if optimizer.lr_scheduler is not None:
        return float(optimizer.lr_scheduler(optimizer.num_update + 1))
    return float(optimizer.lr)


@dataclass(frozen=True)
class Velocity:
    """A velocity to be formed inside a codec's own pass (a codec that fuses it,
    kvstore.compressors): ``out <- previous * momentum + grad``. previous: the layer's
    velocity (float32 NDArray, read only); out: its spare, where the new one goes."""
    previous: mx.nd.NDArray
    momentum: float
    out: mx.nd.NDArray


def velocity(name, grad, memory, ctx, ratio=None):
    """The Velocity of layer ``name`` at this step, not formed yet: ``m * ratio * u +
    grad``, ``ratio`` the :func:`step_ratio` (None: 1) that brings ``u`` to this
    step's units; ``u`` itself changes only in :func:`keep_velocity`, after a
    successful encode."""
    m = ctx.momentum if ratio is None else ctx.momentum * ratio
    return Velocity(memory.array(name, "velocity", grad), m, memory.spare(name, grad))


def accumulate(name, grad, memory, ctx, ratio=None):
    """The :func:`velocity` formed: a float32 NDArray (the layer's spare)."""
    v = velocity(name, grad, memory, ctx, ratio)
    return ops.momentum_velocity(grad, v.previous, v.momentum, out=v.out)


def keep_velocity(name, velocity, memory):
    """After a successful encode, ``velocity`` (the spare :func:`accumulate` or a fused
    codec wrote) becomes the layer's velocity (a failed encode leaves the old one:
    nothing was sent)."""
    memory.swap_velocity(name, velocity)


def step_ratio(name, memory, ctx):
    """(lr_{t-1} c_{t-1}) / (lr_t c_t): what one unit of layer ``name``'s gradient sum
    was worth at its previous step, in units of this step's (None before its first
    step; the rescale ratio alone where this step's lr is 0)."""
    last_rescale = memory.scalar(name, "previous_rescale")
    if last_rescale is None:
        return None
    ratio = last_rescale / ctx.rescale
    last_lr = memory.scalar(name, "previous_lr")
    if last_lr is not None and ctx.lr > 0:
        ratio *= last_lr / ctx.lr
    return ratio


def correct(name, aggregate, memory, ctx):
    """Rewrite ``aggregate`` (float32 NDArray, the workers' summed velocities) in place
    into what the optimizer must receive, and remember it for the next step."""
    previous = memory.array(name, "previous_aggregate", aggregate)
    ratio = step_ratio(name, memory, ctx)
    if ratio is None:
        previous[:] = aggregate
    else:
        ops.momentum_correct(aggregate, previous, ctx.momentum * ratio)
    memory.set_scalar(name, "previous_rescale", ctx.rescale)
    memory.set_scalar(name, "previous_lr", ctx.lr)
