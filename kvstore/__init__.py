"""The hylo KVStore plugin (importable as mxhylo.kvstore), in the order one gradient meets it.

trainer_hook      gluon.Trainer -> the store: parameter names, one exchange per step
hylo              the KVStoreBase that wires the rest: mx.kv.create('hylo')
readiness         when each gradient is written (MXNet's engine): the exchange's order
policy            which compression each layer gets (name, shape -> LayerPlan)
memory            the per-layer residuals (error feedback) and codec state
momentum          momentum correction (compress the velocity, correct the aggregate)
cost_model        measured costs: which layers compression pays for; exchange drift
compressors       encode/decode of one layer's gradient (none, fc_2bit, conv_topk)
transport         the interface of the three transports, and Traffic
transport_local   payloads in one process (the in-process store)
transport_horovod payloads over Horovod's ring allreduce and allgather
transport_ps      payloads over MXNet's parameter server (dist_sync): the exchange
ps_keys           its keys: chunks, placement, buckets, the servers' layout table
ps_checkpoint     the servers' state in checkpoints
watchdog          the bound on one exchange
wire              every byte layout in parameter-server keys (writer beside reader)
server            the decoding and aggregation that runs on the parameter servers
"""
from .hylo import DistSyncHylo, Hylo, create
from .policy import LayerPlan, LayerPolicy, adaptive_conv_rate

__all__ = ["Hylo", "DistSyncHylo", "create", "LayerPlan", "LayerPolicy", "adaptive_conv_rate"]
