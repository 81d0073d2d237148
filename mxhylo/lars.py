"""LARS for large-batch training: one Gluon Trainer with the whole record-run recipe.

LARS (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888) gives every
layer its own step size, ``eta * ||w|| / (||g|| + wd * ||w||)`` times the global
learning rate, so a batch many times larger than usual can use a large global
rate without the layers whose gradients are large relative to their weights
diverging. Around it: fp16 parameters with fp32 master weights, dynamic loss
scaling, no weight decay and no LARS scaling for biases and BatchNorm beta/gamma,
linear warmup then poly / cosine / step decay.

The update of one parameter, all in float32 (``g`` is the summed gradient the
kvstore returned, ``w`` the float32 master weight)::

    g     = grad / (loss_scale * batch_size * num_workers)
    lr    = schedule(step)                       # warmup, then decay
    if excluded(name):  lr_i, wd_i = lr, 0       # bias, BN beta/gamma
    elif ||w|| > 0 and ||g|| > 0:
                        lr_i = lr * eta * ||w|| / (||g|| + wd * ||w|| + epsilon); wd_i = wd
    else:               lr_i, wd_i = lr, wd
    m = momentum * m - lr_i * (g + wd_i * w)
    w = w + m                                    # then cast to the fp16 parameter

MXNet kernels reused: ``multi_sum_sq`` and ``multi_lars`` (trust ratios of a group
of layers in one call each), ``preloaded_multi_sgd_mom_update`` /
``preloaded_multi_mp_sgd_mom_update`` (and their momentum-free twins: the SGD step
with per-layer learning rates read from an NDArray, with the fp32 master weight and
fp16 write-back), ``multi_all_finite`` (overflow check), and MXNet's
``PolyScheduler`` / ``CosineScheduler`` / ``MultiFactorScheduler`` (warmup + decay).
``mxnet.optimizer.LARS`` itself is not used: it computes the trust ratio from the
fp16 weights and fp16 gradients (``multi_sum_sq`` accumulates fp16 in fp16, so a
loss-scaled gradient's sum of squares overflows to Inf and the layer silently stops
learning), and it picks excluded layers by ``idx2name``, which a Gluon Trainer leaves
empty, so no layer is ever excluded.
"""
import os
import pickle
import re
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, lr_scheduler

from .loss_scale import all_finite, make_loss_scaler

DEFAULT_EXCLUDE = r"(bias|beta|gamma)$"
"""Parameter names matching this regex (``re.search``) get no weight decay and no LARS."""

SCHEDULES = ("poly", "cosine", "step", "constant")

# preloaded_multi_*sgd* kernels take at most 60 weights per call in MXNet 1.9.1
# (100 crashed the process); the Updater's groups are cut to this size as well.
_KERNEL_MAX_WEIGHTS = 60

_CKPT_FORMAT = "mxhylo.LARSTrainer/1"


# ---- bfloat16 needs AVX-512 ------------------------------------------------------
# MXNet 1.9.1's oneDNN (2.4) creates bf16 primitives (Convolution, FullyConnected,
# ...) only on its 'avx512_core' ISA: AVX-512 F, BW, VL and DQ. The bf16
# instructions themselves (avx512_bf16) are used when present and emulated
# otherwise. Elsewhere, e.g. an AVX2-only CPU, the first bf16 convolution fails
# inside oneDNN with "could not create a primitive descriptor iterator"; so does
# any CPU when DNNL_MAX_CPU_ISA caps oneDNN below AVX512_CORE (which is how
# tests/integration/test_lars.py reproduces the failure on an AVX-512 machine).
BF16_CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_ONEDNN_BF16_ISAS = ("AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_AMX",
                     "ALL")


class CPUFeatureError(RuntimeError):
    """This CPU lacks an instruction-set feature the requested computation needs."""


def _cpu_flags():
    """Feature flags of this CPU (/proc/cpuinfo); None when unknown. The probe the
    bf16 check uses (tests replace it)."""
    from .ops import build
    if not build.is_x86_64():
        return set()
    return build.cpu_flags() or None


