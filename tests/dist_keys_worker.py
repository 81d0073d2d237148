"""Worker of test_dist.py: exchanges a fixed set of keys with the hylo store.

    python tests/dist_keys_worker.py fusion OUT      21 small tensors in one pushpull call
    python tests/dist_keys_worker.py mismatch OUT    rank 1 has a differently shaped model
OUT may contain {rank}; the worker writes its results there as JSON.
"""
import json
import sys

import mxnet as mx
import numpy as np

import mxhylo

mode, out = sys.argv[1], sys.argv[2]
kv = mxhylo.create("dist_sync_hylo")
shapes = [(100,), (3, 7), (64,), (1,), (5, 5, 2)] * 4 + [(40, 40)]   # all below 8192
if mode == "mismatch":
    shapes = [(64, 32, 3, 3) if kv.rank == 0 else (32, 32, 3, 3)]
keys = list(range(len(shapes)))
params = [mx.nd.zeros(s) for s in shapes]
kv.broadcast(keys, params, out=params)
ok = True
for step in range(3):
    grads = [mx.nd.full(s, float(kv.rank + 1 + step)) for s in shapes]
    kv.pushpull(keys, grads)
    want = sum(r + 1 + step for r in range(kv.num_workers))
    ok &= all(np.all(g.asnumpy() == want) for g in grads)
stats = kv.stats()
json.dump({"ok": bool(ok), "messages_per_step": stats["messages_per_step"],
           "bytes_per_server": stats["bytes_per_server"], "rank": kv.rank},
          open(out.format(rank=kv.rank), "w"))
