"""The hylo store's options: the one table a user reads, and their checks.

Every public option is a field of ``Options``. Its docstring is the options table
(rendered into the README by ``table_markdown``): name, default, what it does, when to
change it. An option given at its default value behaves exactly as the default.
"""
from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from .policy import DEFAULT_SIZE_THRESHOLD, compress_pull_mode

# dense steps first. The accuracy study (docs/BENCHMARKS.md, cosine schedule, 4
# workers, 3 seeds, the same dense runs) met its bar in 4 of the 10 cells at lr 0.05
# and 0.1 with 10 warm-up steps, in 9 of them with 30: the first epochs after the lr's
# ramp move fastest, where error feedback's delay costs the most. The route trial times
# the servers' route on these steps (its first kvstore.route.SKIPPED_STEPS untimed).
DEFAULT_WARMUP_STEPS = 30

# options no longer offered -> what to do instead (the error a user gets)
REMOVED_OPTIONS = {
    "momentum_masking": "momentum correction never masks (masking slowed conv nets "
                        "per step); drop the option",
    "max_conv_rate": "pass conv_rate= for a fixed rate, or policy= per layer",
    "min_conv_rate": "pass conv_rate= for a fixed rate, or policy= per layer",
    "threshold_scale": "the 2-bit threshold is the mean |gradient + residual|; drop "
                       "the option",
    "cost_recheck_steps": "the store re-plans when the exchange time drifts; drop the "
                          "option (cost_model=False turns measuring off)",
    "cost_drift": "the store re-plans when the exchange time drifts by 2x; drop the "
                  "option (cost_model=False turns measuring off)",
    "overlap": "the exchange always overlaps backward where the transport allows it; "
               "drop the option",
    "chunk_elements": "the parameter-server keys are sized by the store; drop the option",
    "bucket_bytes": "the parameter-server keys are sized by the store; drop the option",
    "split_elements": "the parameter-server keys are sized by the store; drop the option",
    "collective_timeout": "the servers keep no state that a checkpoint must gather from "
                          "every worker; drop the option",
}

# (name, default shown, what it does, when to change it): the options table
TABLE = (
    ("policy", "{}", "name regex -> codec ('conv_topk', 'fc_2bit', 'shared_2bit', 'fp16', "
     "'none'), "
     "tried in order, before the rule", "to force a codec on some layers; "
     "{'.*': 'none'} turns compression off"),
    ("size_threshold", "8192", "layers with fewer elements travel uncompressed",
     "rarely; fixes the plan without the cost model"),
    ("conv_rate", "None (conv layers 2-bit)", "given: conv layers send their top-k "
     "filters (by L2 norm), this fraction of them per step, instead of 2 bits per element",
     "for long jobs on slow links: under 1/16 it sends fewer bytes than 2-bit, each "
     "filter waiting about 1/rate steps"),
    ("compress_pull", "'auto'", "'auto'/True: the workers' payloads gathered (exact; "
     "from 16 workers, shared_2bit's integer sums); False: the dense aggregate",
     "rarely: False for Hylo's dense pull as published"),
    ("warmup_steps", "30", "a compressed layer's first exchanges travel dense (on the "
     "servers' route, which server_update='auto' times on them)", "0 to compress from "
     "the first step (no route trial); more for a high learning rate early on"),
    ("momentum_correction", "'auto'", "with MXNet's SGD and momentum, compress the "
     "velocity and correct the aggregate (DGC)", "False for plain error feedback"),
    ("cost_model", "'auto'", "measure the network and codecs at start-up, plan by "
     "them, re-plan when the exchange time drifts", "False to plan by the rule alone "
     "(no measurement)"),
    ("server_update", "'auto'", "where a Trainer's optimizer runs: 'auto' (the warm-up "
     "on the servers, then compressed steps on the workers: the faster route is kept), "
     "True (servers, dense, as dist_sync), False (workers, hylo)", "True or False to "
     "force the route"),
    ("transport", "'auto'", "'ps' (MXNet's parameter server), 'horovod', 'local'",
     "rarely: 'auto' follows the launcher"),
    ("stall_timeout", "None (derived)", "seconds one exchange over the parameter server "
     "may take before the worker ends with an error naming what is owed",
     "a number to bound it yourself; 0 turns the bound off"),
)


