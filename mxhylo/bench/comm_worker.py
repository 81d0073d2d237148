"""What one worker of the ``comm`` benchmark runs (started by mxhylo.bench.comm).

    python -m mxhylo.bench.comm_worker --config JOB.json --index I --out RESULT.json

The process is an MXNet parameter-server worker (DMLC_ROLE=worker and the other DMLC_*
variables come from the harness), or in the Horovod modes (horovod_dense,
horovod_fp16, hylo_horovod) one of W Horovod processes with horovodrun's Gloo variables
(mxhylo.bench.horovod_jobs). It builds one model's parameter and gradient arrays
from the shapes in the config (gradients N(0, grad_scale), drawn once, seeded by
the worker index; see synthetic_gradients), initialises the store the way Gluon's Trainer would, then times
``warmup + steps`` exchanges of all gradients. Before every exchange the workers meet
at a barrier of files in the job's sync directory (no network traffic, the same for
every mode); each worker times its own exchange up to the moment every output has
been written (mx.nd.waitall).

Around the timed steps, worker 0 asks the harness to read the interface counters
(``mark-start``/``mark-end`` files, answered with ``.ack``), while the other workers
wait at a file barrier, so the window holds exactly the timed exchanges (and a few
hundred bytes of ps-lite barrier/heartbeat chatter).

Modes are small classes in MODES: ``init(keys, params)``, ``step(keys, grads, outs)``
(start the exchange; the caller waits), ``stats()`` (a JSON-able dict or None).
"""
import argparse
import json
import os
import sys
import time


# ----------------------------------------------------------------------------- sync

