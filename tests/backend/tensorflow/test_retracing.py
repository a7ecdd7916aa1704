"""Each compiled step of the TensorFlow engine counts its own traces.

TensorFlow counts a function's traces per Python code object and warns of "frequent retracing"
after five in ten calls. Every replicated step (train, test and predict, of every model) and
every compiled optimizer update shared one code object, so a `fit` with validation data and a
`predict`, or a few models in one session, printed that warning with no retracing to blame.
"""

import logging

import keras
import numpy as np
import tensorflow as tf

import keras_strategies as ks


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fits_with_validation_and_custom_loops_do_not_warn_of_retracing():
    records = _Records()
    tf.get_logger().addHandler(records)
    try:
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(23, 4)).astype("float32"), rng.normal(size=(23, 1)).astype("float32")
        strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
        for _ in range(3):
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
                model.compile(loss="mse", optimizer="adam")
                optimizer = keras.optimizers.SGD(0.1)
            model.fit(x, y, batch_size=5, epochs=2, validation_split=0.3, verbose=0)  # shapes 5, 1; 5, 2
            model.predict(x, batch_size=4, verbose=0)

            def replica_step(features):
                loss, grads = ks.value_and_grad(lambda: keras.ops.mean(model(features)), model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(8)):
                strategy.run(replica_step, args=(batch,))
    finally:
        tf.get_logger().removeHandler(records)
    assert not [message for message in records.messages if "retracing" in message]
