"""The hylo KVStore plugin (importable as mxhylo.kvstore).

policy            which compression each layer gets (name, shape -> LayerPlan)
memory            the per-layer residuals (error feedback) and codec state
compressors       encode/decode of one layer's gradient (none, fc_2bit, conv_topk)
transport_local   payloads in one process (the in-process store)
transport_ps      payloads over MXNet's parameter server (dist_sync)
server            the decoding and aggregation that runs on the parameter servers
hylo              the KVStoreBase that wires them: mx.kv.create('hylo')
"""
from .hylo import DistSyncHylo, Hylo, create
from .policy import LayerPlan, LayerPolicy, adaptive_conv_rate

__all__ = ["Hylo", "DistSyncHylo", "create", "LayerPlan", "LayerPolicy", "adaptive_conv_rate"]