class FileSync:
    """Barriers and harness handshakes through files in one shared directory."""

    def __init__(self, directory, num_workers, index, timeout=600.0, poll=0.0005):
        self.dir, self.n, self.index = directory, int(num_workers), int(index)
        self.timeout, self.poll = float(timeout), poll
        self.count = 0

    def _wait_for(self, paths, what):
        deadline = time.monotonic() + self.timeout
        pending = list(paths)
        while True:
            pending = [p for p in pending if not os.path.exists(p)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("worker %d: %s not reached within %.0f s (missing %s)"
                                   % (self.index, what, self.timeout,
                                      ", ".join(os.path.basename(p) for p in pending)))
            time.sleep(self.poll)

    def barrier(self, tag=""):
        """Return when every worker has called barrier the same number of times."""
        self.count += 1
        name = "barrier%04d%s" % (self.count, ("-" + tag) if tag else "")
        open(os.path.join(self.dir, "%s.%d" % (name, self.index)), "w").close()
        self._wait_for([os.path.join(self.dir, "%s.%d" % (name, i)) for i in range(self.n)],
                       "barrier " + name)

    def mark(self, name):
        """Tell the harness ``name`` and wait for its acknowledgement."""
        path = os.path.join(self.dir, "mark-" + name)
        with open(path + ".tmp", "w") as f:
            f.write("%.6f\n" % time.time())
        os.rename(path + ".tmp", path)
        self._wait_for([path + ".ack"], "harness acknowledgement of " + name)


# ----------------------------------------------------------------------------- modes

class DenseMode:
    """MXNet dist_sync; keys, priorities and call pattern as Gluon's Trainer with the
    update on the workers (per step, per key, priority -key)."""
    kv_type = "dist_sync"
    push_then_pull = False
    compression = None

    def __init__(self, cfg):
        import mxnet as mx
        self.mx = mx
        self.kv = mx.kv.create(self.kv_type)
        if self.compression:
            self.kv.set_gradient_compression(self.compression)

    def init(self, keys, params):
        # Gluon's Trainer also pulls the initial values to every worker; the values are
        # not used here, so that untimed dense pull is left out (it costs a whole step).
        self.kv.init(keys, params)

    def step(self, keys, grads, outs):
        kv = self.kv
        if self.push_then_pull:
            for k, g in zip(keys, grads):
                kv.push(k, g, priority=-k)
            for k, o in zip(keys, outs):
                kv.pull(k, out=o, priority=-k)
        else:
            for k, g, o in zip(keys, grads, outs):
                kv.pushpull(k, g, out=o, priority=-k)

    @property
    def rank(self):
        return self.kv.rank

    def stats(self):
        return None


class DensePushPull(DenseMode):
    """dense_pushpull: kv.pushpull per key (what gluon.Trainer does, update on workers)."""


class DensePushThenPull(DenseMode):
    """dense_push_pull: push every key, then pull every key."""
    push_then_pull = True


class MXNet2Bit(DenseMode):
    """mxnet_2bit: built-in 2-bit compression (threshold 0.5), push then pull (MXNet 1.9
    aborts pushpull with gradient compression on)."""
    push_then_pull = True
    compression = {"type": "2bit", "threshold": 0.5}


class DistSyncFP16Mode(DenseMode):
    """dist_sync_fp16: MXNet dist_sync moving float16 gradients
    (mxhylo.bench.fp16.DistSyncFP16Store over one native dist_sync store), called as
    dense_pushpull calls its store (per step, per key, priority -key): each float32
    gradient cast to float16, pushpulled, the float16 sum cast back into the float32
    output. Init: the float32 keys and their float16 twins, no pull (as dense_pushpull)."""

    def __init__(self, cfg):
        from .fp16 import DistSyncFP16Store
        self.kv = DistSyncFP16Store()


class HyloMode:
    """hylo: ``mxhylo.create('dist_sync_hylo', compress_pull=False, **options)`` (Hylo
    as published: compressed push, dense pull); broadcast at init, one
    ``kv.pushpull(keys, grads, out=outs)`` per step; kv.stats() as reported by hylo."""
    compress_pull = False

    def __init__(self, cfg):
        import mxhylo
        options = dict(cfg.get("hylo_options") or {})
        if self.compress_pull != "auto":
            options.setdefault("compress_pull", self.compress_pull)
        # the exchange of compressed steps is measured: no dense warm-up steps
        options.setdefault("warmup_steps", 0)
        self.kv = mxhylo.create("dist_sync_hylo", **options)

    def init(self, keys, params):
        self.kv.broadcast(keys, params, out=params)

    def step(self, keys, grads, outs):
        self.kv.pushpull(keys, grads, out=outs)

    @property
    def rank(self):
        return self.kv.rank

    def stats(self):
        return self.kv.stats()


class HyloGatherMode(HyloMode):
    """hylo_gather: hylo with compress_pull='gather' (the default) and no cost model
    (every layer as the policy plans it): the servers return the workers' own
    payloads gathered; exact, about W times the pushed bytes."""
    compress_pull = "gather"

    def __init__(self, cfg):
        cfg = dict(cfg, hylo_options=dict(cfg.get("hylo_options") or {}))
        cfg["hylo_options"].setdefault("cost_model", False)
        super().__init__(cfg)


class HyloAutoMode(HyloMode):
    """hylo_auto: mxhylo.create's defaults as a user gets them ('gather' pull, and the
    cost model choosing per layer whether compression pays on this network)."""
    compress_pull = "auto"


class HorovodDenseMode:
    """horovod_dense: Horovod's own dense exchange, as hvd.DistributedTrainer runs it
    (default num_groups=0): per gradient, in parameter order, ``hvd.allreduce_(grad,
    average=True, name=str(index), priority=-index)`` in place, which Horovod's
    background thread fuses into ring allreduces (tensor fusion). Init: rank 0's
    parameters broadcast, as hvd.broadcast_parameters. W processes, no servers."""

    compression = None      # the name of an hvd.Compression member, None: none

    def __init__(self, cfg):
        from mxhylo.kvstore.transport_horovod import import_horovod
        self.hvd = import_horovod()         # initialised; a clear error if missing

    def init(self, keys, params):
        for k, p in zip(keys, params):
            self.hvd.broadcast_(p, root_rank=0, name="bench.init.%d" % k)

    def step(self, keys, grads, outs):
        # (in place in the gradients, as DistributedTrainer; ``outs`` stay unused)
        if self.compression:
            compressor = getattr(self.hvd.Compression, self.compression)
            for i, (k, g) in enumerate(zip(keys, grads)):
                # as DistributedTrainer._allreduce_grads with a compression
                c, ctx = compressor.compress(g)
                self.hvd.allreduce_(c, average=True, name=str(k), priority=-i)
                g[:] = compressor.decompress(c, ctx)
            return
        for i, (k, g) in enumerate(zip(keys, grads)):
            self.hvd.allreduce_(g, average=True, name=str(k), priority=-i)

    @property
    def rank(self):
        return self.hvd.rank()

    def stats(self):
        return None


class HorovodFP16Mode(HorovodDenseMode):
    """horovod_fp16: horovod_dense's exchange with hvd.Compression.fp16 applied as
    hvd.DistributedTrainer(compression=hvd.Compression.fp16) applies it: per gradient,
    ``Compression.fp16.compress`` (a float16 copy), the same in-place
    ``hvd.allreduce_`` of that copy, then ``decompress`` written back into the float32
    gradient. W processes, no servers."""
    compression = "fp16"


class HyloHorovodMode(HyloMode):
    """hylo_horovod: ``mxhylo.create('dist_sync_hylo', transport='horovod')`` with its
    defaults (no compressed pull: the allgather returns every worker's own payload;
    warmup_steps=0 as in the other hylo modes: the compressed exchange is measured):
    dense layers by one grouped ring allreduce, compressed payloads by one grouped
    allgather. W processes, no servers."""
    compress_pull = "auto"

    def __init__(self, cfg):
        import mxhylo
        options = dict(cfg.get("hylo_options") or {})
        options.setdefault("warmup_steps", 0)
        options.setdefault("transport", "horovod")
        self.kv = mxhylo.create("dist_sync_hylo", **options)


MODES = {
    "hylo_auto": HyloAutoMode,
    "dense_pushpull": DensePushPull,
    "dist_sync_fp16": DistSyncFP16Mode,
    "dense_push_pull": DensePushThenPull,
    "mxnet_2bit": MXNet2Bit,
    "hylo": HyloMode,
    "hylo_gather": HyloGatherMode,
    "horovod_dense": HorovodDenseMode,
    "horovod_fp16": HorovodFP16Mode,
    "hylo_horovod": HyloHorovodMode,
}


def describe(mode):
    """What mode ``mode`` runs, in one paragraph (its class's docstring)."""
    return " ".join((MODES[mode].__doc__ or "").split())


# ----------------------------------------------------------------------------- main

def _jsonable(obj):
    """stats() may hold numpy scalars/arrays, tuples, LayerPlans: make them JSON."""
    import numpy as np
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "__dict__"):
        return _jsonable(vars(obj))
    return repr(obj)


