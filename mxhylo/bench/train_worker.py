"""What one worker of the ``train`` benchmark runs (started by mxhylo.bench.train).

    python -m mxhylo.bench.train_worker --config JOB.json --index I --out RESULT.json

The process is an MXNet parameter-server worker (the DMLC_* variables come from the
harness), or in the Horovod modes (horovod_dense, horovod_fp16, hylo_horovod) one of W
Horovod processes with horovodrun's Gloo variables (mxhylo.bench.horovod_jobs). It
trains a gluoncv model with ``gluon.Trainer`` (SGD, momentum) through the kvstore of its
mode (:data:`MODES`) and writes what it measured as JSON. Two tasks:

``speed`` (``config['task']``): synthetic batches (one fixed random batch per worker),
untimed full steps until the store is past its own dense warm-up (hylo's
``warmup_steps``: its compressed layers' first exchanges travel uncompressed; the
benchmark measures the steady state), ``warmup`` untimed rounds, then ``steps`` timed rounds, then ``stream_steps`` back-to-back
steps. A round is two training steps, each begun after a file barrier of all workers
(:class:`mxhylo.bench.comm_worker.FileSync`):

* full step: forward, backward, ``trainer.step``, ``mx.nd.waitall()``; timed from the
  barrier to the end of the wait (and split by where Python was: in forward+backward,
  in ``trainer.step``, in the final wait);
* split step: forward, backward, ``waitall`` (timed: "forward+backward alone", nothing
  else is running, the previous exchange has completed), a second barrier, then
  ``trainer.step`` and ``waitall`` (timed: "exchange alone", the already computed
  gradients' exchange plus the update). Both steps are real training steps: the
  momentum and the parameters are updated every time, so every worker and mode follows
  the same trajectory.

The stream steps (no barrier, no wait between steps, one wait at the end) show what a
training loop gets when the next forward may start before the previous exchange has
finished. Around the timed rounds worker 0 asks the harness to read the interface
counters (``mark``), so those bytes belong to exactly 2 * ``steps`` exchanges.

``tta``: time to accuracy on the digits .rec (mxhylo.io.RecordLoader, each worker its
part), ``epochs`` epochs with a cosine learning rate (mx.lr_scheduler.CosineScheduler
in the optimizer, so that it holds where the servers update too); after every epoch
rank 0 evaluates the validation set. The training clock stops during the evaluation (the
other workers wait at the next epoch's barrier): ``train_s`` excludes it, ``wall_s``
includes it.

Both tasks call ``trainer.step(batch_size * num_workers)``: the stores sum the
workers' gradients, so the update uses the mean over the global batch.

Every worker reports a SHA-256 of its trainable parameters at the end: synchronous
workers must hold bitwise identical parameters (BatchNorm's running statistics are
each worker's own and are left out).
"""
import hashlib
import sys
import time
import warnings

from .comm_worker import FileSync, _jsonable, serve


# ----------------------------------------------------------------------------- modes

class Mode:
    """How a mode builds its kvstore. ``kvstore(cfg)`` returns (kvstore object,
    update_on_kvstore for gluon.Trainer: None = Gluon's default for that store).
    ``trainer(cfg, params, optimizer_params)`` returns (store, trainer); the store
    answers rank, num_workers and, for hylo, stats(); ``batch_workers`` of the store
    (default num_workers) is the factor of the batch size passed to trainer.step (the
    stores sum the workers' gradients; Horovod's DistributedTrainer averages them)."""
    description = ""

    def kvstore(self, cfg):
        raise NotImplementedError

    def trainer(self, cfg, params, optimizer_params):
        import mxnet as mx
        kv, update_on_kvstore = self.kvstore(cfg)
        return kv, mx.gluon.Trainer(params, "sgd", optimizer_params, kvstore=kv,
                                    update_on_kvstore=update_on_kvstore)


class DistSync(Mode):
    """MXNet's native dist_sync, dense, with gluon.Trainer's defaults (the update then
    runs on the servers: workers push gradients and pull weights): what users run."""
    description = "MXNet dist_sync, dense (gluon.Trainer defaults: update on the servers)"

    def kvstore(self, cfg):
        import mxnet as mx
        return mx.kv.create("dist_sync"), None


class DistSyncWorkerUpdate(Mode):
    """dist_sync with update_on_kvstore=False: dense pushpull of gradients, the update
    on the workers (the way hylo updates)."""
    description = "MXNet dist_sync, dense, update on the workers (update_on_kvstore=False)"

    def kvstore(self, cfg):
        import mxnet as mx
        return mx.kv.create("dist_sync"), False


