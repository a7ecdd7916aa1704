"""TensorFlow's warnings about how its functions run do not fire for the engine's own choices.

- TensorFlow counts a function's traces per Python code object and warns of "frequent
  retracing" after five in ten calls. Every replicated step (train, test and predict, of every
  model) and every compiled optimizer update shared one code object, so a `fit` with validation
  data and a `predict`, or a few models in one process, printed that warning with no
  retracing to blame.
- "Using MirroredStrategy eagerly has significant overhead": the engine runs some steps eagerly
  by design (a model's own `train_step`), and the warning names TF calls the user never made.
"""

import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.platform import tf_logging

import keras_strategies as ks


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _tf_log():
    records = _Records()
    tf.get_logger().addHandler(records)
    try:
        yield records.messages
    finally:
        tf.get_logger().removeHandler(records)


def test_fits_with_validation_and_custom_loops_do_not_warn_of_retracing():
    with _tf_log() as messages:
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
    assert not [message for message in messages if "retracing" in message]


class OwnStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return self.compute_metrics(x, y, self(x), None)


def test_a_model_with_its_own_train_step_does_not_warn_of_eager_overhead():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 3)).astype("float32"), rng.normal(size=(12, 1)).astype("float32")
    with ks.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = OwnStep()
        model.compile(loss="mse", optimizer="sgd")
    tf_logging._log_counter_per_token.clear()  # TF logs it for the first five calls of the process only
    with _tf_log() as messages:
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert len(history["loss"]) == 2
    assert not [message for message in messages if "significant overhead" in message]
