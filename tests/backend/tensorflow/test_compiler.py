"""TensorFlow's compilation helpers (`backend/tensorflow/compiler.py`)."""

import keras
import numpy as np
import tensorflow as tf

from keras_strategies.backend.tensorflow import compiler


def test_run_if_makes_its_updates_and_returns_its_outputs_only_when_the_condition_holds():
    counter = keras.Variable(0.0)

    def update():
        counter.assign_add(1.0)
        return {"count": counter.value, "vector": tf.ones((3,), "int32")}

    @tf.function(autograph=False)
    def step(go_on):
        return compiler.run_if(go_on, update)

    taken = step(tf.constant(True))
    assert float(counter.numpy()) == 1.0 and float(taken["count"]) == 1.0
    np.testing.assert_array_equal(taken["vector"].numpy(), [1, 1, 1])
    skipped = step(tf.constant(False))
    assert float(counter.numpy()) == 1.0  # the update did not run
    assert float(skipped["count"]) == 0.0 and skipped["vector"].dtype == tf.int32
    np.testing.assert_array_equal(skipped["vector"].numpy(), [0, 0, 0])
