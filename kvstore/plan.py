"""The plan is data: how each layer's gradient travels, and where the optimizer runs.

``make_plan`` is a pure function: from the model's layers, the options, what the
Trainer is (TrainerFacts) and what a measurement found (Costs) it returns an immutable
Plan. It touches no network, no kvstore and no global state, so every worker given the
same inputs reaches the same Plan, and the same plan can be printed without a cluster
(``python -m mxhylo.plan``). Each decision carries the reason it was taken.

The rules:

1. A layer gets the layer policy's codec (kvstore.policy). With costs, a layer the rule
   would compress travels dense ('none') where the cost model (kvstore.cost_model,
   CostModel.predict) does not predict its compressed exchange at least the margin
   (10%) faster than its dense one. A layer the user named in ``policy`` keeps its
   codec: the costs price it but do not overrule it.
2. The route: 'servers' (the Trainer's optimizer on the parameter servers, every layer
   dense, as MXNet's dist_sync) is possible only with servers and a Trainer whose
   update is elementwise and float32 (``refusal``). server_update True or False forces
   it. 'auto' takes the servers' route where no layer compresses, the workers' where
   nothing was measured or warmup_steps is 0, and otherwise tries both on the job's own
   steps (kvstore.route): the warm-up on the servers' route, then compressed steps on
   the workers'. ``step_s`` holds what they measured (route -> median seconds of one
   step); with both, the faster route is kept (on a tie, the workers').
3. The pull: compressed layers come back as every worker's payload ('gather') where
   compress_pull asks for it and always over Horovod (its allgather), else dense;
   uncompressed layers always dense.
4. Past one rack: from SHARED_SCALE_WORKERS workers on, where the pull is compressed,
   a layer the rule compresses takes shared_2bit instead (kvstore.codec_shared), whose aggregate the servers sum
   as integers (the 'sum' pull): a gathered pull grows with W (resnet50_v1b's
   compressed layers: 0.28 of their dense bytes at W = 8, 0.55 at 16, dense at 64),
   the sum pull by log2(2W + 1) bits (0.18 at 16, 0.27 at 64). Below it the gather
   stays: its per-worker scales need no agreement and its decode runs in C++.
"""
import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .cost_model import DEFAULT_MARGIN, CodecCost, CostModel, LinkCosts, WireCost

# optimizers whose update is elementwise and per index: a parameter cut in pieces over
# the servers is updated exactly as a whole one (a layer-wise rule such as LARS is not;
# nor Nadam, whose momentum schedule advances with every update call)
ELEMENTWISE_OPTIMIZERS = ("SGD", "NAG", "Signum", "Adam", "AdaGrad", "RMSProp",
                          "AdaDelta", "Adamax", "Ftrl", "FTML")
TRANSPORTS = ("ps", "horovod", "local")
# rule 4: from this many workers a compressed layer takes the shared-scale codec
SHARED_SCALE_WORKERS = 16


@dataclass(frozen=True)
class Costs:
    """What a measurement found: all the planner needs of this machine and network.

    wire: a dense exchange of b bytes per worker, every worker at once, takes
      wire.latency_s + b * wire.per_byte_s seconds; codecs: strategy -> CodecCost
      (seconds per element to encode a layer, and to decode one payload of it);
    momentum_s: seconds per element of momentum correction on a compressed layer;
    links: each aggregation link alone (LinkCosts) or None;
    measured_s: seconds the measurement itself took (for reports only).
    """
    wire: WireCost
    codecs: Dict[str, CodecCost]
    momentum_s: float = 0.0
    links: Optional[LinkCosts] = None
    measured_s: float = 0.0

    @classmethod
    def from_cost_model(cls, model, measured_s=0.0):
        """The Costs of a measured CostModel."""
        return cls(model.wire, dict(model.codecs), model.momentum_s, model.links,
                   measured_s)

    def as_dict(self):
        out = dataclasses.asdict(self)
        out["codecs"] = dict(sorted(out["codecs"].items()))
        return out


