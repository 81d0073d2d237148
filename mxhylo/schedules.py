"""Batch size and momentum that change during training, for any Gluon Trainer.

    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.1, 'momentum': 0.9}, kvstore='dist_sync_hylo')
    mxhylo.schedules.attach(trainer, iters_per_epoch=len(train_data),
                            batch=mxhylo.schedules.StepBatch([5, 10]),
                            momentum=mxhylo.schedules.OneCycleMomentum(15))
    for x, y in train_data:                     # the loop does not change
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])

**Batch size by gradient accumulation.** ``trainer.step()`` is still called once per
micro-batch. While fewer than k micro-batches have been seen since the last update,
it only adds the micro-batch's gradients into a sum the schedule keeps (one buffer per
gradient array, made when k first exceeds 1). At the k-th it adds that sum into the
parameters' gradients and runs the Trainer's own step once, for the summed batch (the
gradient is the mean over all k micro-batches' samples). So one exchange and one update
happen per k micro-batches, on any kvstore (hylo, dist_sync, Horovod's
DistributedTrainer) and with mxhylo.LARSTrainer: an effective batch k times larger
costs 1/k of the exchanges per epoch. k is read from the batch schedule when an
accumulation starts, so it changes only between updates. Backward keeps writing the
gradients (``grad_req='write'``): at k = 1 nothing is added or zeroed, and at any k
backward runs as fast as without a schedule (MXNet's ``grad_req='add'`` backward took
a third longer for resnet18_v1b); a parameter already set to ``grad_req='add'`` is
refused with a batch schedule.

**Epochs.** A schedule is a function of the epoch, a float: the micro-batches this
worker has stepped, divided by ``iters_per_epoch`` (its step() calls per epoch).

**Learning rate.** The optimizer's lr scheduler (if any) is read at the micro-batch
count the update completes, not at the update count: a schedule sized for the fixed
batch (gluoncv's ``iters_per_epoch * epochs``) still ends at its last epoch when k
grows. Under ``python -m mxhylo.run`` the scheduler is already read at W times that
count (mxhylo.paced_schedule), the pace of one process with batch W*b; the two compose
exactly: the scheduler sees W * (micro-batches so far). Then, with ``lr_scaling=
'linear'`` (the default), the lr is multiplied by k / k0 (k0 the schedule's k at epoch
0): the linear scaling rule, so an epoch moves the weights as far at any k. With
``lr_scaling=None`` the lr is the scheduler's: the batch growth replaces its decay
("Don't decay the learning rate, increase the batch size", Smith et al. 2018).

**Momentum** is set on the optimizer before each update, from the momentum schedule at
the epoch the update completes. The optimizer must have been made with momentum > 0
(MXNet's SGD keeps no momentum buffer otherwise). hylo's momentum correction reads the
optimizer's momentum at every step, so it stays exact when m changes
(kvstore.momentum).

**Updates on the workers.** A schedule changes the optimizer between updates, and
MXNet's dist_sync sends its optimizer to the servers once. So ``attach`` makes a
Trainer whose ``update_on_kvstore`` was left unset update on the workers (a hylo store
then takes the workers' route), and refuses one that asked for updates on the
servers. It must be called before the Trainer's first step.

**Checkpoints.** The schedules and their counters live on the optimizer
(``optimizer.mxhylo_schedules``), so ``trainer.save_states`` writes them and
``trainer.load_states`` brings them back; a run resumed at an update boundary
continues bitwise. Gradients summed since the last update are not saved: save after an
update (``trainer.schedules.pending == 0``).
"""
import math

import mxnet as mx

LR_SCALINGS = ("linear", None)


# ------------------------------------------------------------------------------ schedules

