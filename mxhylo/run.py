"""Run an unmodified Gluon/gluoncv training script distributed: ``python -m mxhylo.run``.

    python -m mxhylo.launch -n 4 -s 2 python -m mxhylo.run [--kvstore NAME] SCRIPT [ARGS...]

In every process mxhylo is imported first (registering the 'hylo' kvstore types).
Then, by the role the launcher gave the process (DMLC_ROLE):

server, scheduler: ``import mxnet`` runs ps-lite's server/scheduler loop and exits
  the process when the job ends; SCRIPT is never run (as with MXNet's own launcher).
worker: the distributed kvstore is created once (default
  'dist_sync_hylo'; --kvstore dist_sync for MXNet's plain store), recorded with
  mxhylo.kvstore.active.set_active(), and SCRIPT runs as __main__ with sys.argv =
  [SCRIPT, ARGS...] under a few patches, undone when it returns (see
  DistributedPatches): Gluon Trainers created without a kvstore use that store and
  average over all workers' samples and follow their lr schedule at the pace of one
  process with batch W*b, a training mx.io.ImageRecordIter reads only this worker's
  part of the file (an evaluation reader all of it),
  and a script's own mx.kv.create('dist_...') gets the job's store. What is and is
  not patched: DistributedPatches.

Under horovodrun (``horovodrun -np W -H ... --gloo python -m mxhylo.run SCRIPT``, no
DMLC_ROLE) every process is a worker as above, and the hylo store moves gradients with
Horovod's ring allreduce and allgather (kvstore.transport_horovod); no servers.

Without DMLC_ROLE or horovodrun (not launched) SCRIPT just runs, with mxhylo imported.

A worker whose script raises or exits non-zero leaves at once (os._exit) instead of
waiting in ps-lite's exit-time finalize for workers that are waiting for it: without
that, a failed worker hangs the whole job and the launcher never learns it failed.
"""
import argparse
import functools
import inspect
import os
import runpy
import sys
import threading
import traceback

from mxhylo.paced_schedule import pace_schedule

DEFAULT_KVSTORE = "dist_sync_hylo"
EXIT_SCRIPT_FAILED, EXIT_NO_JOB, EXIT_SETUP = 1, 3, 4


def _say(msg):
    sys.stderr.write("mxhylo.run: %s\n" % msg)
    sys.stderr.flush()


# ----------------------------------------------------------------------------- joining the job

