"""The store's planning state: what was measured, and the plan in force.

kvstore.plan.make_plan is pure; this object feeds it. It holds the one measurement
(kvstore.measure, at start-up and again when the exchange drifts), what the attached
Trainer is (kvstore.plan.TrainerFacts), the Plan of its parameters, and the decision of
every key seen. Every worker holds the same figures (rank 0's), so every worker reaches
the same plan.
"""
import time

from .cost_model import ExchangeDrift
from .measure import measure
from .plan import Costs, TrainerFacts, make_plan
from .policy import LayerPlan

# with the cost model: every this many Trainer steps the workers agree (rank 0's
# figures) whether the exchange has become DRIFT_FACTOR times slower or faster since
# the last measurement; if so they measure again and re-plan
DRIFT_CHECK_STEPS = 50
DRIFT_WINDOW = 20        # steps of each median compared (ExchangeDrift)
DRIFT_FACTOR = 2.0


class Planner:
    """Measurements and plans of one store (see the module docstring).

    options: kvstore.options.Options; policy: its LayerPolicy; compressors: the codecs;
    transport: the store's (measuring is collective through it).
    """

    def __init__(self, options, policy, compressors, transport):
        self.options, self.policy = options, policy
        self.compressors, self.transport = compressors, transport
        # how compressed payloads come back, in the cost model's terms
        self.pull = "allgather" if options.transport == "horovod" else options.compress_pull
        self.cost = None          # CostModel of the last measurement (None: not measured)
        self.measured_s = 0.0     # seconds spent measuring, in all
        self.rechecks = {"drift": 0}
        self.facts = None         # TrainerFacts of the attached Trainer
        self.plan = None          # the Plan of its parameters, once chosen
        self.layers = []          # (name, shape) of its parameters that train
        self.step_s = {}          # route -> measured median seconds a step (kvstore.route)
        self.decisions = {}       # name -> LayerDecision of every key seen
        self.drift = None
        if options.measures:
            self.measure()
            self.drift = ExchangeDrift(DRIFT_FACTOR, DRIFT_WINDOW)

    def measure(self):
        """Measure (collective) and count what it cost."""
        clock = time.perf_counter()
        self.cost = self.measure_now()
        self.measured_s += time.perf_counter() - clock

    def measure_now(self):
        """The CostModel of one measurement (collective; rank 0's figures)."""
        return measure(self.transport, self.policy, self.compressors, self.pull).model

    def costs(self):
        return None if self.cost is None else \
            Costs.from_cost_model(self.cost, self.measured_s)

    def make(self, layers, costs):
        """The Plan of ``layers`` ((name, shape) pairs) priced by ``costs``."""
        o = self.options
        return make_plan(layers, policy=self.policy, compress_pull=self.pull,
                         server_update=o.server_update, costs=costs, trainer=self.facts,
                         num_workers=self.transport.num_workers,
                         num_servers=self.transport.num_servers, transport=o.transport,
                         warmup_steps=o.warmup_steps, step_s=self.step_s)

    def plan_trainer(self, trainer):
        """The Plan of ``trainer``'s parameters, route included."""
        self.facts = TrainerFacts.from_trainer(trainer, self.options.momentum_correction)
        self.layers = [(p.name, tuple(p.shape)) for p in trainer._params
                       if p.grad_req != "null" and p.shape and all(d > 0 for d in p.shape)]
        return self.retime({})

    def retime(self, step_s):
        """The Trainer's Plan again, its route judged by ``step_s`` (route -> measured
        median seconds of one step; kvstore.route): the layers' decisions stay."""
        self.step_s = dict(step_s)
        self.plan = self.make(self.layers, self.costs())
        self.decisions.update((d.name, d) for d in self.plan.layers)
        return self.plan

    def layer_plan(self, name, shape):
        """The LayerPlan of parameter ``name`` with ``shape``: its decision in the plan,
        or, for a key no plan saw, decided alone by the same rules."""
        d = self.decisions.get(name)
        if d is None or d.shape != tuple(shape):
            d = self.decisions[name] = self.make([(name, tuple(shape))],
                                                 self.costs()).layers[0]
        return as_layer_plan(d)

    def current(self, layers):
        """The Plan in force: the Trainer's, else of ``layers`` (the keys seen)."""
        return self.plan if self.plan is not None else self.make(layers, self.costs())

    def replan(self, layers):
        """Measure again and decide ``layers`` ((name, shape)) anew: name -> LayerPlan.
        The route stays (the optimizer's state lives where it runs)."""
        if self.cost is None:
            raise ValueError("recheck_costs needs the cost model (this store was created "
                             "with cost_model off, or with options that override it)")
        self.measure()
        self.drift.reset()              # the next steps are the new baseline
        new = {d.name: d for d in self.make(layers, self.costs()).layers}
        self.decisions.update(new)
        return {name: as_layer_plan(d) for name, d in new.items()}

    def drifted(self, step, exchange_s):
        """Add this step's exchange seconds; whether to measure again now (collective at
        every DRIFT_CHECK_STEPS-th step: every worker takes rank 0's answer)."""
        if self.drift is None:
            return False
        self.drift.add(exchange_s)
        if step % DRIFT_CHECK_STEPS:
            return False
        drifted = float(self.drift.drifted()) if self.transport.rank == 0 else 0.0
        return self.transport.share_from_rank0([drifted])[0] > 0.5


def as_layer_plan(decision):
    """The LayerPlan the codecs and keys read, of a kvstore.plan.LayerDecision."""
    return LayerPlan(decision.name, tuple(decision.shape), decision.codec,
                     rate=decision.rate, k=decision.k)
