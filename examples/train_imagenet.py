"""Train a gluoncv model-zoo network on RecordIO images with LARS and Hylo compression.

The command line follows gluoncv's scripts/classification/imagenet/train_imagenet.py
wherever an option means the same (--model, --rec-train, --batch-size per device,
--num-gpus, -j, --lr, --lr-mode, --warmup-epochs, --dtype, --save-dir,
--resume-epoch/--resume-params/--resume-states, --log-interval ...); what differs:
the optimizer is always mxhylo.LARSTrainer, the input is always RecordIO (through
mxhylo.io.RecordLoader, sharded by worker rank), and --kvstore picks how gradients
travel (default dist_sync_hylo: Hylo's layer-aware compression).

One process (two CPU contexts standing in for two GPUs, in-process hylo)::

    python -m mxhylo.im2rec --digits /tmp/digits      # 32x32 grey digits, .rec + .idx
    python examples/train_imagenet.py --model resnet18_v1b --classes 10 --input-size 16 \\
        --rec-train /tmp/digits/digits_train.rec --rec-val /tmp/digits/digits_val.rec \\
        --kvstore hylo --num-cpus-as-devices 2 --no-augment \\
        --lr 2 --eta 0.02 --lr-mode cosine --warmup-epochs 1 --num-epochs 10

Over MXNet's parameter server (each worker trains on its shard of the .rec)::

    python -m mxhylo.launch -n 2 -s 1 python examples/train_imagenet.py --model resnet18_v1b \\
        --classes 10 --input-size 16 --rec-train ... --rec-val ... --kvstore dist_sync_hylo ...

LARS wants a larger --lr than SGD (the per-layer step is lr * eta * |w| / |g|). With
the settings above, 2 workers + 1 server reached 96.4% validation top-1 on the digits
after 10 epochs with dist_sync_hylo and 97.1% with dist_sync (one seed each).

On GPUs nothing changes but --num-gpus N (and --dtype float16, which needs GPUs:
MXNet 1.9 has no float16 GEMM on CPU).

Logged (rank 0): every --log-interval batches the throughput (samples/s of this worker
and of the job), training top-1, learning rate, loss scale and the bytes this worker
pushed per step (hylo: measured by kv.stats(); dist_sync: computed, dense); every
epoch validation top-1 and top-5 (top-5 only with more than 5 classes). A tqdm bar per
epoch on rank 0 when stderr is a terminal, or with --progress. Checkpoints after every
--save-frequency epochs: ``imagenet-<model>-<epoch>.params`` (rank 0) and ``.states``
(LARS state, loss scale and each worker's hylo residuals, written by every worker).
"""
import argparse
import itertools
import json
import logging
import math
import os
import sys
import time
import warnings

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mxhylo
from mxhylo.io import RecordLoader
from mxhylo.io.recfile import part_range

# ImageNet's per-channel statistics in 0..255 pixel units, as gluoncv's recipe uses them.
MEAN_RGB = (123.68, 116.779, 103.939)
STD_RGB = (58.393, 57.12, 57.375)
HYLO_TYPES = ("hylo", "dist_sync_hylo")

log = logging.getLogger("train_imagenet")