class DistSyncFP16(Mode):
    """dist_sync moving float16 gradients, compute in float32: the store a careful MXNet
    user builds to halve dist_sync's bytes (mxhylo.bench.fp16.DistSyncFP16Store, one
    native dist_sync store under Gluon's own per-key pushpull loop). The update runs on
    the workers in float32, as hylo's does: on the servers it would keep float16
    weights."""
    description = ("MXNet dist_sync moving float16 gradients (mxhylo.bench.fp16."
                   "DistSyncFP16Store: each gradient cast to float16, pushpulled through "
                   "one native dist_sync store, the servers' float16 sum cast back into "
                   "the float32 gradient); forward, backward, weights and the SGD update "
                   "in float32 on the workers (update_on_kvstore=False); parameters "
                   "broadcast in float32")

    def kvstore(self, cfg):
        from .fp16 import DistSyncFP16Store
        return DistSyncFP16Store(), False


class HyloMode(Mode):
    options = {}
    description = "mxhylo.create('dist_sync_hylo') with its default options"

    def kvstore(self, cfg):
        import mxhylo
        options = dict(cfg.get("hylo_options") or {})
        options.update(self.options)
        return mxhylo.create("dist_sync_hylo", **options), None


class HyloDensePull(HyloMode):
    options = {"compress_pull": False}
    description = "mxhylo.create('dist_sync_hylo', compress_pull=False): Hylo as published"


class HyloNoOverlap(HyloMode):
    description = ("mxhylo.create('dist_sync_hylo') made with mxhylo.kvstore.hylo.OVERLAP "
                   "= False: the exchange starts once backward has ended")

    def kvstore(self, cfg):
        from mxhylo.kvstore import hylo
        hylo.OVERLAP = False        # read when the store is made (this worker's only)
        return super().kvstore(cfg)


class HyloWorkers(HyloMode):
    options = {"server_update": False}
    description = ("mxhylo.create('dist_sync_hylo', server_update=False): hylo's exchange "
                   "and the update on the workers whatever the network")


class HyloShared(HyloMode):
    description = ("mxhylo.create('dist_sync_hylo') with the plan's rule 4 at any W "
                   "(mxhylo.kvstore.plan.SHARED_SCALE_WORKERS = 1): every layer the rule "
                   "compresses as shared_2bit, the servers' integer-sum pull")

    def kvstore(self, cfg):
        from mxhylo.kvstore import plan
        plan.SHARED_SCALE_WORKERS = 1       # (this worker's only; read at each plan)
        return super().kvstore(cfg)


class HorovodStore:
    """What the benchmark asks of a store, for hvd.DistributedTrainer (which has none):
    rank, num_workers; batch_workers 1 (the trainer averages: step(batch_size) gives
    the mean over the global batch, as step(batch_size * W) does with a summing
    store)."""
    batch_workers = 1

    def __init__(self, hvd):
        self.rank, self.num_workers = hvd.rank(), hvd.size()


class HorovodDense(Mode):
    """Horovod's dense ring allreduce: hvd.broadcast_parameters then
    hvd.DistributedTrainer (its defaults: per-gradient allreduce, averaged, fused by
    Horovod; the update on the workers), what a Horovod user runs today.
    ``compression``: the name of an hvd.Compression member passed to the trainer
    (None: Horovod's default, no keyword)."""
    description = ("hvd.DistributedTrainer, dense ring allreduce (Gloo), update on the "
                   "workers; W processes, no servers")
    compression = None

    def trainer(self, cfg, params, optimizer_params):
        from mxhylo.kvstore.transport_horovod import import_horovod
        hvd = import_horovod()
        hvd.broadcast_parameters(params, root_rank=0)
        kwargs = {}
        if self.compression:
            kwargs["compression"] = getattr(hvd.Compression, self.compression)
        return HorovodStore(hvd), hvd.DistributedTrainer(params, "sgd", optimizer_params,
                                                         **kwargs)


class HorovodFP16(HorovodDense):
    """hvd.DistributedTrainer(..., compression=hvd.Compression.fp16): Horovod's own
    float16 transport, the peer a Horovod user picks to halve the ring's bytes."""
    description = ("hvd.DistributedTrainer(compression=hvd.Compression.fp16): each "
                   "gradient cast to float16 for Horovod's ring allreduce (Gloo) and back "
                   "to float32; forward, backward, weights and the update in float32 on "
                   "the workers; W processes, no servers")
    compression = "fp16"


class HyloHorovod(HyloMode):
    options = {"transport": "horovod"}
    description = ("mxhylo.create('dist_sync_hylo', transport='horovod') with its "
                   "defaults: dense layers by ring allreduce, compressed by allgather; "
                   "W processes, no servers")


