"""Padding rows of replica shards are copies of real rows; sample weights are padded with zeros."""

import numpy as np

from keras_strategies.input import padding


def test_a_shard_is_filled_with_copies_of_its_own_rows_in_order():
    x = np.arange(6, dtype="float32").reshape(2, 3)
    source = padding.source_rows({"a": x, "b": None})
    padded = padding.pad_with_copies({"a": x, "b": None}, 5, source)
    np.testing.assert_array_equal(padded["a"], x[[0, 1, 0, 1, 0]])
    assert padded["b"] is None


def test_an_empty_shard_is_filled_with_the_batch_s_first_row():
    batch = (np.array([[1.0, 2.0], [3.0, 4.0]], "float32"), np.array([7, 8]))
    source = padding.source_rows(batch)
    empty = tuple(leaf[:0] for leaf in batch)
    x, y = padding.pad_with_copies(empty, 2, source)
    np.testing.assert_array_equal(x, [[1.0, 2.0], [1.0, 2.0]])
    np.testing.assert_array_equal(y, [7, 7])
    assert x.dtype == np.float32 and y.dtype == batch[1].dtype


def test_a_batch_without_rows_copies_the_last_real_row_of_the_same_shapes_else_zeros():
    seen = np.array([[5.0, 6.0, 7.0]], "float32")
    padding.source_rows(seen)
    np.testing.assert_array_equal(padding.source_rows(np.zeros((0, 3), "float32")), seen)
    np.testing.assert_array_equal(padding.source_rows(np.zeros((0, 4), "float32")), np.zeros((1, 4)))


def test_sample_weights_are_padded_with_zeros():
    weights = np.array([0.5, 2.0], "float32")
    np.testing.assert_array_equal(padding.pad_with_zeros(weights, 4), [0.5, 2.0, 0.0, 0.0])
    assert padding.pad_with_zeros(None, 4) is None
