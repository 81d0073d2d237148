"""The hylo KVStore plugin (importable as mxhylo.kvstore), in the order one gradient meets it.

trainer_hook      gluon.Trainer -> the store: parameter names, one exchange per step
hylo              the KVStoreBase adapter: mx.kv.create('hylo'), kv.plan(), kv.stats()
options           the options table and its checks
planner           what was measured and the plan in force (feeds plan.make_plan)
measure           the one measurement: dense probes, links, codec timings
plan              the planner, a pure function: layers, options, costs -> Plan
policy            the rule: which codec each layer could get (name, shape -> LayerPlan)
cost_model        measured costs -> a layer's predicted exchange dense and compressed
pipeline          one exchange: reduce, stages, transport, finish, write
readiness         when each gradient is written (MXNet's engine): the exchange's order
stages            around a codec: warm-up, momentum correction, error feedback
momentum          momentum correction's arithmetic (the velocity, the corrected aggregate)
memory            the per-layer residuals (error feedback) and codec state
compressors       encode/decode of one layer's gradient (none, fc_2bit, conv_topk)
transport         the interface of the three transports, and Traffic
transport_local   payloads in one process (the in-process store)
transport_horovod payloads over Horovod's ring allreduce and allgather
transport_ps      payloads over MXNet's parameter server (dist_sync): the exchange
ps_keys           its keys: chunks, placement, buckets, the servers' layout table
watchdog          the bound on one exchange
wire              every byte layout in parameter-server keys (writer beside reader)
server            the decoding and aggregation that runs on the parameter servers
server_route      the servers' route: dense, the Trainer's optimizer on the servers
"""
from .hylo import DistSyncHylo, Hylo, create
from .policy import LayerPlan, LayerPolicy, adaptive_conv_rate

__all__ = ["Hylo", "DistSyncHylo", "create", "LayerPlan", "LayerPolicy", "adaptive_conv_rate"]