class StepBatch:
    """k = base * factor ** (number of milestones reached): micro-batches per update.

    milestones: epochs (increasing) at which k is multiplied by ``factor``."""

    def __init__(self, milestones, factor=2, base=1):
        self.milestones = [float(m) for m in milestones]
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])):
            raise ValueError("StepBatch milestones must increase, got %r" % (milestones,))
        if not isinstance(factor, int) or factor < 1:
            raise ValueError("StepBatch factor must be an int >= 1, got %r" % (factor,))
        if not isinstance(base, int) or base < 1:
            raise ValueError("StepBatch base must be an int >= 1 (micro-batches per "
                             "update), got %r" % (base,))
        self.factor, self.base = factor, base

    def __call__(self, epoch):
        return self.base * self.factor ** sum(1 for m in self.milestones if epoch >= m)

    def __repr__(self):
        return "StepBatch(%r, factor=%d, base=%d)" % (self.milestones, self.factor, self.base)


class StepMomentum:
    """Momentum ``values[i]`` from epoch ``milestones[i - 1]`` on (``values[0]`` before
    the first milestone): a step change, for example together with a batch change."""

    def __init__(self, milestones, values):
        self.milestones = [float(m) for m in milestones]
        self.values = [float(v) for v in values]
        if len(self.values) != len(self.milestones) + 1:
            raise ValueError("StepMomentum needs one value more than milestones, got %d "
                             "milestones and %d values" % (len(self.milestones),
                                                           len(self.values)))
        for v in self.values:
            check_momentum(v)

    def __call__(self, epoch):
        return self.values[sum(1 for m in self.milestones if epoch >= m)]

    def __repr__(self):
        return "StepMomentum(%r, %r)" % (self.milestones, self.values)


class OneCycleMomentum:
    """Momentum against the learning rate's one cycle (Smith, "Super-convergence"):
    ``high`` at epoch 0, down linearly to ``low`` at ``epochs / 2``, back to ``high``
    at ``epochs``, and ``high`` after."""

    def __init__(self, epochs, high=0.95, low=0.85):
        if not epochs > 0:
            raise ValueError("OneCycleMomentum epochs must be > 0, got %r" % (epochs,))
        check_momentum(high)
        check_momentum(low)
        self.epochs, self.high, self.low = float(epochs), float(high), float(low)

    def __call__(self, epoch):
        if epoch >= self.epochs:
            return self.high
        x = abs(2.0 * epoch / self.epochs - 1.0)       # 1 at the ends, 0 mid-cycle
        return self.low + (self.high - self.low) * x

    def __repr__(self):
        return "OneCycleMomentum(%g, high=%g, low=%g)" % (self.epochs, self.high, self.low)


def check_momentum(m):
    """``m`` as a float, or ValueError unless it is in [0, 1)."""
    m = float(m)
    if not (0.0 <= m < 1.0) or math.isnan(m):
        raise ValueError("momentum must be in [0, 1), got %r" % (m,))
    return m


def check_iters_per_epoch(n):
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError("iters_per_epoch must be an int >= 1 (the step() calls of one "
                         "epoch), got %r" % (n,))
    return n


def check_k(k, epoch):
    """``k`` as an int, or ValueError unless it is an int >= 1."""
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError("the batch schedule gave k = %r at epoch %g: micro-batches per "
                         "update must be an int >= 1" % (k, epoch))
    return k


# ------------------------------------------------------------------------------ the Trainer side

class ScheduledLR:
    """The optimizer's lr scheduler, read at the micro-batch count and scaled by k / k0.

    Installed over ``optimizer.lr_scheduler`` by :func:`attach` where the optimizer has
    one. It is called with the update count, as MXNet calls every scheduler, but answers
    for the position that the Trainer's step set just before the update. Picklable, so
    checkpoints take it.
    """

    def __init__(self, schedule):
        self.schedule = schedule
        self.position = 0        # micro-batches completed by the coming update
        self.scale = 1.0         # k / k0 under linear scaling, else 1

    def __call__(self, num_update):
        return self.schedule(self.position) * self.scale

    def __getattr__(self, name):            # base_lr, warmup_steps, ... of the schedule
        if name.startswith("__") or "schedule" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.schedule, name)