def bf16_missing_features(cpu_flags=None, environ=None):
    """What keeps MXNet 1.9.1 from computing in bfloat16 on this CPU: the missing
    CPU features (of BF16_CPU_FEATURES) and/or a DNNL_MAX_CPU_ISA setting below
    AVX512_CORE. [] when bf16 can run (or the CPU's flags cannot be read)."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    environ = os.environ if environ is None else environ
    missing = [] if flags is None else [f for f in BF16_CPU_FEATURES if f not in flags]
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKLDNN_MAX_CPU_ISA"):
        cap = environ.get(var, "").strip().upper()
        if cap and cap not in _ONEDNN_BF16_ISAS:
            missing.append("%s=%s (oneDNN capped below AVX512_CORE)" % (var, cap))
            break
    return missing


def check_bf16_support(what="bfloat16 compute"):
    """Raise CPUFeatureError naming what is missing when this CPU cannot run
    MXNet's bf16 kernels; call it before the first bf16 forward."""
    missing = bf16_missing_features()
    if missing:
        from .ops import build
        raise CPUFeatureError(
            "%s needs a CPU with AVX-512 (%s: what MXNet 1.9.1's oneDNN requires for "
            "bf16 Convolution and FullyConnected; otherwise it fails with 'could not "
            "create a primitive descriptor iterator'). This CPU (%s) lacks: %s. Train "
            "in float32 here." % (what, ", ".join(BF16_CPU_FEATURES), build.cpu_model(),
                                  ", ".join(missing)))


def bf16_amp_active():
    """True after mxnet.contrib.amp.init(target_dtype='bfloat16') in this process."""
    try:
        from mxnet.contrib.amp import amp as _amp
    except ImportError:  # pragma: no cover - MXNet without contrib.amp
        return False
    if not getattr(_amp, "_amp_initialized", False):
        return False
    wrapper = getattr(mx.nd, "Convolution", None)  # AMP wraps it with its target dtype
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, np.dtype) and value == _amp.bfloat16:
            return True
    return False


def _is_bf16(dtype):
    try:
        return np.dtype(dtype).names == ("bfloat16",)
    except TypeError:
        return False


def _flatten(groups):
    return [arr for group in groups for arr in group]


def _fp32(arr):
    """A float32 view of ``arr``: norms of fp16 arrays must not be accumulated in fp16."""
    return arr if arr.dtype == np.float32 else arr.astype(np.float32)