@dataclass(frozen=True)
class Options:
    """The hylo store's options, checked (see TABLE for what each does).

    Fields are as given, normalised: size_threshold and warmup_steps ints;
    compress_pull 'gather' or None for this transport; transport resolved from 'auto'.
    ``given`` names the plan options set to something other than their default: they
    fix the plan as given (the cost model, with cost_model='auto', then stays off).
    """
    size_threshold: int = DEFAULT_SIZE_THRESHOLD
    conv_rate: Optional[float] = None
    policy: dict = field(default_factory=dict)
    compress_pull: Optional[str] = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    momentum_correction: object = "auto"
    cost_model: object = "auto"
    server_update: object = "auto"
    transport: str = "local"
    stall_timeout: Optional[float] = None
    given: tuple = ()

    @property
    def measures(self):
        """Whether the store measures costs and plans by them."""
        return self.cost_model is True or (self.cost_model == "auto" and not self.given
                                           and self.transport in ("ps", "horovod"))

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "given"}


def make_options(transport, size_threshold=None, conv_rate=None, policy=None,
                 compress_pull="auto", momentum_correction="auto", warmup_steps=None,
                 cost_model="auto", server_update="auto", stall_timeout=None, **unknown):
    """Options from what a user passed to mxhylo.create (an error naming the problem
    for anything it cannot take); ``transport`` already resolved ('local', 'ps',
    'horovod')."""
    refuse_unknown(unknown)
    for name, value in (("momentum_correction", momentum_correction),
                        ("cost_model", cost_model), ("server_update", server_update)):
        if value not in ("auto", True, False):
            raise ValueError("%s must be 'auto', True or False, got %r" % (name, value))
    if transport != "ps" and stall_timeout is not None:
        raise ValueError("stall_timeout bounds an exchange over the parameter server; "
                         "the %r transport has none" % (transport,))
    distributed = transport == "ps"
    pull = compress_pull_mode(compress_pull, distributed)
    given = (("policy", bool(policy)),
             ("size_threshold", size_threshold is not None
              and size_threshold != DEFAULT_SIZE_THRESHOLD),
             ("conv_rate", conv_rate is not None),
             ("compress_pull", pull != compress_pull_mode("auto", distributed)))
    return Options(
        size_threshold=DEFAULT_SIZE_THRESHOLD if size_threshold is None else size_threshold,
        conv_rate=conv_rate, policy=dict(policy or {}), compress_pull=pull,
        warmup_steps=_steps("warmup_steps", warmup_steps, DEFAULT_WARMUP_STEPS),
        momentum_correction=momentum_correction, cost_model=cost_model,
        server_update=server_update, transport=transport, stall_timeout=stall_timeout,
        given=tuple(name for name, differs in given if differs))


def refuse_unknown(options):
    """A TypeError naming every option given that the store does not take, and for a
    removed one what replaces it."""
    if not options:
        return
    lines = ["%s: %s" % (name, REMOVED_OPTIONS[name]) if name in REMOVED_OPTIONS
             else "%s: not an option of the hylo store" % name for name in sorted(options)]
    raise TypeError("mxhylo.create: " + "; ".join(lines))


def _steps(name, value, default):
    """A count of steps: ``default`` for None, else a non-negative int."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError("%s must be a non-negative int, got %r" % (name, value))
    return int(value)


def table_markdown():
    """The options table as Markdown (the README's)."""
    rows = ["| option | default | what it does | when to change it |",
            "|---|---|---|---|"]
    rows += ["| `%s` | `%s` | %s | %s |" % row for row in TABLE]
    return "\n".join(rows)