class TrainerSchedules:
    """The schedules of one Trainer and where they stand (see the module docstring).

    micro_batches: step() calls so far; updates: the Trainer's steps so far; pending:
    micro-batches accumulated since the last update; samples: their samples; k: the
    micro-batches per update of the accumulation in progress."""

    def __init__(self, iters_per_epoch, batch=None, momentum=None, lr_scaling="linear"):
        if not callable(iters_per_epoch):
            iters_per_epoch = check_iters_per_epoch(iters_per_epoch)
        if lr_scaling not in LR_SCALINGS:
            raise ValueError("lr_scaling must be 'linear' or None, got %r" % (lr_scaling,))
        self.iters_per_epoch, self.batch, self.momentum = iters_per_epoch, batch, momentum
        self.lr_scaling = lr_scaling
        self.k0 = check_k(batch(0.0), 0.0) if batch is not None else 1
        self.micro_batches = self.updates = self.pending = self.samples = 0
        self.k = self.k0
        self.lr_base = self.lr_set = None    # a fixed lr: the user's, and the one set

    def epoch(self, micro_batches=None):
        """The epoch (float) after ``micro_batches`` step() calls (default: so far)."""
        if callable(self.iters_per_epoch):      # known once training starts (mxhylo.run)
            self.iters_per_epoch = check_iters_per_epoch(self.iters_per_epoch())
        n = self.micro_batches if micro_batches is None else micro_batches
        return n / float(self.iters_per_epoch)

    def count(self, batch_size):
        """Count one micro-batch; True when it completes an update."""
        if self.pending == 0 and self.batch is not None:
            self.k = check_k(self.batch(self.epoch()), self.epoch())
        self.pending += 1
        self.samples += batch_size
        self.micro_batches += 1
        return self.pending >= self.k

    def set_optimizer(self, optimizer):
        """Before an update: the optimizer's lr (scheduler position and k / k0) and
        momentum for the update that completes micro-batch ``micro_batches``."""
        scale = self.k / float(self.k0) if self.lr_scaling == "linear" else 1.0
        if isinstance(optimizer.lr_scheduler, ScheduledLR):
            optimizer.lr_scheduler.position = self.micro_batches
            optimizer.lr_scheduler.scale = scale
        else:
            # a fixed lr: scale the user's, which trainer.set_learning_rate may change
            if optimizer.lr != self.lr_set:
                self.lr_base = optimizer.lr
            optimizer.lr = self.lr_set = self.lr_base * scale
        if self.momentum is not None:
            optimizer.momentum = check_momentum(self.momentum(self.epoch()))

    def done(self):
        self.pending = self.samples = 0
        self.updates += 1