class LARSOptimizer(mx.optimizer.Optimizer):
    """LARS with momentum and fp32 master weights (the update in the module docstring).

    Parameters
    ----------
    momentum : float
        Momentum coefficient in [0, 1).
    eta : float
        LARS trust coefficient (> 0).
    epsilon : float
        Added to the trust ratio's denominator (>= 0).
    exclude_indices : iterable of int
        Parameter indices that get neither weight decay nor LARS scaling.
    **kwargs
        ``mx.optimizer.Optimizer`` arguments: learning_rate, lr_scheduler, wd,
        rescale_grad, clip_gradient, multi_precision, param_dict.

    State per parameter: momentum (or None when momentum is 0), and for a float16
    weight with ``multi_precision`` the tuple ``(momentum_fp32, master_weight_fp32)``,
    the layout MXNet's multi-precision SGD kernels take.
    """

    def __init__(self, momentum=0.9, eta=0.001, epsilon=1e-9, exclude_indices=(), **kwargs):
        super(LARSOptimizer, self).__init__(**kwargs)
        self.momentum = float(momentum)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.exclude_indices = frozenset(exclude_indices)
        size = int(os.getenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", "4"))
        self.aggregate_num = max(1, min(size, _KERNEL_MAX_WEIGHTS))

    def create_state(self, index, weight):
        if self.momentum == 0.0:
            return None
        return mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype)

    def create_state_multi_precision(self, index, weight):
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (self.create_state(index, master), master)
        if weight.dtype == np.float16:
            warnings.warn("LARSOptimizer: float16 weight updated in float16 (multi_precision="
                          "False); small updates will be rounded away")
        return self.create_state(index, weight)

    def update(self, index, weight, grad, state):
        self._update_impl(index, weight, grad, state, multi_precision=False)

    def update_multi_precision(self, index, weight, grad, state):
        first = weight[0] if isinstance(weight, (list, tuple)) else weight
        self._update_impl(index, weight, grad, state,
                          multi_precision=self.multi_precision and first.dtype == np.float16)

    def _update_impl(self, indices, weights, grads, states, multi_precision):
        if not isinstance(indices, (list, tuple)):
            indices, weights, grads, states = [indices], [weights], [grads], [states]
        for w, g in zip(weights, grads):
            if w.stype != "default" or g.stype != "default":
                raise NotImplementedError("LARSOptimizer supports dense weights and gradients "
                                          "only, got %s/%s" % (w.stype, g.stype))
        self._update_count(indices)
        lrs = self._get_lrs(indices)
        wds = self._get_wds(indices)
        for lo in range(0, len(indices), _KERNEL_MAX_WEIGHTS):
            hi = lo + _KERNEL_MAX_WEIGHTS
            self._apply(indices[lo:hi], weights[lo:hi], grads[lo:hi], states[lo:hi],
                        lrs[lo:hi], wds[lo:hi], multi_precision)

    def _apply(self, indices, weights, grads, states, lrs, wds, multi_precision):
        """One kernel call: LARS layers first, then excluded ones (order is free)."""
        lars = [k for k, i in enumerate(indices) if i not in self.exclude_indices]
        plain = [k for k, i in enumerate(indices) if i in self.exclude_indices]
        order = lars + plain
        ctx = weights[0].context
        lr_arr = mx.nd.array([lrs[k] for k in order], ctx=ctx, dtype=np.float32)
        wd_arr = mx.nd.array([wds[k] for k in lars] + [0.0] * len(plain), ctx=ctx,
                             dtype=np.float32)
        masters = [states[k][1] if multi_precision else weights[k] for k in order]
        if lars:
            n = len(lars)
            # Trust ratio in fp32 from the master weights (fp16 sums of squares overflow).
            w_ss = mx.nd.multi_sum_sq(*[_fp32(m) for m in masters[:n]], num_arrays=n)
            g_ss = mx.nd.multi_sum_sq(*[_fp32(grads[k]) for k in lars], num_arrays=n)
            lars_lrs = lr_arr[:n] if n < len(order) else lr_arr
            mx.nd.multi_lars(lars_lrs, w_ss, g_ss, wd_arr[:n] if n < len(order) else wd_arr,
                             eta=self.eta, eps=self.epsilon, rescale_grad=self.rescale_grad,
                             out=lars_lrs)
        ws = [weights[k] for k in order]
        gs = [grads[k] for k in order]
        kwargs = {"rescale_grad": self.rescale_grad, "num_weights": len(ws), "out": ws}
        if self.clip_gradient:
            kwargs["clip_gradient"] = self.clip_gradient
        if self.momentum > 0:
            kwargs["momentum"] = self.momentum
        if multi_precision:
            moms = [states[k][0] for k in order]
            if self.momentum > 0:
                mx.nd.preloaded_multi_mp_sgd_mom_update(
                    *_flatten(zip(ws, gs, moms, masters)), lr_arr, wd_arr, **kwargs)
            else:
                mx.nd.preloaded_multi_mp_sgd_update(
                    *_flatten(zip(ws, gs, masters)), lr_arr, wd_arr, **kwargs)
        else:
            if self.momentum > 0:
                moms = [states[k] for k in order]
                mx.nd.preloaded_multi_sgd_mom_update(
                    *_flatten(zip(ws, gs, moms)), lr_arr, wd_arr, **kwargs)
            else:
                mx.nd.preloaded_multi_sgd_update(
                    *_flatten(zip(ws, gs)), lr_arr, wd_arr, **kwargs)


def _positive_int(name, value, allow_zero=False):
    if isinstance(value, bool) or int(value) != value or value < (0 if allow_zero else 1):
        raise ValueError("%s must be a %s integer, got %r"
                         % (name, "non-negative" if allow_zero else "positive", value))
    return int(value)


