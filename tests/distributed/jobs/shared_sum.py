"""Worker of test_shared_scale_dist.py (and test_horovod.py): a layer of the shared_2bit
codec (or CODEC) over the real parameter servers, its 'sum' pull in 3 chunks, or over
Horovod's allgather.

    python tests/distributed/jobs/shared_sum.py OUT [CODEC]   (under mxhylo.launch or horovodrun)

Each worker pushes STEPS seeded gradients (numpy RandomState(SEED + rank)) and writes
to OUT.npz (OUT may contain {rank}) every aggregate it pulled and the value it
agreed after each step; OUT (JSON): the layer's chunks and pull bytes.
"""
import json
import sys

import mxnet as mx
import numpy as np

import mxhylo
from mxhylo.kvstore import transport_ps

SHAPE = (96, 1000)
STEPS = 4
SEED = 700


def gradient(rng):
    return rng.normal(0, 1, SHAPE).astype(np.float32) * 1e-2


def main(out, codec="shared_2bit"):
    transport_ps.CHUNK_ELEMENTS = 32768      # the layer in 3 chunks
    transport_ps.SPLIT_ELEMENTS = 1 << 30
    kv = mxhylo.create("dist_sync_hylo", policy={"fc": codec}, warmup_steps=0)
    kv.broadcast("fc", mx.nd.zeros(SHAPE), out=mx.nd.zeros(SHAPE))
    rng = np.random.RandomState(SEED + kv.rank)
    arrays = {}
    for step in range(STEPS):
        g = mx.nd.array(gradient(rng))
        kv.pushpull("fc", g)
        arrays["aggregate/%d" % step] = g.asnumpy()
        for agreed in ("threshold", "value"):
            arrays["%s/%d" % (agreed, step)] = np.float64(
                kv.memory.scalar("fc", "shared_" + agreed) or 0.0)
    np.savez(out.format(rank=kv.rank) + ".npz", **arrays)
    stats = kv.stats()["layers"]["fc"]
    keys = getattr(kv.transport, "keys", None)        # (the parameter server's)
    pulls = [c.layout.pull for c in keys.chunks["fc"]] if keys else None
    json.dump({"policy": stats["policy"], "pulls": pulls, "transport": kv.options.transport,
               "bytes_pulled": stats["bytes_pulled"], "steps": stats["steps"],
               "dense_bytes": 4 * int(np.prod(SHAPE))},
              open(out.format(rank=kv.rank), "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