class DistSyncDynamic(DistSync):
    """dist_sync with a growing batch (mxhylo.schedules, the run's --tta-batch-schedule):
    k micro-batches per update, doubled at each listed epoch, the lr times k; the
    update then runs on the workers (a schedule changes the optimizer)."""
    description = ("MXNet dist_sync, dense, with mxhylo.schedules.StepBatch (k doubled at "
                   "each epoch of --tta-batch-schedule, lr times k unless --tta-batch-lr none; "
                   "update on the workers)")
    dynamic = True


class HyloDynamic(HyloMode):
    """hylo's default store with a growing batch, as DistSyncDynamic."""
    description = ("mxhylo.create('dist_sync_hylo') with its defaults and "
                   "mxhylo.schedules.StepBatch (k doubled at each epoch of "
                   "--tta-batch-schedule, lr times k unless --tta-batch-lr none; the workers' "
                   "route)")
    dynamic = True


MODES = {
    "dist_sync": DistSync,
    "dist_sync_workerupdate": DistSyncWorkerUpdate,
    "dist_sync_fp16": DistSyncFP16,
    "hylo_densepull": HyloDensePull,
    "hylo": HyloMode,
    "hylo_nooverlap": HyloNoOverlap,
    "hylo_workers": HyloWorkers,
    "hylo_shared": HyloShared,
    "horovod_dense": HorovodDense,
    "horovod_fp16": HorovodFP16,
    "hylo_horovod": HyloHorovod,
    "dist_sync_dynamic": DistSyncDynamic,
    "hylo_dynamic": HyloDynamic,
}


# ----------------------------------------------------------------------------- helpers

MAX_STARTUP_STEPS = 1000    # bound of the untimed steps before a store is steady
CHECKSUM_PIECE = 1 << 22      # elements read to the host at once by param_checksum


def param_checksum(net):
    """(sha256 hex, sum of |x| in float64) of the trainable parameters, in name order.
    Read in pieces of CHECKSUM_PIECE elements: whole, vgg16's first fc layer took 2.5 GB
    of host copies per worker (enough to exhaust this machine with 4 workers)."""
    import numpy as np
    digest = hashlib.sha256()
    total = 0.0
    params = net.collect_params()
    for name in sorted(params.keys()):
        p = params[name]
        if p.grad_req == "null":
            continue
        flat = p.data().reshape((-1,))
        digest.update(name.encode())
        for lo in range(0, flat.size, CHECKSUM_PIECE):
            a = np.ascontiguousarray(flat[lo:lo + CHECKSUM_PIECE].asnumpy())
            digest.update(a.tobytes())
            total += float(np.abs(a, dtype=np.float64).sum())
    return digest.hexdigest(), total


def build_net(name, classes, seed, hybridize=True):
    import mxnet as mx
    import numpy as np
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gluoncv
    mx.random.seed(seed)
    np.random.seed(seed)
    net = gluoncv.model_zoo.get_model(name, pretrained=False, classes=classes)
    net.initialize(mx.init.Xavier(magnitude=2))
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    return net


def make_trainer(cfg, net, lr, lr_scheduler=None):
    """(kvstore, gluon.Trainer with SGD) of the mode. A learning-rate schedule must be an
    ``lr_scheduler`` of the optimizer: with the update on the servers (dist_sync's Gluon
    default) the servers run their own pickled copy of the optimizer, and
    Trainer.set_learning_rate would only change the workers' unused copy."""
    params = {"momentum": cfg["momentum"], "wd": cfg["wd"]}
    if lr_scheduler is not None:
        params["lr_scheduler"] = lr_scheduler
    else:
        params["learning_rate"] = lr
    return MODES[cfg["mode"]]().trainer(cfg, net.collect_params(), params)


def batch_workers(kv):
    """The factor of the per-worker batch size for trainer.step: W for the summing
    stores, 1 for Horovod's averaging DistributedTrainer (HorovodStore)."""
    return int(getattr(kv, "batch_workers", None) or kv.num_workers)


def store_steady(kv):
    """Whether the store has reached its steady state: for a hylo store, its route
    settled (kvstore.route's trial over) and no layer still in its dense warm-up;
    other stores always."""
    stats = kv.stats() if hasattr(kv, "stats") else None
    if not stats or "warming_up" not in stats:
        return True
    route = stats.get("route")
    return bool(route) and route.get("settled", True) and not stats["warming_up"]