# ----------------------------------------------------------------------------- options

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data (RecordIO, e.g. from python -m mxhylo.im2rec)")
    data.add_argument("--rec-train", default="~/.mxnet/datasets/imagenet/rec/train.rec",
                      help="training .rec (default %(default)s)")
    data.add_argument("--rec-train-idx", default=None,
                      help="its .idx (default: the .rec path ending in .idx)")
    data.add_argument("--rec-val", default="~/.mxnet/datasets/imagenet/rec/val.rec",
                      help="validation .rec (default %(default)s)")
    data.add_argument("--rec-val-idx", default=None,
                      help="its .idx (default: the .rec path ending in .idx)")
    data.add_argument("--use-rec", action="store_true",
                      help="accepted for gluoncv command lines; input is always RecordIO")
    data.add_argument("-j", "--num-data-workers", dest="num_workers", type=int, default=4,
                      help="decoding threads of the record iterator (default 4)")
    data.add_argument("--input-size", type=int, default=224,
                      help="side of the square network input in pixels (default 224)")
    data.add_argument("--crop-ratio", type=float, default=0.875,
                      help="validation: resize the shorter side to input-size / crop-ratio, "
                           "then centre crop (default 0.875)")
    data.add_argument("--no-augment", action="store_true",
                      help="no random-resized crop, mirror or colour jitter in training "
                           "(only a resize and centre crop, as in validation)")
    data.add_argument("--classes", type=int, default=1000, help="number of classes (1000)")

    model = p.add_argument_group("model")
    model.add_argument("--model", required=True,
                       help="gluoncv model-zoo name, e.g. resnet50_v1b, resnet18_v1b, "
                            "mobilenetv2_1.0 (pretrained=False)")
    model.add_argument("--mode", default="hybrid", choices=("hybrid", "imperative"),
                       help="hybrid: hybridize(static_alloc, static_shape) (default)")
    model.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                       help="float16: fp16 parameters and activations, fp32 master weights "
                            "and dynamic loss scaling")
    model.add_argument("--last-gamma", action="store_true",
                       help="zero-initialise the last BN gamma of each residual block")
    model.add_argument("--use_se", action="store_true", help="SE blocks (resnext)")
    model.add_argument("--batch-norm", action="store_true", help="BatchNorm (vgg)")

    opt = p.add_argument_group("optimisation (mxhylo.LARSTrainer)")
    opt.add_argument("--batch-size", type=int, default=32,
                     help="batch size per device (CPU context or GPU) (default 32)")
    opt.add_argument("--num-epochs", type=int, default=3, help="epochs (default 3)")
    opt.add_argument("--lr", type=float, default=0.1,
                     help="peak global learning rate; LARS scales it per layer by "
                          "eta * |w| / |g| (default 0.1)")
    opt.add_argument("--momentum", type=float, default=0.9)
    opt.add_argument("--wd", type=float, default=1e-4,
                     help="weight decay (biases and BN beta/gamma get none) (default 1e-4)")
    opt.add_argument("--eta", type=float, default=0.001,
                     help="LARS trust coefficient (default 0.001, the LARS paper's)")
    opt.add_argument("--lr-mode", default="step", choices=("step", "poly", "cosine", "constant"),
                     help="decay after warmup (default step, as gluoncv)")
    opt.add_argument("--lr-decay", type=float, default=0.1, help="step mode: factor (0.1)")
    opt.add_argument("--lr-decay-period", type=int, default=0,
                     help="step mode: decay every this many epochs (0: use --lr-decay-epoch)")
    opt.add_argument("--lr-decay-epoch", default="40,60",
                     help="step mode: epochs at which to decay (default 40,60)")
    opt.add_argument("--warmup-lr", type=float, default=0.0, help="lr at the start of warmup")
    opt.add_argument("--warmup-epochs", type=float, default=0, help="epochs of linear warmup")
    opt.add_argument("--loss-scale", default=None,
                     help="'dynamic', a number, or 'none' (default: dynamic for float16, "
                          "none for float32)")
    opt.add_argument("--seed", type=int, default=0, help="initialisation and shuffle seed")

    dev = p.add_argument_group("devices and communication")
    dev.add_argument("--num-gpus", type=int, default=0, help="GPUs per worker (0: CPU)")
    dev.add_argument("--num-cpus-as-devices", type=int, default=1,
                     help="with --num-gpus 0: train on this many CPU contexts cpu(0..N-1), "
                          "as if they were GPUs (default 1)")
    dev.add_argument("--kvstore", default="dist_sync_hylo",
                     help="hylo, dist_sync_hylo (Hylo compression, in-process or over the "
                          "parameter server), device, local, dist_sync, dist_device_sync "
                          "(default dist_sync_hylo)")
    dev.add_argument("--hylo-size-threshold", type=int, default=8192,
                     help="hylo: layers with fewer elements travel uncompressed (8192)")
    dev.add_argument("--hylo-warmup-steps", type=int, default=None,
                     help="hylo: exchanges each compressed layer travels dense first "
                          "(default: the library's, 30)")
    dev.add_argument("--hylo-conv-rate", type=float, default=None,
                     help="hylo: fixed fraction of conv filters sent (default adaptive)")
    dev.add_argument("--hylo-policy", type=json.loads, default=None,
                     help='hylo: JSON {regex: none|conv_topk|fc_2bit}, e.g. \'{"fc": "none"}\'')

    out = p.add_argument_group("logging and checkpoints")
    out.add_argument("--log-interval", type=int, default=50,
                     help="batches between log lines (0: epoch lines only) (default 50)")
    out.add_argument("--progress", action="store_true",
                     help="progress bar even when stderr is not a terminal")
    out.add_argument("--logging-file", default=None, help="also write the log here (rank 0)")
    out.add_argument("--save-dir", default="params", help="checkpoint folder ('' : none)")
    out.add_argument("--save-frequency", type=int, default=1,
                     help="checkpoint every this many epochs (0: only at the end) (default 1)")
    out.add_argument("--resume-epoch", type=int, default=0, help="epoch to resume from")
    out.add_argument("--resume-params", default="", help="parameters to resume from")
    out.add_argument("--resume-states", default="", help="trainer states to resume from")
    out.add_argument("--json", default=None,
                     help="write a summary (accuracy, throughput, bytes) here; {rank} is "
                          "replaced by the worker rank")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(parser, args):
    for name in ("batch_size", "num_epochs", "input_size", "classes", "num_workers",
                 "num_cpus_as_devices"):
        if getattr(args, name) < 1:
            parser.error("--%s must be >= 1" % name.replace("_", "-"))
    if args.dtype == "float16" and args.num_gpus == 0:
        parser.error("--dtype float16 needs --num-gpus: MXNet 1.9 has no float16 matrix "
                     "multiply on CPU ('FP16 gemm on cpu not implemented')")
    if not 0 < args.crop_ratio <= 1:
        parser.error("--crop-ratio must be in (0, 1]")
    if args.resume_epoch < 0 or args.resume_epoch >= args.num_epochs:
        parser.error("--resume-epoch must be in [0, --num-epochs)")
    for opt in ("rec_train", "rec_val", "resume_params", "resume_states"):
        if getattr(args, opt):
            setattr(args, opt, os.path.expanduser(getattr(args, opt)))
    args.rec_train_idx = _index_path(args.rec_train, args.rec_train_idx)
    args.rec_val_idx = _index_path(args.rec_val, args.rec_val_idx)
    # Missing files fail here, naming the option, before any process of a job waits on it.
    for opt in ("rec_train", "rec_train_idx", "rec_val", "rec_val_idx",
                "resume_params", "resume_states"):
        path = getattr(args, opt)
        if path and not os.path.isfile(path):
            parser.error("--%s: %s does not exist%s" % (
                opt.replace("_", "-"), path,
                " (write the digits sample with: python -m mxhylo.im2rec --digits DIR)"
                if opt.startswith("rec") else ""))