def create_kvstore(name, timeout):
    """mx.kv.create(name), bounded: exit EXIT_NO_JOB if the job is not joined in ``timeout`` s.

    Creating a distributed store blocks until the scheduler has heard from every
    server and worker. ps-lite never gives up on its own: with a wrong
    DMLC_PS_ROOT_URI/PORT, or a server that died at start, it waits forever, and no
    PS_* variable (heartbeats, resends) changes that. The watchdog turns the hang into
    an exit the launcher reports.
    """
    import mxnet as mx

    registry = mx.kv.KVStoreBase.kv_registry
    if "hylo" in name.lower() and name.lower() not in registry:
        # mx.kv.create() would silently build a native store of that name instead.
        _say("kvstore %r is not registered (registered: %s); mxhylo's hylo kvstore is "
             "missing from this installation. Use --kvstore dist_sync for MXNet's store."
             % (name, ", ".join(sorted(registry)) or "none"))
        os._exit(EXIT_SETUP)

    def give_up():
        if "HOROVOD_RANK" in os.environ and "DMLC_ROLE" not in os.environ:
            _say("this worker could not join the Horovod job within %g s (horovodrun's "
                 "rendezvous HOROVOD_GLOO_RENDEZVOUS_ADDR=%s unreachable, or a worker "
                 "missing); giving up"
                 % (timeout, os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")))
            os._exit(EXIT_NO_JOB)
        _say("this worker could not join the parameter-server job within %g s "
             "(scheduler DMLC_PS_ROOT_URI=%s DMLC_PS_ROOT_PORT=%s unreachable, or a "
             "server/worker of the job missing); giving up"
             % (timeout, os.environ.get("DMLC_PS_ROOT_URI"),
                os.environ.get("DMLC_PS_ROOT_PORT")))
        os._exit(EXIT_NO_JOB)

    timer = threading.Timer(timeout, give_up) if timeout and timeout > 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        return mx.kv.create(name)
    finally:
        if timer is not None:
            timer.cancel()


# ----------------------------------------------------------------------------- the patches

# ImageRecordIter arguments that make a reader random: a reader with none of them
# set is deterministic, which is what an evaluation reader is (gluoncv's scripts: the
# training reader shuffles and augments, the validation reader does neither).
_RANDOM_READER_ARGS = ("shuffle", "rand_crop", "rand_mirror", "random_resized_crop",
                       "max_rotate_angle", "max_aspect_ratio", "max_shear_ratio",
                       "max_random_scale", "max_random_area", "pca_noise",
                       "brightness", "contrast", "saturation", "random_h", "random_s",
                       "random_l")


def is_training_reader(kwargs):
    """Whether an ImageRecordIter built with ``kwargs`` is a training reader: it
    shuffles or augments at random (max_random_area counts below its default 1)."""
    for name in _RANDOM_READER_ARGS:
        value = kwargs.get(name)
        if name == "max_random_area":
            if value is not None and float(value) < 1:
                return True
        elif value:
            return True
    return False


class DistributedPatches:
    """Every monkeypatch mxhylo.run makes, in one place; a context manager, reversible.

    1. gluon.Trainer.__init__: a Trainer created without a kvstore (or with Gluon's
       default 'device') gets the job's store. Why: 'device' is a single-machine
       store, so each worker would silently train its own model.
    2. The same Trainers get ``_scale /= num_workers`` (Trainer.step(b) then rescales
       gradients by 1/(W*b)), and update on the workers (update_on_kvstore=False
       unless the script says otherwise). Why: the store sums the W workers'
       gradients and Gluon divides by the per-worker batch only, which would make the
       step W times too large; and over MXNet's dist_sync a Trainer that updates on
       the servers cannot save_states (gluoncv's scripts do, at every best epoch).
       Trainers the script gives a kvstore explicitly are left alone.
    3. The same Trainers' lr scheduler is read at W times the update count
       (WorkerPacedSchedule), also after trainer.load_states. Why: the script sizes
       its schedule in steps of batch b over the whole data set, and each worker
       takes 1/W of those steps per epoch: the schedule would run W times too slowly
       (a cosine schedule would end far above 0).
    4. mx.io.ImageRecordIter (and its twin in mxnet.io.io): a training reader (one
       that shuffles or augments at random, is_training_reader) gets num_parts=W,
       part_index=kv.rank when the script sets neither, and seed_aug=rank unless
       the script sets it: MXNet seeds every process's augmenters alike, so two
       workers would crop, mirror and jitter their i-th images identically, where one
       process draws a different augmentation for every sample of its batch. Why: otherwise every worker
       reads the whole .rec and an epoch shows each sample W times. A deterministic
       reader is an evaluation reader and every worker reads all of it, so the
       accuracy a worker prints is over the whole validation set (trained weights
       are the same on every worker; BatchNorm running statistics are each worker's
       own). shard_all_readers=True shards every reader, for
       scripts whose training reader is deterministic.
    5. mx.kv.create (mxnet.kvstore.create, which Gluon also calls for a kvstore
       string): a distributed name ('dist...' or '...hylo...') returns the job's
       store. Why: ps-lite runs one node per process; a script that creates its own
       'dist_sync' store would otherwise hang forever in the second create. Local
       names ('local', 'device') still create a new store. (The job's store and
       its transport's native store are made before the patches.)

    6. With ``batch_schedule`` (--batch-schedule): the same Trainers accumulate
       gradients (mxhylo.schedules.StepBatch: k micro-batches per update, doubled at
       each listed epoch), the epoch's length taken from the training
       ImageRecordIter (its .idx: this worker's part of the records, in batches).
       The lr scheduler is then read at W times the micro-batches so far (pacing 3
       on top of the schedule's own reading), the lr scaled by k (``batch_lr``
       'linear') or not ('none').

    7. With ``sync_batchnorm`` (--sync-batchnorm): every Gluon BatchNorm layer
       normalizes a training batch with the mean and variance of all W workers'
       batches and keeps running statistics that are the same on every worker
       (mxhylo.sync_batchnorm: two round trips per layer and step). Why: each worker
       otherwise normalizes over its own b samples, where one process normalizes
       over W*b; with small per-worker batches that trains worse.

    Not patched: gluon.data.DataLoader and other readers (every worker reads all of
    them), learning rates or schedules the script computes from steps it counts
    itself, and Trainers the script gives a kvstore (it is distributed-aware).
    """

    def __init__(self, kv, shard_all_readers=False, say=None, batch_schedule=None,
                 batch_lr="linear", sync_batchnorm=False):
        self.kv = kv
        self.sync_batchnorm = bool(sync_batchnorm)
        self.shard_all_readers = bool(shard_all_readers)
        self.say = say or _say
        self.batch_schedule, self.batch_lr = batch_schedule, batch_lr
        self.train_batches = None       # batches of this worker's training reader
        self._undo = []

    def iters_per_epoch(self):
        """Micro-batches of one epoch: this worker's part of the training reader."""
        if self.train_batches is None:
            raise ValueError("--batch-schedule needs the epoch's length, taken from the "
                             "script's training mx.io.ImageRecordIter (with path_imgidx) "
                             "before its first step; this script made none")
        return self.train_batches

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.uninstall()
        return False

    def _set(self, owner, attr, value):
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def install(self):
        import mxnet as mx
        from mxnet import gluon

        kv = self.kv
        num_workers = kv.num_workers
        trainer_init = gluon.Trainer.__init__
        signature = inspect.signature(trainer_init)

        @functools.wraps(trainer_init)
        def init_with_job_store(trainer, *args, **kwargs):
            bound = signature.bind(trainer, *args, **kwargs)
            if bound.arguments.get("kvstore", "device") == "device":
                bound.arguments["kvstore"] = kv
                # the workers update: over dist_sync MXNet could not save_states the
                # servers' optimizer, and the lr the script prints is the one used
                bound.arguments.setdefault("update_on_kvstore", False)
                trainer_init(*bound.args, **bound.kwargs)
                trainer._scale /= num_workers
                trainer._mxhylo_paced = True
                pace_schedule(trainer, num_workers)
                if self.batch_schedule:
                    from mxhylo import schedules
                    schedules.attach(trainer, iters_per_epoch=self.iters_per_epoch,
                                     batch=schedules.StepBatch(self.batch_schedule),
                                     lr_scaling=None if self.batch_lr == "none"
                                     else "linear")
            else:
                trainer_init(*bound.args, **bound.kwargs)
        self._set(gluon.Trainer, "__init__", init_with_job_store)

        load_states = gluon.Trainer.load_states

        @functools.wraps(load_states)
        def load_states_paced(trainer, fname):
            load_states(trainer, fname)         # may bring back a pickled optimizer
            if getattr(trainer, "_mxhylo_paced", False):
                pace_schedule(trainer, num_workers)
        self._set(gluon.Trainer, "load_states", load_states_paced)

        rec_iter = mx.io.ImageRecordIter
        say = self.say
        shard_all = self.shard_all_readers
        patches = self

        @functools.wraps(rec_iter)
        def sharded_rec_iter(*args, **kwargs):
            path = kwargs.get("path_imgrec", "?")
            if "num_parts" in kwargs or "part_index" in kwargs:
                pass                            # the script shards it itself
            elif shard_all or is_training_reader(kwargs):
                kwargs["num_parts"], kwargs["part_index"] = num_workers, kv.rank
                if kwargs.get("seed_aug") is None:
                    kwargs["seed_aug"] = kv.rank
                say("ImageRecordIter %s: training reader, this worker reads part %d of "
                    "%d, augmentation seed %s" % (path, kv.rank, num_workers,
                                                  kwargs["seed_aug"]))
                if patches.batch_schedule and kwargs.get("path_imgidx"):
                    patches.train_batches = reader_batches(
                        kwargs["path_imgidx"], kwargs.get("batch_size", 1), num_workers)
            else:
                say("ImageRecordIter %s: evaluation reader (no shuffle, no random "
                    "augmentation), this worker reads all of it (--shard-all-readers "
                    "to shard it)" % (path,))
            return rec_iter(*args, **kwargs)
        self._set(mx.io, "ImageRecordIter", sharded_rec_iter)
        if getattr(mx.io.io, "ImageRecordIter", None) is rec_iter:
            self._set(mx.io.io, "ImageRecordIter", sharded_rec_iter)

        kv_create = mx.kv.create

        @functools.wraps(kv_create)
        def create_returns_job_store(name="local", *args, **kwargs):
            # (the job's store, and its transport's native store, exist before these
            # patches: only the script's calls come here)
            if isinstance(name, str) and ("dist" in name.lower() or "hylo" in name.lower()):
                if name.lower() != str(getattr(kv, "type", "")).lower():
                    _say("the script asks for kvstore %r: using the job's %r store "
                         "(one distributed store per process)" % (name, kv.type))
                return kv
            return kv_create(name, *args, **kwargs)
        self._set(mx.kv, "create", create_returns_job_store)
        if getattr(mx.kv.base, "create", None) is kv_create:
            self._set(mx.kv.base, "create", create_returns_job_store)

        if self.sync_batchnorm:
            from mxhylo import sync_batchnorm
            # (a collective: the reducer's address travels through the job's store)
            undo = sync_batchnorm.install(sync_batchnorm.join(kv))
            self._undo.append((None, None, undo))
            self.say("BatchNorm: statistics over all %d workers' batches" % num_workers)

    def uninstall(self):
        while self._undo:
            owner, attr, value = self._undo.pop()
            if owner is None:
                value()                         # an undo function
            else:
                setattr(owner, attr, value)


def reader_batches(path_imgidx, batch_size, num_parts):
    """Batches of one part of ``num_parts`` of the records listed in ``path_imgidx``
    (an ImageRecordIter's epoch, its last batch padded as round_batch does)."""
    with open(path_imgidx) as f:
        records = sum(1 for line in f if line.strip())
    part = -(-records // num_parts)
    return max(1, -(-part // int(batch_size)))


# ----------------------------------------------------------------------------- running the script

def run_script(path, args):
    """Run ``path`` as __main__ with sys.argv = [path] + args, as ``python path args`` would."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [path] + list(args)
    script_dir = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0


def _exit_now(code):
    """Leave without interpreter teardown: no ps-lite finalize barrier to hang in."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(args):
    """Join the job, run the script under the patches; exit at once on failure."""
    from mxhylo.kvstore.active import set_active

    kv = create_kvstore(args.kvstore, args.connect_timeout)
    set_active(kv)
    _say("kvstore %s: rank %d of %d workers" % (args.kvstore, kv.rank, kv.num_workers))
    try:
        with DistributedPatches(kv, shard_all_readers=args.shard_all_readers,
                                batch_schedule=args.batch_schedule,
                                batch_lr=args.batch_lr,
                                sync_batchnorm=args.sync_batchnorm):
            run_script(args.script, args.script_args)
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return 0
        if not isinstance(code, int):
            sys.stderr.write("%s\n" % (code,))
            code = EXIT_SCRIPT_FAILED
        _say("%s exited with code %d" % (args.script, code))
        _exit_now(code)
    except BaseException:               # incl. KeyboardInterrupt: still leave at once
        traceback.print_exc()
        _say("%s failed (traceback above); leaving without waiting for the other "
             "processes" % args.script)
        _exit_now(EXIT_SCRIPT_FAILED)
    return 0


def _epochs(text):
    try:
        epochs = [float(e) for e in text.split(",") if e.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected epochs separated by commas, e.g. "
                                         "10,20; got %r" % (text,)) from None
    if not epochs or any(b <= a for a, b in zip(epochs, epochs[1:])) or epochs[0] < 0:
        raise argparse.ArgumentTypeError("expected increasing epochs >= 0, got %r"
                                         % (text,))
    return epochs


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mxhylo.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvstore", default=DEFAULT_KVSTORE,
                   help="kvstore the workers create (default %s; e.g. dist_sync, "
                        "dist_device_sync, hylo)" % DEFAULT_KVSTORE)
    p.add_argument("--connect-timeout", type=float,
                   default=float(os.environ.get("MXHYLO_CONNECT_TIMEOUT", 120)),
                   metavar="SECONDS",
                   help="a worker gives up (exit code %d) if it has not joined the job "
                        "by then; 0: wait forever (default $MXHYLO_CONNECT_TIMEOUT or "
                        "120)" % EXIT_NO_JOB)
    p.add_argument("--shard-all-readers", action="store_true",
                   help="shard every mx.io.ImageRecordIter across the workers, not only "
                        "training readers (those that shuffle or augment at random): for "
                        "scripts whose training reader is deterministic")
    p.add_argument("--batch-schedule", type=_epochs, default=None, metavar="E1,E2,...",
                   help="grow the batch by gradient accumulation: the Trainer takes one "
                        "update per k micro-batches, k = 1 doubled at each epoch listed "
                        "(mxhylo.schedules.StepBatch); the epoch's length comes from the "
                        "training ImageRecordIter")
    p.add_argument("--batch-lr", choices=("linear", "none"), default="linear",
                   help="with --batch-schedule: the lr times k (linear, the default), or "
                        "the script's own (none: the growing batch replaces lr decay)")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="BatchNorm layers normalize over all workers' batches, as one "
                        "process with batch W*b would (two round trips per layer and step; "
                        "running statistics the same on every worker)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="its arguments (everything after SCRIPT)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        import mxhylo  # noqa: F401  registers the hylo kvstore types
    except Exception:
        traceback.print_exc()
        _say("cannot import mxhylo in this %s process (broken environment?)"
             % os.environ.get("DMLC_ROLE", "worker"))
        return EXIT_SETUP
    from mxhylo.kvstore.transport_horovod import launched_by_horovodrun
    role = os.environ.get("DMLC_ROLE")
    if role in ("server", "scheduler"):
        # MXNet's import runs the ps-lite loop for these roles and calls sys.exit()
        # when the job ends; if mxhylo imported mxnet already, we never get here.
        import mxnet  # noqa: F401
        return 0
    if role not in (None, "worker"):
        _say("unknown DMLC_ROLE %r (expected worker, server or scheduler)" % role)
        return EXIT_SETUP
    if not os.path.isfile(args.script):
        _say("no such script: %s" % args.script)
        return EXIT_SETUP
    if role is None and launched_by_horovodrun():
        # horovodrun started this process: a worker whose hylo store moves gradients
        # with Horovod (its transport 'auto'); MXNet's native stores have no Horovod
        if "hylo" not in args.kvstore.lower():
            _say("under horovodrun the job's store is a hylo store over Horovod; "
                 "--kvstore %s is MXNet's parameter-server store, which needs "
                 "python -m mxhylo.launch" % args.kvstore)
            return EXIT_SETUP
        return run_worker(args)
    if role is None:
        # Not launched as part of a job: one plain process, no store, no patches.
        run_script(args.script, args.script_args)
        return 0
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
