"""Workers of a job in which worker rank 1 sends a malformed push (test_security.py).

    python tests/distributed/jobs/bad_push.py      (under mxhylo.launch, 2 workers)

Over MXNet's own 'dist_sync' store, each worker sends the servers a layout table of
one fp16 'slots' key (KEY, two rows a worker's slot) with mxhylo's decoder, then pushes
its slot: rank 0 the whole of it, rank 1 its first row only. The server must end on
that push, naming KEY and rank 1; a worker that gets an aggregate prints "pulled".
The scheduler and the server run this file too and serve inside ``import mxnet``.
"""
import mxnet as mx
import numpy as np

from mxhylo.kvstore.server import ServerDecoder
from mxhylo.kvstore.wire import plan_chunks, push_slot, row_sparse_push, rows_from_zero

KEY = 7
ELEMENTS = 2048         # an fp16 payload of 4096 bytes: two rows of 1024 values a slot


def main():
    kv = mx.kv.create("dist_sync")
    layout = plan_chunks("fp16", (ELEMENTS,), kv.num_workers, 1)[0]
    assert layout.kind == "slots" and layout.slot_rows == 2
    kv.set_optimizer(ServerDecoder({KEY: ("bad_layer", layout)}))
    kv.init(KEY, rows_from_zero(layout, mx.nd.zeros(layout.key_shape)))
    payload = np.full(ELEMENTS, 0.5, np.float16).view(np.uint8)
    push, _ = push_slot(layout, kv.rank, payload, ())
    if kv.rank == 1:        # the malformed push: half of the slot
        first = layout.slot_rows * kv.rank
        push, _ = row_sparse_push(layout, push.data[:1].asnumpy(), np.array([first]))
    kv.push(KEY, push)
    out = mx.nd.sparse.zeros("row_sparse", layout.key_shape)
    kv.row_sparse_pull(KEY, out=out, row_ids=mx.nd.arange(layout.rows, dtype=np.int64))
    out.wait_to_read()
    print("pulled", flush=True)


if __name__ == "__main__":
    main()
