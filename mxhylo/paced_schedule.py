"""The lr schedule of an unmodified script, read at the pace of one process (mxhylo.run)."""


class WorkerPacedSchedule:
    """An lr scheduler read at W times the update count: the pace of one process.

    An unmodified script sizes its schedule from the sample count and its own batch b
    (gluoncv: iters_per_epoch = num_training_samples // b), but each of W workers
    takes only 1/W of those steps per epoch. Read at ``num_update * W``, the schedule
    is where one process with batch W*b would be after the same epochs (to within the
    rounding of steps per epoch).

    It lives in this importable module (not mxhylo.run, which runs as __main__)
    because it is pickled with the optimizer: MXNet's dist_sync sends the optimizer
    to the servers, which then run the paced schedule, and trainer.save_states
    writes it into the checkpoint.
    """

    def __init__(self, schedule, num_workers):
        self.schedule, self.num_workers = schedule, int(num_workers)

    def __call__(self, num_update):
        return self.schedule(num_update * self.num_workers)

    def __getattr__(self, name):            # base_lr, warmup_steps, ... of the script's
        if name.startswith("__") or "schedule" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.schedule, name)

    def __setattr__(self, name, value):
        if name in ("schedule", "num_workers"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.schedule, name, value)


def pace_schedule(trainer, num_workers):
    """Wrap the Trainer's optimizer's lr scheduler (if any) in a WorkerPacedSchedule."""
    from mxhylo.schedules import ScheduledLR

    optimizer = getattr(trainer, "_optimizer", None)
    owner, attr = optimizer, "lr_scheduler"
    schedule = getattr(optimizer, "lr_scheduler", None)
    if isinstance(schedule, ScheduledLR):
        # a batch schedule's reader (mxhylo.schedules) already reads at the micro-batch
        # count: pace what it reads, so it answers schedule(W * micro-batches)
        owner, attr, schedule = schedule, "schedule", schedule.schedule
    if schedule is None or num_workers <= 1:
        return
    if isinstance(schedule, WorkerPacedSchedule):
        schedule = schedule.schedule
    setattr(owner, attr, WorkerPacedSchedule(schedule, num_workers))