def make_schedule(learning_rate, schedule="poly", warmup_steps=0, total_steps=None,
                  poly_power=2.0, final_lr=0.0, step_boundaries=None, step_factor=0.1,
                  warmup_begin_lr=0.0):
    """The learning-rate schedule as an MXNet LRScheduler (None for a constant rate).

    Steps count optimizer updates (skipped overflow steps do not count). Update
    ``t`` (1-based) uses: during warmup (``t < warmup_steps``)
    ``warmup_begin_lr + (learning_rate - warmup_begin_lr) * t / warmup_steps``; after it
    ``poly``: ``final_lr + (learning_rate - final_lr) * (1 - (t - W) / (T - W)) ** poly_power``,
    ``cosine``: ``final_lr + (learning_rate - final_lr) * (1 + cos(pi (t - W) / (T - W))) / 2``
    (W = warmup_steps, T = total_steps, both needed), ``step``: ``learning_rate *
    step_factor ** k`` with k the number of ``step_boundaries`` below ``t``,
    ``constant``: ``learning_rate``.
    """
    if schedule not in SCHEDULES:
        raise ValueError("unknown schedule %r; choose one of %s" % (schedule, ", ".join(SCHEDULES)))
    warmup_steps = _positive_int("warmup_steps", warmup_steps, allow_zero=True)
    if not 0 <= warmup_begin_lr <= learning_rate:
        raise ValueError("warmup_begin_lr must be in [0, learning_rate], got %r" % warmup_begin_lr)
    warm = {"base_lr": learning_rate, "warmup_steps": warmup_steps,
            "warmup_begin_lr": warmup_begin_lr}
    if schedule in ("poly", "cosine"):
        if total_steps is None:
            raise ValueError("schedule %r needs total_steps (the number of updates of the "
                             "whole run)" % schedule)
        total_steps = _positive_int("total_steps", total_steps)
        if total_steps <= warmup_steps:
            raise ValueError("total_steps (%d) must exceed warmup_steps (%d)"
                             % (total_steps, warmup_steps))
        if not 0 <= final_lr <= learning_rate:
            raise ValueError("final_lr must be in [0, learning_rate], got %r" % final_lr)
        if schedule == "poly":
            if not poly_power > 0:
                raise ValueError("poly_power must be > 0, got %r" % poly_power)
            return lr_scheduler.PolyScheduler(total_steps, pwr=poly_power, final_lr=final_lr,
                                              **warm)
        return lr_scheduler.CosineScheduler(total_steps, final_lr=final_lr, **warm)
    if schedule == "step":
        if not step_boundaries:
            raise ValueError("schedule 'step' needs step_boundaries (increasing update counts)")
        bounds = [_positive_int("step_boundaries[i]", b) for b in step_boundaries]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError("step_boundaries must increase, got %r" % (step_boundaries,))
        if not 0 < step_factor <= 1:
            raise ValueError("step_factor must be in (0, 1], got %r" % step_factor)
        return lr_scheduler.MultiFactorScheduler(bounds, factor=step_factor, **warm)
    if warmup_steps == 0:
        return None
    # factor 1 never changes the rate: a constant schedule with MXNet's warmup.
    return lr_scheduler.FactorScheduler(step=10 ** 9, factor=1.0, **warm)


