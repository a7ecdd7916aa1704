"""`OneDeviceStrategy`: placement, and Keras training identical to no strategy."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.keras_integration.ownership import strategy_of

TORCH = keras.backend.backend() == "torch"


def build_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(1),
        ]
    )
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
    return model


def data(n=22):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(n, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def test_variables_and_computation_are_placed_on_the_device():
    strategy = ks.OneDeviceStrategy("/cpu:1")
    assert strategy.extended.worker_devices == ("cpu:1",)
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        model = build_model()
        variable = keras.Variable(1.0)
    # PyTorch has one CPU device: its CPU replica slots all map to it.
    expected = "cpu:0" if TORCH else "cpu:1"
    assert engine.devices.device_of(model.weights[0]) == expected
    assert engine.devices.device_of(variable) == expected
    assert strategy_of(model) is strategy
    assert strategy.extended.variable_created_in_scope(variable)
    assert not ks.get_strategy().extended.variable_created_in_scope(variable)
    result = strategy.run(lambda: ops.ones((2,)))
    assert engine.devices.device_of(result) == expected


def test_fit_evaluate_predict_equal_no_strategy():
    x, y = data()
    reference = build_model()
    initial = reference.get_weights()
    strategy = ks.OneDeviceStrategy("cpu:1")
    with strategy.scope():
        model = build_model()
    model.set_weights(initial)

    kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0, validation_split=0.25)
    expected_history = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    assert history.keys() == expected_history.keys()
    for key in history:
        np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-6, atol=1e-6)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=5, verbose=0), reference.evaluate(x, y, batch_size=5, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(model.predict(x, batch_size=5, verbose=0), reference.predict(x, batch_size=5, verbose=0), rtol=1e-6)


def test_on_batch_methods_equal_no_strategy():
    x, y = data(8)
    reference = build_model()
    strategy = ks.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = build_model()
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-6)
    np.testing.assert_allclose(model.test_on_batch(x, y), reference.test_on_batch(x, y), rtol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x), reference.predict_on_batch(x), rtol=1e-6)


def test_compute_average_loss_in_training_step_sees_one_replica():
    seen = []

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            seen.append((ks.get_strategy(), ks.get_replica_context() is not None))
            return self.dense(x)

    strategy = ks.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = Model()
        model.compile(loss="mse", optimizer="sgd")
    model.fit(*data(4), epochs=1, verbose=0)
    assert (strategy, True) in seen


def test_reduce_and_gather_on_one_device_keep_the_value_or_reduce_along_the_axis():
    strategy = ks.OneDeviceStrategy("cpu:0")
    values = np.array([[1.0, 2.0], [3.0, 4.0]], "float32")
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.reduce("sum", values, axis=None)), values)
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.reduce("sum", values, axis=0)), [4.0, 6.0])
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.reduce("mean", values, axis=0)), [2.0, 3.0])
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.gather(values, axis=0)), values)
    with pytest.raises(ValueError, match="rank >= 1"):
        strategy.gather(np.float32(1.0), axis=0)


def test_unknown_device_names_the_devices_that_exist():
    with pytest.raises(ValueError, match=r"Unknown device\(s\) \['gpu:0'\]"):
        ks.OneDeviceStrategy("gpu:0")
    with pytest.raises(ValueError, match="Invalid device 'tpu-ish'"):
        ks.OneDeviceStrategy("tpu-ish")
