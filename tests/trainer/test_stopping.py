"""A callback's stop ends `fit` / `evaluate` / `predict` at the step it asks, as on one device.

Across workers (a stop asked on one worker only) see
`tests/multi_worker/test_multi_worker_training.py`; here one process with
several replicas, where the loop leaves at once, as Keras' does.
"""

import keras
import numpy as np
import pytest

import keras_strategies as ks

TOL = dict(rtol=1e-5, atol=1e-5)


class StopsAt(keras.callbacks.Callback):
    """Stops training after batch `train_batch`, evaluation and prediction after batch 0."""

    def __init__(self, train_batch):
        super().__init__()
        self.train_batch = train_batch

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = self.model.stop_training or batch == self.train_batch

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = True


def _build(steps_per_execution):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _stopped(model, x, y, train_batch):
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[StopsAt(train_batch)])
    return (history.history["loss"], int(model.optimizer.iterations.numpy()), model.get_weights(),
            model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[StopsAt(train_batch)]),
            model.predict(x, batch_size=8, verbose=0, callbacks=[StopsAt(train_batch)]))


# (steps_per_execution, stopping batch, steps taken); Keras' torch trainer takes one step per execution.
CASES = [(1, 1, 2), (1, 2, 3)] + ([(2, 1, 2), (2, 3, 4)] if keras.backend.backend() != "torch" else [])


@pytest.mark.parametrize("steps_per_execution, train_batch, steps", CASES)
def test_a_callback_stop_within_an_epoch_equals_one_device(steps_per_execution, train_batch, steps):
    # 30 rows in batches of 8 (the last one partial), on 3 replicas.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(30, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    reference = _build(steps_per_execution)
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = _build(steps_per_execution)
    model.set_weights(reference.get_weights())
    expected, got = _stopped(reference, x, y, train_batch), _stopped(model, x, y, train_batch)
    loss, iterations, weights, evaluated, predicted = got
    assert iterations == expected[1] == steps
    assert len(loss) == 1 and len(predicted) == 8 * steps_per_execution
    np.testing.assert_allclose(loss, expected[0], **TOL)
    for a, b in zip(weights, expected[2]):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(evaluated, expected[3], **TOL)
    np.testing.assert_allclose(predicted, expected[4], **TOL)