@dataclass(frozen=True)
class TrainerFacts:
    """What the planner needs to know of a gluon.Trainer, as plain data.

    optimizer: the optimizer's class name ('SGD'); optimizer_module: the top package
    it comes from ('mxnet'); multi_precision: whether it keeps float32 master weights;
    momentum: whether momentum correction will run on compressed layers (MXNet's 'sgd'
    with momentum > 0, the option not False); update_on_kvstore: None, True or False
    as given to the Trainer; dtypes: (name, dtype) of each trainable parameter that is
    not float32 (empty: all are float32).
    """
    optimizer: str = "SGD"
    optimizer_module: str = "mxnet"
    multi_precision: bool = False
    momentum: bool = False
    update_on_kvstore: Optional[bool] = None
    dtypes: Tuple[Tuple[str, str], ...] = ()

    @classmethod
    def from_trainer(cls, trainer, momentum_correction="auto"):
        """The facts of ``trainer`` (a gluon.Trainer) under the store's
        momentum_correction option ('auto', True or False)."""
        import numpy as np
        from .momentum import from_optimizer

        opt = trainer._optimizer
        momentum = momentum_correction is not False and from_optimizer(opt) is not None
        if momentum_correction is True and not momentum:
            raise ValueError("momentum_correction=True needs a Trainer with MXNet's 'sgd' "
                             "optimizer and momentum > 0; this one has %s (momentum %r)"
                             % (type(opt).__name__, getattr(opt, "momentum", None)))
        dtypes = tuple((p.name, np.dtype(p.dtype).name) for p in trainer._params
                       if p.grad_req != "null" and np.dtype(p.dtype) != np.float32)
        return cls(type(opt).__name__, type(opt).__module__.split(".")[0],
                   bool(getattr(opt, "multi_precision", False)), momentum,
                   trainer._kvstore_params.get("update_on_kvstore"), dtypes)


@dataclass(frozen=True)
class LayerDecision:
    """How one layer's gradient travels. size: elements; codec: the strategy; rate, k:
    fraction and number of filters sent per step (conv_topk only); pull: 'gather',
    'sum' or 'dense'; payload_bytes: bytes pushed per worker per step; dense_s, codec_s: the
    predicted seconds of its exchange dense and with the rule's codec (None without
    costs); reason: why, in words."""
    name: str
    shape: Tuple[int, ...]
    size: int
    codec: str
    rate: Optional[float]
    k: Optional[int]
    pull: str
    payload_bytes: int
    dense_s: Optional[float]
    codec_s: Optional[float]
    reason: str

    @property
    def compressed(self):
        return self.codec != "none"


@dataclass(frozen=True)
class Plan:
    """Every layer's decision, the route ('workers' | 'servers') and why; settled: False
    while the route is on trial (kvstore.route); workers_s and servers_s: measured
    median seconds of one step on each route (None where not measured); costs: what the
    plan was priced with (None: not measured); options: the options it was made from
    (a copy; JSON-able)."""
    layers: Tuple[LayerDecision, ...]
    route: str
    route_reason: str
    settled: bool
    workers_s: Optional[float]
    servers_s: Optional[float]
    costs: Optional[Costs]
    options: dict

    def layer(self, name):
        """The LayerDecision of parameter ``name`` (KeyError if it has none)."""
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(name)

    @property
    def dense_bytes(self):          # pushed per worker per step with every layer dense
        return sum(4 * d.size for d in self.layers)

    @property
    def pushed_bytes(self):         # pushed per worker per step under this plan
        return sum(d.payload_bytes for d in self.layers)

    def as_dict(self):
        layers = [dict(dataclasses.asdict(d), shape=list(d.shape)) for d in self.layers]
        return {"layers": layers, "route": self.route, "route_reason": self.route_reason,
                "settled": self.settled, "workers_s": self.workers_s,
                "servers_s": self.servers_s,
                "dense_bytes": self.dense_bytes, "pushed_bytes": self.pushed_bytes,
                "costs": None if self.costs is None else self.costs.as_dict(),
                "options": self.options}

    def table(self):
        """The plan as fixed-width text: a row per layer, then the totals and route."""
        ms = lambda s: "-" if s is None else "%.3f" % (1e3 * s)       # noqa: E731
        rows = [("layer", "shape", "elements", "codec", "k/rate", "pull", "bytes",
                 "dense ms", "codec ms", "reason")]
        for d in self.layers:
            krate = "-" if d.k is None else "%d/%.3f" % (d.k, d.rate)
            rows.append((d.name, "x".join(map(str, d.shape)) or "()", str(d.size), d.codec,
                         krate, d.pull, str(d.payload_bytes), ms(d.dense_s), ms(d.codec_s),
                         d.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        right = (2, 4, 6, 7, 8)         # the numbers' columns
        lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) + "  " + r[-1]
                 for r in rows]
        dense, pushed = self.dense_bytes, self.pushed_bytes
        if self.route == "servers":
            # (the rows stay: they are what the workers' route would send)
            lines[:0] = ["on the servers' route every gradient travels dense, as dist_sync "
                         "does; the codecs below apply on the workers' route", ""]
        lines += ["",
                  "dense bytes %d, pushed %d per worker per step: ratio %.3f (%d of %d "
                  "layers compressed)" % (dense, pushed, pushed / max(dense, 1),
                                          sum(d.compressed for d in self.layers),
                                          len(self.layers)),
                  "measured step: workers %s ms, servers %s ms"
                  % (ms(self.workers_s), ms(self.servers_s)),
                  "route: %s%s (%s)" % (self.route, "" if self.settled else ", on trial",
                                        self.route_reason)]
        return "\n".join(lines)


