"""mxhylo.data: the built-in digits and their shards."""
import numpy as np
import pytest


@pytest.mark.parametrize("n,parts", [(10, 3), (1348, 2), (1348, 3), (5, 5), (7, 1)])
def test_shard_gives_every_worker_the_same_number_of_samples(n, parts):
    """Equal shards (the remainder left out), contiguous and disjoint: every worker then
    steps with the same batch sizes, so where each scales the summed gradient by its own
    batch size the workers still agree."""
    from mxhylo.data import shard
    x, y = np.arange(n * 2).reshape(n, 2), np.arange(n)
    parts_y = [shard(x, y, parts, i)[1] for i in range(parts)]
    assert {len(p) for p in parts_y} == {n // parts}
    taken = np.concatenate(parts_y)
    np.testing.assert_array_equal(taken, np.arange(n // parts * parts))
    np.testing.assert_array_equal(shard(x, y, parts, parts - 1)[0][:, 0] // 2,
                                  parts_y[-1])
    with pytest.raises(ValueError, match="not one of the"):
        shard(x, y, parts, parts)
    with pytest.raises(ValueError, match="cannot give"):
        shard(x[:parts - 1], y[:parts - 1], parts, 0)
