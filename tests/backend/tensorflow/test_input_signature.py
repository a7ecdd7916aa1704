"""TensorFlow: a distributed dataset's `element_spec` as a `tf.function` `input_signature`.

TensorFlow's distributed input guide writes
`@tf.function(input_signature=[dist_dataset.element_spec])`, which
`s/tf.distribute/ks/` turned into an AttributeError.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_strategies as ks


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_step_traced_once_from_the_element_spec_sees_every_row(replicas):
    strategy = ks.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    x = np.arange(20, dtype="float32").reshape(10, 2)
    dataset = tf.data.Dataset.from_tensor_slices((x, np.ones((10,), "float32"))).batch(4)  # 4, 4, 2 rows
    dist = strategy.experimental_distribute_dataset(dataset)

    @tf.function(input_signature=[dist.element_spec])
    def step(batch):
        return strategy.run(lambda features, weights: tf.reduce_sum(features * weights[:, None]), args=batch)

    total = sum(float(strategy.reduce("sum", step(batch), axis=None)) for batch in dist)
    assert total == x.sum()
    assert step.experimental_get_tracing_count() == 1