def _index_path(rec, idx):
    if idx:
        return os.path.expanduser(idx)
    return (rec[:-4] if rec.endswith(".rec") else rec) + ".idx"


# ----------------------------------------------------------------------------- set-up

def make_contexts(args):
    if args.num_gpus > 0:
        return [mx.gpu(i) for i in range(args.num_gpus)]
    return [mx.cpu(i) for i in range(args.num_cpus_as_devices)]


def make_kvstore(args):
    """A kvstore object (or a name Gluon resolves itself) and (num_workers, rank).

    The store is created here, not inside the Trainer, because the input pipeline
    must know this worker's rank to read its own shard of the .rec.
    """
    name = args.kvstore
    if name in HYLO_TYPES:
        kv = mxhylo.create(name, size_threshold=args.hylo_size_threshold,
                           conv_rate=args.hylo_conv_rate, policy=args.hylo_policy,
                           warmup_steps=args.hylo_warmup_steps)
    elif "dist" in name:
        kv = mx.kv.create(name)
    else:
        kv = name   # device / local: Gluon drops it for one device, reduces over several
    if os.environ.get("DMLC_ROLE") == "worker" and isinstance(kv, str):
        raise SystemExit("--kvstore %s is not distributed, but this process is a worker of "
                         "a parameter-server job (DMLC_ROLE=worker): use dist_sync_hylo, "
                         "hylo or dist_sync" % name)
    if isinstance(kv, str):
        return kv, 1, 0
    return kv, int(kv.num_workers), int(kv.rank)


