"""Global batches split across replicas: nothing dropped, nothing repeated, order kept."""

import numpy as np
import pytest

from keras_strategies.input.splitting import batch_size_of, shard_sizes, split_batch


@pytest.mark.parametrize(
    "batch, replicas, expected",
    [(4, 2, [2, 2]), (4, 3, [2, 1, 1]), (10, 4, [3, 3, 2, 2]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (5, 1, [5])],
)
def test_shard_sizes_are_balanced_and_sum_to_the_batch(batch, replicas, expected):
    sizes = shard_sizes(batch, replicas)
    assert sizes == expected
    assert sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1


def test_split_keeps_order_and_structure():
    x = {"a": np.arange(7), "b": np.arange(14).reshape(7, 2)}
    shards = split_batch((x, np.arange(7) * 10, None), shard_sizes(7, 3))
    assert [s[0]["a"].tolist() for s in shards] == [[0, 1, 2], [3, 4], [5, 6]]
    assert np.concatenate([s[1] for s in shards]).tolist() == (np.arange(7) * 10).tolist()
    assert all(s[2] is None for s in shards)


def test_mismatched_batch_sizes_are_refused():
    with pytest.raises(ValueError, match=r"same first dimension.*\[3, 4\]"):
        batch_size_of((np.zeros((3, 1)), np.zeros((4, 1))))
    with pytest.raises(ValueError, match="no array"):
        batch_size_of((None,))