POOL = (1 << 20) + 7      # odd length: tiles do not line up with power-of-two dimensions


def synthetic_gradients(shapes, scale, seed, pool=POOL):
    """N(0, scale) gradients, one NDArray per shape. A pool of ~1M normal draws is tiled
    (starting at a different offset per tensor) instead of drawing every element: four
    workers drawing vgg16's 138M values each took 18 s of the shared 2 cores."""
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(seed)
    values = rng.normal(0.0, scale, size=pool).astype(np.float32)
    twice = np.concatenate([values, values])
    out = []
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        start = int(rng.randint(pool))
        if n <= pool:
            flat = twice[start:start + n]
        else:
            flat = np.resize(np.roll(values, -start), n)
        out.append(mx.nd.array(flat.reshape(shape), dtype=np.float32))
    return out


def run_worker(cfg, index):
    t_begin = time.time()         # mxnet is loaded already (mxhylo's package imports it)
    import mxnet as mx
    timeline = {}                  # seconds since run_worker began, at each phase's end

    sync = FileSync(cfg["sync_dir"], cfg["num_workers"], index,
                    timeout=cfg.get("barrier_timeout", 600))
    keys = [int(k) for k in cfg["keys"]]
    shapes = [tuple(s) for s in cfg["shapes"]]
    grads = synthetic_gradients(shapes, float(cfg["grad_scale"]),
                                int(cfg.get("seed", 0)) * 1000 + index)
    params = [mx.nd.full(s, 0.01) for s in shapes]        # values unused: only moved
    outs = [mx.nd.zeros(s) for s in shapes]
    mx.nd.waitall()
    timeline["arrays"] = time.time() - t_begin

    t_init = time.perf_counter()
    mode = MODES[cfg["mode"]](cfg)
    mode.init(keys, params)
    mx.nd.waitall()
    init_s = time.perf_counter() - t_init
    timeline["init"] = time.time() - t_begin

    def timed_step():
        sync.barrier()
        t0, p0 = time.time(), time.perf_counter()
        mode.step(keys, grads, outs)
        mx.nd.waitall()
        return {"start": t0, "seconds": time.perf_counter() - p0}

    warm = [timed_step() for _ in range(int(cfg["warmup"]))]
    stats_before = _jsonable(mode.stats())
    sync.barrier("window")
    if index == 0:
        sync.mark("start")
    sync.barrier("start")
    timed = [timed_step() for _ in range(int(cfg["steps"]))]
    sync.barrier("end")
    if index == 0:
        sync.mark("end")
    stats_after = _jsonable(mode.stats())
    sync.barrier("done")
    timeline["done"] = time.time() - t_begin
    return {"index": index, "rank": int(mode.rank), "mode": cfg["mode"], "init_s": init_s,
            "warmup": warm, "steps": timed, "stats_before": stats_before,
            "stats": stats_after, "timeline": timeline}


def serve(prog, description, run, argv=None):
    """A benchmark worker's command line: --config JSON, --index, --out; writes
    ``run(cfg, index)`` as JSON to --out (atomically: the harness polls for it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job config JSON from the harness")
    parser.add_argument("--index", type=int, required=True, help="this worker's index")
    parser.add_argument("--out", required=True, help="write the result JSON here")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    if cfg.get("rendezvous_ready"):       # a Horovod job: hvd.init needs the server up
        from .horovod_jobs import own_hostname, wait_ready
        own_hostname()
        wait_ready(cfg["rendezvous_ready"], float(cfg.get("barrier_timeout", 600)))
    result = run(cfg, args.index)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(args.out + ".tmp", args.out)
    return 0


def main(argv=None):
    return serve("python -m mxhylo.bench.comm_worker", __doc__, run_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