def make_net(args, contexts):
    from gluoncv.model_zoo import get_model

    kwargs = {"classes": args.classes, "pretrained": False}
    if args.model.startswith("vgg"):
        kwargs["batch_norm"] = args.batch_norm
    elif args.model.startswith("resnext"):
        kwargs["use_se"] = args.use_se
    if args.last_gamma:
        kwargs["last_gamma"] = True
    try:
        net = get_model(args.model, **kwargs)
    except ValueError as err:   # gluoncv lists the known names in its message
        raise SystemExit("--model %s: %s" % (args.model, str(err).splitlines()[0]))
    net.initialize(mx.init.MSRAPrelu(), ctx=contexts)
    net.cast(args.dtype)
    if args.resume_params:
        net.load_parameters(args.resume_params, ctx=contexts, cast_dtype=True)
    if args.mode == "hybrid":
        net.hybridize(static_alloc=True, static_shape=True)
    return net


def make_loaders(args, contexts, num_workers, rank):
    """(train loader over this worker's shard, val loader over the whole val .rec)."""
    side = args.input_size
    resize = int(math.ceil(side / args.crop_ratio))
    common = dict(data_shape=(3, side, side), ctx=contexts, mean=MEAN_RGB, std=STD_RGB,
                  dtype=args.dtype, preprocess_threads=args.num_workers)
    per_worker_batch = args.batch_size * len(contexts)
    if args.no_augment:
        aug = dict(resize=resize)
    else:   # gluoncv's ImageNet recipe
        aug = dict(random_resized_crop=True, min_random_area=0.08, rand_mirror=True,
                   brightness=0.4, contrast=0.4, saturation=0.4, pca_noise=0.1)
    # RecordLoader warns when the shards give different batch counts; steps_per_epoch()
    # below already stops every worker after the same number of steps.
    warnings.filterwarnings("ignore", message=".*synchronous data-parallel workers")
    train = RecordLoader(args.rec_train, args.rec_train_idx, per_worker_batch, shuffle=True,
                         seed=args.seed, num_parts=num_workers, part_index=rank,
                         last_batch="drop", **aug, **common)
    # Every worker evaluates the whole val set, as gluoncv does; rank 0 reports it.
    val = RecordLoader(args.rec_val, args.rec_val_idx, per_worker_batch, resize=resize,
                       num_parts=1, part_index=0, last_batch="keep", **common)
    return train, val


def steps_per_epoch(loader, num_workers):
    """Full batches every worker has: synchronous workers must take the same number of
    steps, and the last shard of a .rec can be smaller than the others."""
    n = len(loader.index.keys)
    sizes = [hi - lo for lo, hi in (part_range(n, num_workers, r) for r in range(num_workers))]
    steps = min(sizes) // loader.batch_size
    if steps < 1:
        raise SystemExit("the smallest of %d shards of %s has %d records, fewer than one "
                         "batch of %d: use a smaller --batch-size or fewer workers"
                         % (num_workers, loader.iter_kwargs["path_imgrec"], min(sizes),
                            loader.batch_size))
    return steps


def make_trainer(args, net, kv, steps):
    if args.lr_mode == "step":
        if args.lr_decay_period > 0:
            epochs = list(range(args.lr_decay_period, args.num_epochs, args.lr_decay_period))
        else:
            epochs = [int(e) for e in args.lr_decay_epoch.split(",") if e.strip()]
        bounds = [int(e * steps) for e in epochs if 0 < e < args.num_epochs]
        # No boundary inside the run: the rate never decays.
        schedule = {"schedule": "step", "step_boundaries": bounds,
                    "step_factor": args.lr_decay} if bounds else {"schedule": "constant"}
    else:
        schedule = {"schedule": args.lr_mode}
    loss_scale = args.loss_scale
    if loss_scale is None:
        loss_scale = "dynamic" if args.dtype == "float16" else None
    elif loss_scale.lower() == "none":
        loss_scale = None
    elif loss_scale != "dynamic":
        loss_scale = float(loss_scale)
    return mxhylo.LARSTrainer(
        net.collect_params(), learning_rate=args.lr, momentum=args.momentum, wd=args.wd,
        eta=args.eta, warmup_steps=int(round(args.warmup_epochs * steps)),
        total_steps=args.num_epochs * steps, warmup_begin_lr=args.warmup_lr,
        multi_precision=True, loss_scale=loss_scale, kvstore=kv, **schedule)


# ----------------------------------------------------------------------------- measuring