class GradientSums:
    """The sum of an accumulation's micro-batch gradients, beside the parameters'.

    Backward writes each micro-batch's gradient into the parameters' gradient arrays;
    ``add(first, last)`` after it: the first micro-batch's gradients are copied into
    the sums, the next ones added to them, and the last one's gradients get the sums
    added (g_k + (g_1 + ... + g_{k-1}): float addition commutes, so this is the sum
    backward would have accumulated in order). A gradient backward did not write in a
    micro-batch (a parameter that micro-batch did not use: MXNet's stale gradient)
    adds nothing; its flag is cleared after each micro-batch but the last, so that the
    Trainer's own check sees the last one, and a parameter used in an earlier
    micro-batch only gets the sum and counts as written. The buffers live here, not
    in the schedules' state that checkpoints take (a checkpoint is written between
    updates, when nothing is pending)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.buffers = None     # one per gradient array, made at the first k > 1
        self.written = None     # per gradient array: written in this accumulation

    def _pairs(self):
        """(weight array, its gradient array) of every trained parameter and device:
        MXNet keeps the 'written by backward' flag on the weight."""
        return [pair for p in self.trainer._params if p.grad_req != "null"
                for pair in zip(p.list_data(), p.list_grad())]

    def add(self, first, last):
        pairs = self._pairs()
        if first:                           # (k > 1: a first micro-batch is not the last)
            if self.buffers is None or len(self.buffers) != len(pairs):
                self.buffers = [mx.nd.zeros_like(g) for _, g in pairs]
            self.written = [False] * len(pairs)
        for i, ((w, g), b) in enumerate(zip(pairs, self.buffers)):
            fresh = bool(w._fresh_grad)
            if last:
                if fresh:
                    g += b
                elif self.written[i]:
                    b.copyto(g)
                    w._fresh_grad = True
                continue
            if fresh:
                if self.written[i]:
                    b += g
                else:
                    g.copyto(b)
                self.written[i] = True
            elif first:
                b[:] = 0
            w._fresh_grad = False


def attach(trainer, iters_per_epoch, batch=None, momentum=None, lr_scaling="linear"):
    """Give ``trainer`` (gluon.Trainer, mxhylo.LARSTrainer, hvd.DistributedTrainer) a
    batch schedule (epoch -> k micro-batches per update, e.g. :class:`StepBatch`)
    and/or a momentum schedule (epoch -> m in [0, 1), e.g. :class:`OneCycleMomentum`).
    ``iters_per_epoch``: the step() calls of one epoch (or a function returning it,
    called at the first step). Returns the TrainerSchedules, also at
    ``trainer.schedules``. See the module docstring for what changes; call it before
    the Trainer's first step."""
    if getattr(trainer, "schedules", None) is not None:
        raise ValueError("this Trainer already has schedules attached")
    if trainer._kv_initialized:
        raise ValueError("attach the schedules before the Trainer's first step (its "
                         "kvstore is already set up)")
    if trainer._kvstore_params.get("update_on_kvstore") is True:
        raise ValueError("a batch or momentum schedule changes the optimizer between "
                         "updates, which runs on the workers; this Trainer was given "
                         "update_on_kvstore=True (updates on the servers). Leave it "
                         "unset or pass False.")
    optimizer = trainer._optimizer
    if momentum is not None:
        if not hasattr(optimizer, "momentum"):
            raise ValueError("a momentum schedule needs an optimizer with momentum; %s "
                             "has none" % type(optimizer).__name__)
        if not float(optimizer.momentum or 0.0) > 0.0:
            raise ValueError("a momentum schedule needs the optimizer made with momentum "
                             "> 0 (MXNet's SGD keeps no momentum buffer otherwise); "
                             "pass e.g. {'momentum': 0.9} to the Trainer")
    if batch is not None:
        added = [p.name for p in trainer._params if p.grad_req == "add"]
        if added:
            raise ValueError("a batch schedule accumulates the micro-batches' gradients "
                             "itself; parameter(s) %s have grad_req='add': leave them at "
                             "'write'" % ", ".join(added[:4]))
    state = TrainerSchedules(iters_per_epoch, batch, momentum, lr_scaling)
    trainer._kvstore_params["update_on_kvstore"] = False
    if optimizer.lr_scheduler is not None:
        optimizer.lr_scheduler = ScheduledLR(optimizer.lr_scheduler)
    optimizer.mxhylo_schedules = state
    own_step = trainer.step
    sums = GradientSums(trainer)

    def step(batch_size, ignore_stale_grad=False):
        sched = trainer.schedules = trainer._optimizer.mxhylo_schedules  # (load_states)
        complete = sched.count(batch_size)
        if sched.k > 1:
            sums.add(first=sched.pending == 1, last=complete)
        if not complete:
            return
        sched.set_optimizer(trainer._optimizer)
        own_step(sched.samples, ignore_stale_grad)
        sched.done()

    trainer.step = step
    trainer.schedules = state
    return state