class LARSTrainer(gluon.Trainer):
    """A Gluon Trainer running LARS with mixed precision, loss scaling and warmup + decay.

    Use it as ``gluon.Trainer``: ``step(batch_size)`` after backward (or
    ``allreduce_grads()`` then ``update(batch_size)``), ``learning_rate``,
    ``save_states`` / ``load_states``. Scale the loss before backward::

        with autograd.record():
            loss = loss_fn(net(x), y)
        autograd.backward(trainer.scale_loss(loss))
        trainer.step(batch_size)          # per-worker batch; False when the step was skipped

    Parameters
    ----------
    params : ParameterDict, dict or list of Parameter
        What to train (``net.collect_params()``).
    learning_rate : float
        Peak global learning rate (after warmup, before decay), > 0.
    momentum : float
        In [0, 1).
    wd : float
        Weight decay (L2 coefficient) for non-excluded parameters, >= 0.
    eta : float
        LARS trust coefficient, > 0 (0.001 as in the LARS paper).
    epsilon : float
        Added to the trust ratio's denominator, >= 0.
    warmup_steps : int
        Number of updates of linear warmup from ``warmup_begin_lr``.
    total_steps : int or None
        Number of updates of the whole run; the poly and cosine decays reach
        ``final_lr`` there. Required for 'poly' and 'cosine'.
    schedule : {'poly', 'cosine', 'step', 'constant'}
        Decay after warmup; see :func:`make_schedule` for the formulas.
    poly_power, final_lr, step_boundaries, step_factor, warmup_begin_lr
        Schedule details (:func:`make_schedule`).
    multi_precision : bool
        float16 parameters get float32 master weights and float32 momentum; the
        update (LARS trust ratio included) runs in float32 and is written back.
    loss_scale : 'dynamic', float, None or DynamicLossScaler
        'dynamic': start at 2**16, halve and skip the step on Inf/NaN gradients, double
        after 2000 good steps (pass ``mxhylo.loss_scale.DynamicLossScaler(...)`` to
        configure). A number: a fixed scale. None: no scaling (fp32 or bfloat16 AMP).
    kvstore : str, KVStore, KVStoreBase or None
        As gluon.Trainer: 'device', 'dist_sync', 'dist_sync_hylo', a hylo store object...
        The update always runs on the workers (update_on_kvstore=False), so 'async'
        stores are refused.
    exclude : str, list of str or None
        Regexes (``re.search`` on the parameter name) of parameters that get neither
        weight decay nor LARS scaling. Default: names ending in bias, beta or gamma.
    clip_gradient : float or None
        Clip the unscaled, batch-averaged gradient elementwise to [-c, c].

    Attributes
    ----------
    loss_scale : float
        The loss scale in use (1.0 without scaling).
    loss_scaler : DynamicLossScaler, StaticLossScaler or None
        Its state: ``good_steps``, ``num_skipped``.
    excluded : list of str
        Names of the parameters that get neither weight decay nor LARS.
    num_update : int
        Updates applied so far (the schedule position).
    """

    def __init__(self, params, learning_rate, momentum=0.9, wd=1e-4, eta=0.001, epsilon=1e-9,
                 warmup_steps=0, total_steps=None, schedule="poly", poly_power=2.0,
                 final_lr=0.0, step_boundaries=None, step_factor=0.1, warmup_begin_lr=0.0,
                 multi_precision=True, loss_scale="dynamic", kvstore="device",
                 exclude=DEFAULT_EXCLUDE, clip_gradient=None):
        _check_number("learning_rate", learning_rate, low=0.0, open_low=True)
        _check_number("momentum", momentum, low=0.0, high=1.0)
        _check_number("wd", wd, low=0.0)
        _check_number("eta", eta, low=0.0, open_low=True)
        _check_number("epsilon", epsilon, low=0.0)
        if clip_gradient is not None:
            _check_number("clip_gradient", clip_gradient, low=0.0, open_low=True)
        kv_type = kvstore if isinstance(kvstore, str) else getattr(kvstore, "type", "")
        if "async" in (kv_type or ""):
            raise ValueError("LARSTrainer updates on the workers (the trust ratio needs the "
                             "whole summed gradient); asynchronous kvstore %r is not supported"
                             % kv_type)
        patterns = [exclude] if isinstance(exclude, str) else list(exclude or [])
        try:
            self._exclude = [re.compile(p) for p in patterns]
        except (re.error, TypeError) as err:
            raise ValueError("exclude must be regexes over parameter names: %s" % err)
        sched = make_schedule(float(learning_rate), schedule, warmup_steps, total_steps,
                              poly_power, final_lr, step_boundaries, step_factor,
                              warmup_begin_lr)
        self._loss_scaler = make_loss_scaler(loss_scale)
        optimizer = LARSOptimizer(momentum=momentum, eta=eta, epsilon=epsilon,
                                  learning_rate=float(learning_rate), lr_scheduler=sched,
                                  wd=float(wd), clip_gradient=clip_gradient,
                                  multi_precision=bool(multi_precision))
        super(LARSTrainer, self).__init__(params, optimizer, kvstore=kvstore,
                                          update_on_kvstore=False)
        if self._contains_sparse_weight or self._contains_sparse_grad:
            raise ValueError("LARSTrainer supports dense parameters and gradients only")
        if bf16_amp_active():
            check_bf16_support("bfloat16 AMP (mxnet.contrib.amp.init(target_dtype='bfloat16'))")
        elif any(_is_bf16(p.dtype) for p in self._params):
            check_bf16_support("training bfloat16 parameters")
        self.excluded = [p.name for p in self._params
                         if any(rx.search(p.name) for rx in self._exclude)]
        self._optimizer.exclude_indices = frozenset(
            i for i, p in enumerate(self._params) if p.name in self.excluded)
        self._loss_scaled = False      # scale_loss() called since the last step
        self._pending_overflow = None  # allreduce_grads()' verdict, read by update()
        self._flag_key = None          # kvstore key of the overflow vote, once created

    # ---- loss scaling -------------------------------------------------------------
    @property
    def loss_scaler(self):
        return self._loss_scaler

    @property
    def loss_scale(self):
        return self._loss_scaler.scale if self._loss_scaler is not None else 1.0

    @property
    def num_update(self):
        return self._optimizer.num_update

    def scale_loss(self, loss):
        """``loss`` (an NDArray or a list of them) times the current loss scale.

        Call backward on the result. Without loss scaling the loss is returned as is,
        so the same loop works with ``loss_scale=None``.
        """
        self._loss_scaled = True
        scale = self.loss_scale
        if self._loss_scaler is None:
            return loss
        # Record the product even when called after the record() block, so that
        # backward reaches the network through it.
        with autograd.record(train_mode=autograd.is_training()):
            if isinstance(loss, (list, tuple)):
                return [l * scale for l in loss]
            return loss * scale

    def _check_loss_scaled(self):
        if self._loss_scaler is not None and not self._loss_scaled:
            raise RuntimeError("LARSTrainer has loss scaling on (loss_scale=%r) but "
                               "scale_loss() was not called since the last step: back-"
                               "propagate trainer.scale_loss(loss), or create the trainer "
                               "with loss_scale=None" % self.loss_scale)

    # ---- the step -----------------------------------------------------------------
    def _ensure_kvstore(self):
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        if (self._flag_key is None and self._num_workers() > 1 and self._loss_scaler is not None
                and self._loss_scaler.dynamic):
            # One extra tiny key: the workers' overflow votes are summed so that all of
            # them skip the same steps (a worker that skipped a pushpull alone would
            # deadlock the others).
            self._flag_key = len(self._params)
            ctx = self._contexts[0]
            self._kvstore.broadcast(self._flag_key, mx.nd.zeros((1,), ctx=ctx),
                                    out=mx.nd.zeros((1,), ctx=ctx))

    def _num_workers(self):
        """Workers whose gradients the kvstore's pushpull sums (1 without a kvstore)."""
        if self._kvstore is None:
            return 1
        return max(1, int(getattr(self._kvstore, "num_workers", 1)))

    def _grads(self):
        return [g for p in self._params if p.grad_req != "null" for g in p.list_grad()]

    def _overflow_before_communication(self):
        """Any Inf/NaN in this worker's (or, voted, any worker's) gradients?"""
        if self._loss_scaler is None or not self._loss_scaler.dynamic:
            return False
        overflow = not all_finite(self._grads())
        if self._flag_key is not None:
            vote = mx.nd.array([1.0 if overflow else 0.0], ctx=self._contexts[0])
            self._kvstore.pushpull(self._flag_key, vote, out=vote)
            overflow = vote.asscalar() > 0
        return overflow

    def allreduce_grads(self):
        """Check for overflow, then (unless overflowing) sum the gradients over devices
        and workers. Nothing is communicated for an overflowing step except the vote,
        so the kvstore's residuals stay untouched."""
        self._ensure_kvstore()
        self._check_loss_scaled()
        self._pending_overflow = self._overflow_before_communication()
        if not self._pending_overflow:
            self._allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """Apply the LARS update to the reduced gradients (after ``allreduce_grads``).

        ``batch_size``: samples per worker in this step; gradients are divided by
        ``batch_size * num_workers * loss_scale``. Returns False when the step was
        skipped for overflow (the loss scale then shrank), True otherwise.
        """
        _check_number("batch_size", batch_size, low=0.0, open_low=True)
        self._ensure_kvstore()
        overflow = self._pending_overflow
        self._pending_overflow = None
        if overflow is None:
            self._check_loss_scaled()
            overflow = self._overflow_before_communication()
        elif not overflow and self._kvstore is not None and self._loss_scaler is not None \
                and self._loss_scaler.dynamic \
                and any(g.dtype == np.float16 for g in self._grads()):
            # A sum of finite fp16 gradients can still overflow; every worker holds the
            # same sum, so this check needs no vote. (The kvstore has already absorbed
            # this step's residuals; only the update is skipped.)
            overflow = not all_finite(self._grads())
        self._loss_scaled = False
        if overflow:
            self._loss_scaler.update(True)
            for p in self._params:
                if p.grad_req != "null":
                    for data in p.list_data():
                        data._fresh_grad = False
            return False
        self._optimizer.rescale_grad = self._scale / (
            batch_size * self._num_workers() * self.loss_scale)
        self._update(ignore_stale_grad)
        if self._loss_scaler is not None:
            self._loss_scaler.update(False)
        return True

    def step(self, batch_size, ignore_stale_grad=False):
        """``allreduce_grads()`` then ``update(batch_size)``; returns False if skipped.

        ``batch_size``: samples per worker; with a distributed kvstore the average is
        over all workers' samples (do not multiply by the number of workers).
        """
        _check_number("batch_size", batch_size, low=0.0, open_low=True)
        self.allreduce_grads()
        return self.update(batch_size, ignore_stale_grad)

    # ---- checkpoints ----------------------------------------------------------------
    def _residual_file(self, fname):
        """Side file of this worker's kvstore residuals (one per rank when distributed)."""
        if self._num_workers() > 1:
            return "%s.residuals.rank%d" % (fname, int(self._kvstore.rank))
        return fname + ".residuals"

    def save_states(self, fname):
        """Save what resuming bit-for-bit needs, besides the parameters themselves.

        ``fname`` gets the optimizer (schedule position, hyper-parameters), momentum and
        fp32 master weights, and the loss scaler's state; when the kvstore has
        ``save_residuals``, its error-feedback residuals go to ``fname + '.residuals'``
        (``'.residuals.rank<r>'`` with several workers; with hylo's compressed pull the
        servers' residuals too, which makes this call collective: every worker calls
        it at the same step). Save the parameters with ``net.save_parameters``. The
        write is atomic.
        """
        self._ensure_kvstore()
        state = {"format": _CKPT_FORMAT,
                 "updater": self._updaters[0].get_states(dump_optimizer=True),
                 "loss_scaler": (self._loss_scaler.state_dict()
                                 if self._loss_scaler is not None else None),
                 "residuals": False}
        save_residuals = getattr(self._kvstore, "save_residuals", None)
        if callable(save_residuals):
            save_residuals(self._residual_file(fname))
            state["residuals"] = True
        tmp = "%s.tmp%d" % (fname, os.getpid())
        with open(tmp, "wb") as fout:
            pickle.dump(state, fout, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, fname)

    def load_states(self, fname):
        """Restore what :meth:`save_states` wrote (and the residual side file).

        As with gluon.Trainer, the optimizer saved in the file (learning rate, schedule,
        wd, ...) replaces this trainer's; the loss scaler must be of the same kind.
        """
        self._ensure_kvstore()
        with open(fname, "rb") as fin:
            try:
                state = pickle.load(fin)
            except Exception as err:
                raise ValueError("%s is not a LARSTrainer checkpoint (%s)" % (fname, err))
        if not isinstance(state, dict) or state.get("format") != _CKPT_FORMAT:
            raise ValueError("%s is not a LARSTrainer checkpoint (expected format %r)"
                             % (fname, _CKPT_FORMAT))
        for updater in self._updaters:
            updater.set_states(state["updater"])
            updater.optimizer = self._updaters[0].optimizer
        self._optimizer = self._updaters[0].optimizer
        self._optimizer.param_dict = {i: p for i, p in enumerate(self._params)}
        if state["loss_scaler"] is not None:
            if self._loss_scaler is None:
                warnings.warn("checkpoint has a loss scaler; this trainer has loss_scale=None "
                              "and ignores it")
            else:
                self._loss_scaler.load_state_dict(state["loss_scaler"])
        if state["residuals"]:
            load_residuals = getattr(self._kvstore, "load_residuals", None)
            if callable(load_residuals):
                load_residuals(self._residual_file(fname))
            else:
                warnings.warn("checkpoint has kvstore residuals but this trainer's kvstore "
                              "cannot load them; resuming without them")
        self._pending_overflow = None
        self._loss_scaled = False


def _check_number(name, value, low=None, high=None, open_low=False):
    """Raise ValueError unless ``value`` is a finite real number in the given range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or not np.isfinite(value):
        raise ValueError("%s must be a finite number, got %r" % (name, value))
    if low is not None and (value < low or (open_low and value == low)):
        raise ValueError("%s must be %s %g, got %r" % (name, ">" if open_low else ">=", low, value))
    if high is not None and value >= high:
        raise ValueError("%s must be < %g, got %r" % (name, high, value))