class TrafficMeter:
    """Bytes this worker pushed per step since the last reading.

    hylo stores count their own traffic (kv.stats()); a native dist store pushes every
    gradient dense, so its bytes are computed from the gradients' sizes; a local store
    sends nothing over a network (None).
    """

    def __init__(self, kv, net):
        self.kv, self.net = kv, net
        self.measured = hasattr(kv, "stats")
        self.computed = not self.measured and not isinstance(kv, str) and "dist" in kv.type
        self.dense_step = None
        self._last = self._totals()

    def _dense_step(self):
        # Computed at the first reading, after a forward pass: before it, deferred
        # initialisation leaves input dimensions unknown (shape 0).
        if self.dense_step is None:
            self.dense_step = sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
                                  for p in self.net.collect_params().values()
                                  if p.grad_req != "null")
        return self.dense_step

    def _totals(self):
        if self.measured:
            s = self.kv.stats()
            return s["bytes_pushed"], s["dense_bytes"], s["steps"]
        return 0, 0, 0

    def read(self, steps):
        """(bytes per step, dense bytes per step, source) over the last ``steps`` steps."""
        if self.measured:
            now = self._totals()
            pushed, dense, nsteps = (a - b for a, b in zip(now, self._last))
            self._last = now
            nsteps = nsteps or 1
            return pushed / nsteps, dense / nsteps, "measured"
        if self.computed:
            return float(self._dense_step()), float(self._dense_step()), "computed, dense"
        return None, None, "no network"

    def summary(self):
        if self.measured:
            s = self.kv.stats()
            return {k: s[k] for k in ("steps", "bytes_pushed", "dense_bytes", "ratio",
                                      "compressed_layers_ratio")}
        return {"bytes_per_step": self._dense_step() if self.computed else None}


def format_bytes(b):
    if b is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return "%.2f %s" % (b / size, unit)
    return "%d B" % b


def evaluate(net, loader, classes):
    """(top-1, top-5 or None) of ``net`` on every record of ``loader``."""
    top1 = mx.metric.Accuracy()
    top5 = mx.metric.TopKAccuracy(5) if classes > 5 else None
    for data, label in loader:
        outputs = [net(x).astype("float32") for x in data]
        top1.update(label, outputs)
        if top5 is not None:
            top5.update(label, outputs)
    return top1.get()[1], (top5.get()[1] if top5 is not None else None)


def check_labels(label, classes):
    """Labels must be class ids below --classes: the loss would silently train on garbage."""
    high = max(float(l.max().asscalar()) for l in label)
    if high >= classes:
        raise SystemExit("the training .rec has label %d but --classes is %d" % (high, classes))


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_paths(args, epoch):
    base = os.path.join(args.save_dir, "imagenet-%s-%d" % (args.model, epoch))
    return base + ".params", base + ".states"


def save_checkpoint(args, net, trainer, epoch, rank):
    """Parameters from rank 0 (every worker holds the same); trainer states from every
    worker, because each keeps its own hylo residuals (a per-rank side file)."""
    params, states = checkpoint_paths(args, epoch)
    if rank == 0:
        tmp = "%s.tmp%d" % (params, os.getpid())
        net.save_parameters(tmp)
        os.replace(tmp, params)   # atomic: a crash never leaves half a checkpoint
    trainer.save_states(states)
    return params, states


# ----------------------------------------------------------------------------- training

