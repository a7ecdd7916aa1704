"""Flat pieces: any shape cut into N equal pieces (the last padded with zeros) and joined back."""

import math

import keras
import numpy as np
import pytest

from keras_strategies.sharding import flat_shards


@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 7), (3, 2, 5), (8, 4)])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_then_join_is_the_identity(shape, n):
    value = np.arange(math.prod(shape), dtype="float32").reshape(shape) + 1
    pieces = flat_shards.split(keras.ops.convert_to_tensor(value), n)
    length = flat_shards.piece_length(shape, n)
    assert [tuple(p.shape) for p in pieces] == [(length,)] * n
    flat = np.concatenate([keras.ops.convert_to_numpy(p) for p in pieces])
    np.testing.assert_array_equal(flat[:value.size], value.reshape(-1))
    np.testing.assert_array_equal(flat[value.size:], 0)  # the padding
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(flat_shards.join(pieces, shape)), value)


def test_piece_length_rounds_up_and_never_is_zero():
    assert flat_shards.piece_length((5, 7), 4) == 9
    assert flat_shards.piece_length((8,), 4) == 2
    assert flat_shards.piece_length((), 4) == 1
    assert flat_shards.piece_length((0,), 4) == 1
