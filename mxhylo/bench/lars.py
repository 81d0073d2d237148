"""Large-batch study on the digits: LARS with warmup vs SGD with a linearly scaled lr.

Every run trains :func:`mxhylo.models.digits_net` for the same number of epochs on
scikit-learn's digits (1347 training / 450 test images) and reports test accuracy,
mean and per seed:

- ``sgd_small``: momentum SGD at the usual batch (--small-batch), lr --base-lr.
  The reference: what normal training reaches.
- ``sgd_large``: momentum SGD at --batch with the linearly scaled lr
  ``base_lr * batch / small_batch``, no warmup (plain).
- ``sgd_large_warmup``: the same with --warmup-epochs of linear warmup (Goyal et al.).
- ``lars_large``: :class:`mxhylo.LARSTrainer` at --batch, --lars-lr and --eta (tuned
  once on 2 seeds at batch 512: lr in 0.1..128, eta in 0.001..0.05), the same warmup.
  Biases and BatchNorm beta/gamma get the plain lr, which is what bounds the global lr.

All runs use the same poly (power 2) decay to zero at the end and the same weight
decay. ``--dtype bfloat16`` runs everything under MXNet's CPU AMP (bf16 compute,
fp32 parameters).
"""
import time

import numpy as np

from . import report

METHODS = ("sgd_small", "sgd_large", "sgd_large_warmup", "lars_large")


def add_arguments(parser):
    parser.add_argument("--batch", type=int, default=512, help="large batch (default 512)")
    parser.add_argument("--small-batch", type=int, default=32, help="usual batch (default 32)")
    parser.add_argument("--epochs", type=int, default=30, help="epochs for every run (30)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method (3)")
    parser.add_argument("--base-lr", type=float, default=0.05,
                        help="SGD lr at the small batch (0.05)")
    parser.add_argument("--lars-lr", type=float, default=0.25,
                        help="LARS peak lr at the large batch (0.25, tuned for batch 512)")
    parser.add_argument("--eta", type=float, default=0.02,
                        help="LARS trust coefficient (0.02, tuned for batch 512)")
    parser.add_argument("--warmup-epochs", type=float, default=5.0,
                        help="warmup length in epochs for the *_warmup and lars runs (5)")
    parser.add_argument("--wd", type=float, default=1e-4, help="weight decay (1e-4)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: MXNet CPU AMP (mx.contrib.amp, target_dtype=bfloat16)")


def train_digits(method, batch_size, epochs, seed, lr, warmup_epochs=0.0, wd=1e-4, eta=0.001):
    """Train digits_net once; return {'acc': test accuracy in [0, 1], 'diverged': the
    outputs hold NaN/Inf (the accuracy is then chance level), 'seconds': wall time}.

    ``method``: 'sgd' (gluon.Trainer momentum SGD) or 'lars' (LARSTrainer, fp32,
    no loss scaling). Both use poly decay to zero after ``warmup_epochs`` of linear
    warmup. The last partial batch of an epoch is used, with its own size.
    """
    import mxnet as mx
    from mxnet import autograd, gluon

    from ..data import load_digits
    from ..lars import LARSTrainer, make_schedule
    from ..models import digits_net

    x_tr, y_tr, x_te, y_te = load_digits()
    steps_per_epoch = -(-len(y_tr) // batch_size)
    total = steps_per_epoch * epochs
    warmup = int(round(warmup_epochs * steps_per_epoch))
    mx.random.seed(seed)
    rng = np.random.RandomState(seed)
    net = digits_net()
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net.hybridize()
    params = net.collect_params()
    if method == "lars":
        trainer = LARSTrainer(params, lr, momentum=0.9, wd=wd, eta=eta, warmup_steps=warmup,
                              total_steps=total, schedule="poly", loss_scale=None, kvstore=None)
    elif method == "sgd":
        trainer = gluon.Trainer(params, "sgd", {
            "learning_rate": lr, "momentum": 0.9, "wd": wd,
            "lr_scheduler": make_schedule(lr, "poly", warmup, total)}, kvstore=None)
    else:
        raise ValueError("method must be 'sgd' or 'lars', got %r" % method)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    start = time.time()
    for _ in range(epochs):
        order = rng.permutation(len(y_tr))
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            x, y = mx.nd.array(x_tr[idx]), mx.nd.array(y_tr[idx])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(len(idx))
    out = net(mx.nd.array(x_te)).astype("float32").asnumpy()
    acc = float((out.argmax(axis=1) == y_te).mean())
    return {"acc": acc, "diverged": bool(not np.isfinite(out).all()),
            "seconds": round(time.time() - start, 2)}


def run(args):
    if args.dtype == "bfloat16":
        from mxnet.contrib import amp
        from mxhylo.lars import check_bf16_support
        check_bf16_support("bench lars --dtype bfloat16")    # a clear error on AVX2-only CPUs
        amp.init(target_dtype="bfloat16")
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit("unknown --methods %s; choose from %s" % (sorted(unknown), METHODS))
    scaled_lr = args.base_lr * args.batch / args.small_batch
    plan = {
        "sgd_small": ("sgd", args.small_batch, args.base_lr, 0.0),
        "sgd_large": ("sgd", args.batch, scaled_lr, 0.0),
        "sgd_large_warmup": ("sgd", args.batch, scaled_lr, args.warmup_epochs),
        "lars_large": ("lars", args.batch, args.lars_lr, args.warmup_epochs),
    }
    out = report.new("lars", report.options(args))
    results = out["results"] = {}
    for name in methods:
        kind, batch, lr, warm = plan[name]
        runs = [train_digits(kind, batch, args.epochs, seed, lr, warm, args.wd, args.eta)
                for seed in range(args.seeds)]
        results[name] = {"batch": batch, "lr": lr, "warmup_epochs": warm,
                         "accuracy": report.spread([r["acc"] for r in runs]),
                         "diverged_runs": sum(r["diverged"] for r in runs),
                         "seconds": sum(r["seconds"] for r in runs)}
    if "lars_large" in results and "sgd_large" in results:
        out["lars_minus_sgd_large"] = (results["lars_large"]["accuracy"]["mean"]
                                       - results["sgd_large"]["accuracy"]["mean"])
    return out


def plot(out, path):
    """Test accuracy per method: the mean over the seeds, and each seed."""
    plt = report.pyplot()
    names = list(out["results"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, name in enumerate(names):
        acc = out["results"][name]["accuracy"]
        ax.bar(i, 100 * acc["mean"], 0.6)
        ax.plot([i] * acc["n"], [100 * v for v in acc["values"]], "k.")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(["%s\nbatch %d" % (n, out["results"][n]["batch"]) for n in names])
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(max(0, min(100 * out["results"][n]["accuracy"]["min"] for n in names) - 5), 100)
    cfg = out["config"]
    report.save(fig, path, report.caption(out, "lars: digits_net, %d epochs, %s, %d seeds"
                                          % (cfg["epochs"], cfg["dtype"], cfg["seeds"])))