def train(args):
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    contexts = make_contexts(args)
    kv, num_workers, rank = make_kvstore(args)
    setup_logging(args, rank)
    log.info("options: %s", vars(args))
    net = make_net(args, contexts)
    train_data, val_data = make_loaders(args, contexts, num_workers, rank)
    steps = steps_per_epoch(train_data, num_workers)
    trainer = make_trainer(args, net, kv, steps)
    if args.resume_states:
        trainer.load_states(args.resume_states)
    elif args.resume_epoch > 0:
        log.warning("--resume-epoch without --resume-states: momentum, loss scale and the "
                    "schedule position start afresh")
    if args.save_dir:
        os.makedirs(args.save_dir, exist_ok=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    meter = TrafficMeter(kv, net)
    batch = train_data.batch_size
    log.info("%s on %s, %d worker(s) x %d device(s), %d steps/epoch of %d samples per "
             "worker, kvstore %s", args.model, contexts, num_workers, len(contexts), steps,
             batch, args.kvstore)
    progress = rank == 0 and (args.progress or sys.stderr.isatty())
    result = {"rank": rank, "workers": num_workers, "epochs": []}
    checked = False
    for epoch in range(args.resume_epoch, args.num_epochs):
        acc = mx.metric.Accuracy()
        tic = btic = time.time()
        bar = _progress_bar(progress, steps, epoch)
        # islice: stop after the steps every worker has (the loader then restarts its part)
        for i, (data, label) in enumerate(itertools.islice(train_data, steps)):
            if not checked:
                check_labels(label, args.classes)
                checked = True
            with autograd.record():
                outputs = [net(x) for x in data]
                # the loss in float32: a float16 log-softmax loses the small probabilities
                losses = [loss_fn(o.astype("float32"), y) for o, y in zip(outputs, label)]
            autograd.backward(trainer.scale_loss(losses))
            trainer.step(batch)
            acc.update(label, outputs)
            if bar is not None:
                bar.update(1)
            if args.log_interval and (i + 1) % args.log_interval == 0:
                mx.nd.waitall()
                speed = batch * args.log_interval / (time.time() - btic)
                _log_progress(epoch, i, speed, num_workers, acc, trainer, meter,
                              args.log_interval, bar)
                btic = time.time()
        mx.nd.waitall()
        if bar is not None:
            bar.close()
        elapsed = time.time() - tic
        speed = batch * steps / elapsed
        per_step, dense, source = meter.read(steps)
        top1, top5 = evaluate(net, val_data, args.classes)
        record = {"epoch": epoch, "train_top1": acc.get()[1], "val_top1": top1,
                  "val_top5": top5, "samples_per_s": speed * num_workers,
                  "seconds": elapsed, "loss_scale": trainer.loss_scale,
                  "bytes_per_step": per_step, "lr": trainer.learning_rate,
                  "num_update": trainer.num_update}
        result["epochs"].append(record)
        log.info("[Epoch %d] training: top1=%.4f  speed: %.1f samples/s (job %.1f)  "
                 "time: %.1f s", epoch, record["train_top1"], speed, speed * num_workers,
                 elapsed)
        log.info("[Epoch %d] validation: top1=%.4f%s", epoch, top1,
                 "  top5=%.4f" % top5 if top5 is not None else "")
        log.info("[Epoch %d] pushed %s/step per worker (%s; dense %s)  loss scale %g",
                 epoch, format_bytes(per_step), source, format_bytes(dense),
                 trainer.loss_scale)
        last = epoch == args.num_epochs - 1
        if args.save_dir and (last or (args.save_frequency and
                                       (epoch + 1) % args.save_frequency == 0)):
            params, states = save_checkpoint(args, net, trainer, epoch, rank)
            log.info("[Epoch %d] saved %s and %s", epoch, params, states)
    result.update(traffic=meter.summary(), kvstore=args.kvstore, model=args.model)
    if args.json:
        with open(args.json.format(rank=rank), "w") as f:
            json.dump(result, f, indent=2)
    train_data.close()
    val_data.close()
    return result


def _progress_bar(enabled, steps, epoch):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=steps, desc="epoch %d" % epoch, unit="batch", file=sys.stderr,
                leave=False, dynamic_ncols=True)


def _log_progress(epoch, i, speed, num_workers, acc, trainer, meter, interval, bar):
    per_step, _, source = meter.read(interval)
    line = ("Epoch[%d] Batch[%d]  Speed: %.1f samples/s (job %.1f)  top1=%.4f  lr=%.5g  "
            "loss-scale=%g  pushed %s/step (%s)" % (
                epoch, i, speed, speed * num_workers, acc.get()[1], trainer.learning_rate,
                trainer.loss_scale, format_bytes(per_step), source))
    if bar is not None:
        bar.set_postfix(top1="%.3f" % acc.get()[1], sps="%.0f" % speed)
    log.info(line)


def setup_logging(args, rank):
    # Every worker runs this script; rank 0 speaks for the job, the others only warn.
    level = logging.INFO if rank == 0 else logging.WARNING
    handlers = [logging.StreamHandler(sys.stdout)]
    if args.logging_file and rank == 0:
        handlers.append(logging.FileHandler(args.logging_file))
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        handlers=handlers, force=True)


def main(argv=None):
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
