"""The TensorFlow engine adds partial sums of an Embedding's gradients as `tf.distribute` does."""

import numpy as np
import tensorflow as tf

from keras_strategies.backend.tensorflow import gradients


def _slices(values, indices):
    return tf.IndexedSlices(tf.constant(values, "float32"), tf.constant(indices), tf.constant([4, 2]))


def test_indexed_slices_concatenate_their_slices():
    total = gradients.add(_slices([[1.0, 1.0]], [2]), _slices([[2.0, 3.0], [1.0, 0.0]], [2, 0]))
    assert isinstance(total, tf.IndexedSlices)
    np.testing.assert_array_equal(total.indices, [2, 2, 0])
    np.testing.assert_array_equal(total.values, [[1.0, 1.0], [2.0, 3.0], [1.0, 0.0]])
    np.testing.assert_array_equal(tf.convert_to_tensor(total), [[1.0, 0.0], [0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])


def test_a_mix_with_a_dense_tensor_is_dense():
    total = gradients.add(_slices([[1.0, 2.0]], [1]), tf.ones((4, 2)))
    assert not isinstance(total, tf.IndexedSlices)
    np.testing.assert_array_equal(total, [[1.0, 1.0], [2.0, 3.0], [1.0, 1.0], [1.0, 1.0]])