def refusal(trainer, num_servers, transport):
    """Why a Trainer's optimizer cannot run on the servers, or None."""
    if num_servers <= 0:
        return "the %s transport has no servers" % transport
    if trainer is None:
        return "no Trainer: the servers' route runs a Trainer's optimizer"
    if trainer.update_on_kvstore is False:
        return "the Trainer was given update_on_kvstore=False"
    if trainer.optimizer not in ELEMENTWISE_OPTIMIZERS or trainer.optimizer_module != "mxnet":
        return ("its optimizer %s is not one of MXNet's elementwise ones (%s): a parameter "
                "cut over the servers would not be updated as a whole one"
                % (trainer.optimizer, ", ".join(ELEMENTWISE_OPTIMIZERS)))
    if trainer.multi_precision:
        return "its optimizer has multi_precision (the servers update float32 only)"
    if trainer.dtypes:
        return "parameter %s is %s, not float32" % trainer.dtypes[0]
    return None


def _override(policy, name):
    """The pattern of ``policy``'s overrides that names ``name``, or None."""
    for pattern, _ in getattr(policy, "overrides", ()):
        if pattern.search(name):
            return pattern.pattern
    return None


def _rule_reason(policy, plan):
    """Why the policy's rule (no override) gave ``plan`` its strategy."""
    shape, n = plan.shape, plan.size
    if plan.strategy == "none" and n < policy.size_threshold:
        return "below size_threshold (%d elements)" % policy.size_threshold
    if plan.strategy == "conv_topk":
        return "4-D weight: top-k filters (conv_rate %g)" % plan.rate
    if plan.strategy == "fc_2bit":
        return "%d-D weight: 2-bit" % len(shape)
    return "%d-D: the rule compresses 2-D and 4-D weights only" % len(shape)


def _pull_of(compress_pull, transport):
    """(the cost model's pull, the plan's pull of a compressed layer). Over Horovod a
    compressed layer always comes back by allgather: every worker's payload."""
    if compress_pull not in ("gather", "allgather", None, False):
        raise ValueError("compress_pull must be 'gather', 'allgather' or None, got %r"
                         % (compress_pull,))
    if transport == "horovod":
        return "allgather", "gather"
    return ("gather", "gather") if compress_pull else (None, "dense")


def make_plan(layers, *, policy, compress_pull, server_update, costs, trainer=None,
              num_workers, num_servers, transport, warmup_steps=0, step_s=None):
    """The Plan of ``layers`` (a sequence of (name, shape): the parameters that train,
    in the Trainer's order) under ``policy`` (a LayerPolicy), ``compress_pull``
    ('gather', or None: dense), ``server_update`` ('auto', True or False), ``costs``
    (Costs, or None: not measured), ``trainer`` (TrainerFacts, or None: no Trainer),
    ``num_workers`` and ``num_servers`` (W, S), ``transport`` ('ps', 'horovod',
    'local'), ``warmup_steps`` (the store's) and ``step_s`` (route -> measured median
    seconds of one step on it, or None). Pure: the same inputs give an equal Plan. See
    the module docstring."""
    if not (server_update == "auto" or isinstance(server_update, bool)):
        raise ValueError("server_update must be 'auto', True or False, got %r"
                         % (server_update,))
    if transport not in TRANSPORTS or int(num_workers) < 1:
        raise ValueError("need transport in %s and num_workers >= 1, got %r, %r"
                         % (TRANSPORTS, transport, num_workers))
    from .compressors import make_compressors
    compressors = make_compressors()
    model_pull, compressed_pull = _pull_of(compress_pull, transport)
    model = None if costs is None else CostModel(
        costs.wire, dict(costs.codecs), int(num_workers), model_pull,
        momentum_s=costs.momentum_s, links=costs.links)
    momentum = trainer is not None and trainer.momentum
    shared = (transport != "local" and compressed_pull == "gather"
              and int(num_workers) >= SHARED_SCALE_WORKERS)
    decisions = [_decide(policy, name, shape, model, compressors, momentum, compressed_pull,
                         shared) for name, shape in layers]

    refused = refusal(trainer, num_servers, transport)
    step_s = dict(step_s or {})
    route, why, settled = _route(server_update, refused, costs, decisions, warmup_steps,
                                 step_s)
    options = dict(policy.options(), compress_pull=compress_pull,
                   server_update=server_update, num_workers=int(num_workers),
                   num_servers=int(num_servers), transport=transport, margin=DEFAULT_MARGIN,
                   warmup_steps=int(warmup_steps),
                   trainer=None if trainer is None else dataclasses.asdict(trainer))
    return Plan(tuple(decisions), route, why, settled, step_s.get("workers"),
                step_s.get("servers"), costs, options)


