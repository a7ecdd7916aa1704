"""Iterating a distributed dataset inside a `tf.function` is refused with a clear error.

TensorFlow's guide also shows `for _ in tf.range(n): strategy.run(fn, args=(next(iterator),))`
inside a `tf.function`. Our batches are split on the host, so a `next` while tracing would bake
one batch into the graph (and repeat it); it failed with "'SymbolicTensor' object has no
attribute 'numpy'" from deep inside the iterator. Taking batches in Python still works.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_strategies as ks

MESSAGE = "cannot be iterated inside a compiled function"


def _distributed():
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    x = np.arange(12, dtype="float32").reshape(6, 2)
    return strategy, strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(4))


def test_next_in_a_tf_range_loop_inside_a_tf_function_is_refused():
    strategy, dataset = _distributed()

    @tf.function
    def steps(iterator, n):
        for _ in tf.range(n):
            strategy.run(lambda x: x * 2, args=(next(iterator),))

    with pytest.raises(RuntimeError, match=MESSAGE):
        steps(iter(dataset), tf.constant(2))


def test_a_for_loop_over_the_dataset_inside_a_tf_function_is_refused_and_python_iteration_works():
    strategy, dataset = _distributed()

    @ks.function
    def epoch(ds):
        total = 0.0
        for batch in ds:
            total += strategy.reduce("sum", strategy.run(lambda x: tf.reduce_sum(x), args=(batch,)), axis=None)
        return total

    with pytest.raises(RuntimeError, match=MESSAGE):
        epoch(dataset)
    step = ks.function(lambda batch: strategy.reduce("sum", strategy.run(lambda x: tf.reduce_sum(x), args=(batch,)), axis=None))
    assert sum(float(step(batch)) for batch in dataset) == float(np.arange(12).sum())