def peak_rss_bytes():
    """This process's peak resident memory (ru_maxrss, KiB on Linux) in bytes."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stats(kv):
    return _jsonable(kv.stats()) if hasattr(kv, "stats") else None


# ----------------------------------------------------------------------------- speed

def run_speed(cfg, index):
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    t_begin = time.perf_counter()
    sync = FileSync(cfg["sync_dir"], cfg["num_workers"], index,
                    timeout=cfg["barrier_timeout"])
    B, S, C = cfg["batch_size"], cfg["image_size"], cfg["classes"]
    net = build_net(cfg["model"], C, cfg["seed"], cfg.get("hybridize", True))
    rng = np.random.RandomState(cfg["seed"] * 1000 + index)
    data = mx.nd.array(rng.uniform(-1, 1, size=(B, 3, S, S)).astype(np.float32))
    label = mx.nd.array(rng.randint(0, C, size=(B,)).astype(np.float32))
    # deferred initialisation, in training mode: an inference forward would leave the
    # conv weights in oneDNN's own layout, which Horovod's MXNet ops cannot read
    # ("We can't generate TBlob for MKLDNN data")
    with autograd.train_mode():
        net(data)
    mx.nd.waitall()
    t_store = time.perf_counter()
    kv, trainer = make_trainer(cfg, net, cfg["lr"])
    store_s = time.perf_counter() - t_store     # the store's construction (and measuring)
    # the stores sum the workers' gradients: normalise by the global batch
    global_batch = B * batch_workers(kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    setup_s = time.perf_counter() - t_begin

    def fwd_bwd():
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()

    # CPU seconds: time.process_time(), every thread of this process (the engine's
    # workers, ps-lite's, Horovod's), read where the step's work is done (after waitall)
    def full_step():
        sync.barrier()
        t0, w0, c0 = time.perf_counter(), time.time(), time.process_time()
        fwd_bwd()
        t1 = time.perf_counter()
        trainer.step(global_batch)
        t2 = time.perf_counter()
        mx.nd.waitall()
        t3, c3 = time.perf_counter(), time.process_time()
        step = {"start": w0, "seconds": t3 - t0, "fwd_bwd_call_s": t1 - t0,
                "step_call_s": t2 - t1, "wait_s": t3 - t2, "cpu_s": c3 - c0}
        first.setdefault("step", step)      # the Trainer's first step: broadcast, plan
        return step

    first = {}

    def split_step():
        sync.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fwd_bwd()
        mx.nd.waitall()
        t1, c1 = time.perf_counter(), time.process_time()
        sync.barrier()
        t2, c2 = time.perf_counter(), time.process_time()
        trainer.step(global_batch)
        t3 = time.perf_counter()
        mx.nd.waitall()
        t4, c4 = time.perf_counter(), time.process_time()
        return {"fwd_bwd_s": t1 - t0, "exchange_s": t4 - t2, "exchange_call_s": t3 - t2,
                "fwd_bwd_cpu_s": c1 - c0, "exchange_cpu_s": c4 - c2}

    # A store with a start-up phase (hylo: its dense warm-up, its route on trial) is
    # measured past it: untimed full steps until it says it is steady (the same number
    # on every worker: the phase ends at the same step on each).
    skipped = 0
    while cfg.get("skip_store_warmup", True) and trainer._kvstore in (None, kv) \
            and not store_steady(kv) and skipped < MAX_STARTUP_STEPS:
        full_step()
        skipped += 1
    warm = []
    for _ in range(cfg["warmup"]):
        warm.append({"full": full_step(), "split": split_step()})
    stats_before = _stats(kv)
    sync.barrier("window")
    if index == 0:
        sync.mark("start")
    sync.barrier("start")
    rounds = [{"full": full_step(), "split": split_step()} for _ in range(cfg["steps"])]
    sync.barrier("end")
    if index == 0:
        sync.mark("end")
    stats_after = _stats(kv)
    stream = None
    if cfg.get("stream_steps", 0) > 0:
        sync.barrier("stream")
        t0 = time.perf_counter()
        for _ in range(cfg["stream_steps"]):
            fwd_bwd()
            trainer.step(global_batch)
        mx.nd.waitall()
        stream = {"steps": cfg["stream_steps"], "seconds": time.perf_counter() - t0}
    sha, total = param_checksum(net)
    sync.barrier("done")
    return {"index": index, "rank": int(kv.rank), "mode": cfg["mode"], "task": "speed",
            "update_on_kvstore": bool(trainer._update_on_kvstore),
            "setup_s": setup_s, "store_s": store_s, "first_step": first.get("step"),
            "plan": kv.plan().as_dict() if hasattr(kv, "plan") else None,
            "store_warmup_steps_run": skipped, "warmup": warm, "rounds": rounds, "stream": stream,
            "stats_before": stats_before, "stats": stats_after,
            "param_sha256": sha, "param_abs_sum": total, "peak_rss_bytes": peak_rss_bytes()}


# ----------------------------------------------------------------------------- tta

def evaluate(net, loader):
    correct = seen = 0
    for data, label in loader:
        pred = net(data[0]).argmax(axis=1).asnumpy()
        y = label[0].asnumpy().reshape(-1)[:len(pred)]
        correct += int((pred == y).sum())
        seen += len(y)
    return correct / float(max(seen, 1))


def run_tta(cfg, index):
    import mxnet as mx
    from mxnet import autograd, gluon

    from mxhylo.io import RecordLoader

    t_begin = time.perf_counter()
    sync = FileSync(cfg["sync_dir"], cfg["num_workers"], index,
                    timeout=cfg["barrier_timeout"])
    B, S, C = cfg["batch_size"], cfg["image_size"], cfg["classes"]
    net = build_net(cfg["model"], C, cfg["seed"], cfg.get("hybridize", True))
    net(mx.nd.zeros((1, 1, S, S)))
    mx.nd.waitall()
    steps_per_epoch = int(cfg["steps_per_epoch"])
    total_steps = steps_per_epoch * cfg["epochs"]
    schedule = mx.lr_scheduler.CosineScheduler(max_update=total_steps, base_lr=cfg["lr"],
                                               final_lr=0.0)
    kv, trainer = make_trainer(cfg, net, cfg["lr"], lr_scheduler=schedule)
    rank, W = int(kv.rank), int(kv.num_workers)
    sched = None
    if getattr(MODES[cfg["mode"]], "dynamic", False):
        from mxhylo import schedules
        sched = schedules.attach(trainer, iters_per_epoch=steps_per_epoch,
                                 batch=schedules.StepBatch(cfg["batch_schedule"]),
                                 lr_scaling=None if cfg.get("batch_lr") == "none"
                                 else "linear")
    norm = {"mean": 128.0, "std": 64.0}
    train = RecordLoader(cfg["train_rec"], cfg["train_idx"], B, (1, S, S), shuffle=True,
                         seed=cfg["seed"] * 1000 + rank, num_parts=W, part_index=rank,
                         last_batch="drop", preprocess_threads=1, **norm)
    val = RecordLoader(cfg["val_rec"], cfg["val_idx"], 256, (1, S, S), num_parts=1,
                       part_index=0, last_batch="keep", preprocess_threads=1,
                       prefetch=0, **norm) if rank == 0 else None
    if len(train) < steps_per_epoch:
        raise SystemExit("worker %d: its part has %d batches, fewer than the %d steps per "
                         "epoch every worker must take" % (index, len(train), steps_per_epoch))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    setup_s = time.perf_counter() - t_begin

    history, train_s, step = [], 0.0, 0
    sync.barrier("window")
    if index == 0:
        sync.mark("start")
    sync.barrier("start")
    wall0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        sync.barrier()
        t0 = time.perf_counter()
        for i, (data, label) in enumerate(train):
            if i == steps_per_epoch:
                break
            with autograd.record():
                loss = loss_fn(net(data[0]), label[0])
            loss.backward()
            trainer.step(B * batch_workers(kv))
            step += 1
        mx.nd.waitall()
        train_s += time.perf_counter() - t0
        entry = {"epoch": epoch + 1, "steps": step,
                 "updates": trainer.schedules.updates if sched is not None else step,
                 "train_s": train_s,
                 "wall_s": time.perf_counter() - wall0}
        if val is not None:
            entry["accuracy"] = evaluate(net, val)
            entry["eval_s"] = time.perf_counter() - wall0 - entry["wall_s"]
        history.append(entry)
    sync.barrier("end")
    if index == 0:
        sync.mark("end")
    sha, total = param_checksum(net)
    stats = _stats(kv)
    if stats is not None:
        stats.pop("layers", None)
    train.close()
    if val is not None:
        val.close()
    sync.barrier("done")
    return {"index": index, "rank": rank, "mode": cfg["mode"], "task": "tta",
            "seed": cfg["seed"], "setup_s": setup_s, "history": history,
            "steps_per_epoch": steps_per_epoch, "update_on_kvstore":
            bool(trainer._update_on_kvstore), "stats": stats,
            "param_sha256": sha, "param_abs_sum": total, "peak_rss_bytes": peak_rss_bytes()}


# ----------------------------------------------------------------------------- main

TASKS = {"speed": run_speed, "tta": run_tta}


def main(argv=None):
    return serve("python -m mxhylo.bench.train_worker", __doc__,
                 lambda cfg, index: TASKS[cfg["task"]](cfg, index), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
