"""Print hylo's plan for a model, without any network: ``python -m mxhylo.plan``.

    python -m mxhylo.plan --model resnet50_v1b --workers 4 --servers 2 --gbit 1
        [--latency-ms 0.1] [--optimizer sgd --momentum 0.9] [--size-threshold N]
        [--conv-rate R] [--compress-pull gather|dense] [--no-costs] [--json]

The layers are the model's trainable parameters (gluoncv's model zoo, else MXNet's),
shapes resolved by one forward pass on CPU. The costs are those of a network given by
its speed, with this CPU's codecs:

    wire.per_byte_s = 8 / (gbit * 1e9) * max(1, W / S)    seconds per byte
      (W workers' bytes go through S servers' links; with no servers, a ring
       allreduce: 8 / (gbit * 1e9) * 2 (W - 1) / W)
    wire.latency_s  = latency_ms / 1e3
    codecs: kvstore.cost_model.time_codec on this CPU (encode, decode per element)
    momentum_s: kvstore.cost_model.time_momentum (with momentum correction)

With --size-threshold or --conv-rate (or --no-costs) the plan is the policy's alone,
as the store makes it when those options are given. The route is the plan's at the
Trainer's first step: with server_update 'auto' and a layer compressed, a trial that
the job's own steps decide (kvstore.route).
"""
import argparse
import json
import sys
import time

from mxhylo.kvstore.options import DEFAULT_WARMUP_STEPS


def model_layers(name, input_size=224):
    """[(name, shape)] of the trainable parameters of model ``name`` and the net."""
    import mxnet as mx
    try:
        from gluoncv import model_zoo
        net = model_zoo.get_model(name, pretrained=False)
    except (ImportError, ValueError):
        from mxnet.gluon.model_zoo import vision
        net = vision.get_model(name, pretrained=False)
    net.initialize(ctx=mx.cpu())
    net(mx.nd.zeros((1, 3, input_size, input_size)))
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return [(p.name, tuple(p.shape)) for p in params], net


def measure(policy, args, momentum):
    """Costs of the network described by ``args``, codecs timed on this CPU (see the
    module docstring)."""
    from mxhylo.kvstore.compressors import make_compressors
    from mxhylo.kvstore.cost_model import WireCost, time_codec, time_momentum
    from mxhylo.kvstore.plan import Costs

    t0 = time.perf_counter()
    per_byte = 8.0 / (args.gbit * 1e9)
    w, s = args.workers, args.servers
    per_byte *= max(1.0, w / s) if s > 0 else 2.0 * (w - 1) / w
    compressors = make_compressors()
    codecs = {c: time_codec(policy, compressors[c]) for c in ("conv_topk", "fc_2bit")}
    momentum_s = time_momentum() if momentum else 0.0
    return Costs(WireCost(args.latency_ms / 1e3, per_byte), codecs, momentum_s, None,
                 time.perf_counter() - t0)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mxhylo.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--transport", choices=("ps", "horovod"), default="ps")
    parser.add_argument("--gbit", type=float, default=1.0, help="network Gbit/s")
    parser.add_argument("--latency-ms", type=float, default=0.1)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--size-threshold", type=int)
    parser.add_argument("--conv-rate", type=float)
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    parser.add_argument("--compress-pull", choices=("gather", "dense"), default="gather")
    parser.add_argument("--server-update", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--no-costs", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.transport == "horovod":
        args.servers = 0

    from mxnet import gluon
    from mxhylo.kvstore.plan import TrainerFacts, make_plan
    from mxhylo.kvstore.policy import LayerPolicy

    layers, net = model_layers(args.model, args.input_size)
    opt_args = {"momentum": args.momentum} if args.optimizer in ("sgd", "nag") else {}
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, opt_args)
    facts = TrainerFacts.from_trainer(trainer)
    given = {k: v for k, v in (("size_threshold", args.size_threshold),
                               ("conv_rate", args.conv_rate)) if v is not None}
    policy = LayerPolicy(**given)
    costs = None
    if not (args.no_costs or given):
        costs = measure(policy, args, facts.momentum)
    try:
        plan = make_plan(layers, policy=policy,
                         compress_pull=None if args.compress_pull == "dense" else "gather",
                         server_update={"auto": "auto", "true": True,
                                        "false": False}[args.server_update],
                         costs=costs, trainer=facts, num_workers=args.workers,
                         num_servers=args.servers, transport=args.transport,
                         warmup_steps=args.warmup_steps)
    except ValueError as err:           # (server_update=True where the route is refused)
        parser.error(str(err))
    if args.json:
        json.dump(dict(plan.as_dict(), model=args.model, gbit=args.gbit), sys.stdout,
                  indent=1)
        print()
    else:
        print("%s: %d workers, %d servers, %g Gbit/s, %g ms latency (%s)"
              % (args.model, args.workers, args.servers, args.gbit, args.latency_ms,
                 "policy only" if costs is None else
                 "codecs timed on this CPU in %.1f s" % costs.measured_s))
        print(plan.table())
    return plan


if __name__ == "__main__":
    main()
