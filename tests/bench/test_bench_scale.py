"""python -m mxhylo.bench scale, its merge part: the emulation of the servers' merge."""
import mxnet as mx
import numpy as np

from mxhylo.bench import scale
from mxhylo.kvstore.wire import plan_chunks


def test_the_servers_merge_is_the_sum_of_the_slots():
    """merge_as_server adds W workers' slot pushes (disjoint rows, any arrival order)
    into the key every worker then pulls; the merge part reports each W asked for."""
    rng = np.random.RandomState(0)
    layout = plan_chunks("shared_2bit", (40000,), 3, 1, pull="gather")[0]
    slots = rng.randn(3, layout.slot_rows, layout.cols).astype(np.float32)
    pushes = [mx.nd.sparse.row_sparse_array(
        (slots[w], np.arange(w * layout.slot_rows, (w + 1) * layout.slot_rows)),
        shape=layout.key_shape) for w in (2, 0, 1)]
    merged = scale.merge_as_server(pushes)
    np.testing.assert_array_equal(merged.tostype("default").asnumpy(),
                                  slots.reshape(layout.key_shape))
    rows = scale.server_merge([2, 3], 40000, 1)
    assert [r["workers"] for r in rows] == [2, 3]
    assert all(r["key_s"] > 0 and r["per_slot_s"] > 0 for r in rows)