def _route(server_update, refused, costs, decisions, warmup_steps, step_s):
    """(route, reason, settled) by rule 2 of the module docstring."""
    if server_update is False:
        return "workers", "server_update=False", True
    if server_update is True:
        if refused:
            raise ValueError("server_update=True, but " + refused)
        return "servers", "server_update=True", True
    if refused:
        return "workers", refused, True
    if costs is None:
        return "workers", "not measured: hylo's exchange, the update on the workers", True
    if not any(d.compressed for d in decisions):
        return ("servers", "no layer compresses: every gradient dense, the update once "
                "on the servers (as dist_sync)", True)
    if not warmup_steps:
        return ("workers", "warmup_steps=0: no dense steps to time the servers' route "
                "by", True)
    servers_s, workers_s = step_s.get("servers"), step_s.get("workers")
    if servers_s is None:
        return ("servers", "on trial: the %d warm-up steps (dense) run on the servers' "
                "route, then compressed steps on the workers'; the faster is kept"
                % warmup_steps, False)
    if workers_s is None:
        return ("workers", "on trial: compressed steps timed against %.1f ms a step on "
                "the servers' route" % (1e3 * servers_s), False)
    route = "servers" if servers_s < workers_s else "workers"
    return route, ("measured %.1f ms a step on the workers' route (compressed) vs %.1f "
                   "ms on the servers' (dense)" % (1e3 * workers_s, 1e3 * servers_s)), True


def _decide(policy, name, shape, model, compressors, momentum, compressed_pull, shared):
    """The LayerDecision of one layer (rules 1, 3 and, where ``shared``, 4 of the module
    docstring)."""
    plan = policy.plan(name, shape)
    pattern = _override(policy, name)
    reason = ("policy %r" % pattern) if pattern is not None else _rule_reason(policy, plan)
    if shared and pattern is None and plan.strategy != "none":
        plan = policy.plan_as(name, plan.shape, "shared_2bit")
        reason += "; %d workers or more: shared_2bit, its pull summed on the servers" \
            % SHARED_SCALE_WORKERS
    compressed = plan.strategy != "none"
    dense_s = codec_s = None
    if model is not None:
        measured = not compressed or plan.strategy in model.codecs
        if not measured:            # priced by its bytes alone (no encode, no decode)
            model = dataclasses.replace(model, codecs=dict(
                model.codecs, **{plan.strategy: CodecCost(0.0, 0.0)}))
        nbytes = compressors[plan.strategy].payload_nbytes(plan)
        pred = model.predict(plan, nbytes, momentum and compressed)
        dense_s, codec_s = pred.dense_s, pred.codec_s
        ratio = codec_s / dense_s if dense_s > 0 else float("inf")
        if not compressed:
            pass                    # dense by the rule or by the user: nothing to judge
        elif pattern is not None:
            reason += " (given: not second-guessed by costs; predicted %.2fx dense%s)" % (
                ratio, "" if measured else ", by its bytes alone")
        elif not measured:
            reason += "; %s not measured: kept, priced by its bytes alone" % plan.strategy
        elif pred.strategy == "none":
            reason += "; predicted no faster than dense (%.3f ms vs %.3f ms, margin %d%%)" % (
                1e3 * codec_s, 1e3 * dense_s, round(100 * model.margin))
            plan = policy.plan_as(name, plan.shape, "none")
        else:
            reason += "; compression predicted %.2fx dense on this network" % ratio
    nbytes = compressors[plan.strategy].payload_nbytes(plan)
    pull = compressed_pull if plan.strategy != "none" else "dense"
    if getattr(compressors[plan.strategy], "summable", False):
        pull = "sum"
    return LayerDecision(plan.name, plan.shape, plan.size, plan.strategy, plan.rate, plan.k,
                         pull, int(nbytes), dense_s, codec_s, reason)
