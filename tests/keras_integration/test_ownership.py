"""Importing keras_strategies changes nothing for Keras code outside strategy scopes."""

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.keras_integration.ownership import KERAS_METHODS, strategy_of


def test_models_and_variables_outside_scopes_have_no_strategy():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    assert strategy_of(model) is None
    assert all(strategy_of(v) is None for v in model.weights)
    assert strategy_of(keras.Variable(1.0)) is None


def test_hooks_keep_keras_signatures_and_docs():
    for name in KERAS_METHODS:
        method = getattr(keras.Model, name)
        assert method.__doc__ == method._ks_original.__doc__
        assert method.__name__ == name


def test_plain_keras_training_is_unchanged():
    x, y = np.full((4, 1), 2.0, "float32"), np.ones((4, 1), "float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.01))
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    # Two SGD steps by hand: w <- w - lr * 2 * (2w - 1) * 2.
    w, losses = 1.0, []
    for _ in range(2):
        losses.append((2 * w - 1) ** 2)
        w -= 0.01 * 4 * (2 * w - 1)
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-6)
    np.testing.assert_allclose(model.get_weights()[0], [[w]], rtol=1e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0), np.full((4, 1), 2 * w), rtol=1e-6)


def test_a_model_compiled_under_another_strategy_is_refused():
    first, second = ks.OneDeviceStrategy("cpu:0"), ks.OneDeviceStrategy("cpu:1")
    with first.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    with second.scope():
        try:
            model.compile(loss="mse", optimizer="sgd")
        except ValueError as error:
            assert "created under" in str(error)
        else:
            raise AssertionError("compiling under another strategy must raise ValueError")


def test_training_a_model_from_outside_every_scope_inside_a_scope_is_refused_clearly():
    x, y = np.ones((4, 1), "float32"), np.ones((4, 1), "float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    with ks.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        for train in (lambda: model.fit(x, y, verbose=0), lambda: model.train_on_batch(x, y)):
            with pytest.raises(ValueError, match="built and compiled outside any strategy scope.*inside `with strategy.scope"):
                train()
        np.testing.assert_allclose(model.evaluate(x, y, verbose=0), model.test_on_batch(x, y))  # no update: allowed
    assert len(model.fit(x, y, verbose=0).history["loss"]) == 1  # outside the scope: on one device


def test_a_models_method_inside_another_strategys_scope_names_both_strategies():
    x = np.ones((4, 1), "float32")
    with ks.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    with ks.OneDeviceStrategy("cpu:0").scope():
        for call in (lambda: model.fit(x, x, verbose=0), lambda: model.predict(x, verbose=0)):
            with pytest.raises(ValueError, match=r"belongs to MirroredStrategy.*inside the scope of another strategy, "
                                                 r"OneDeviceStrategy.*Call `(fit|predict)` outside that scope"):
                call()
    assert len(model.fit(x, x, verbose=0).history["loss"]) == 1  # outside: on its own strategy


def test_keras_methods_inside_strategy_run_are_refused_clearly():
    x = np.ones((4, 1), "float32")
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    for call in (lambda: model.fit(x, x, verbose=0), lambda: model.predict(x, verbose=0), lambda: model.evaluate(x, x)):
        with pytest.raises(RuntimeError, match="cannot be called inside `strategy.run`"):
            strategy.run(call)
    one_device = ks.OneDeviceStrategy("cpu:0")
    with one_device.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    # Keras' own fit (one replica) calls evaluate for the validation data: allowed.
    assert "val_loss" in model.fit(x, x, validation_data=(x, x), verbose=0).history


def test_saved_models_load_compiled(tmp_path):
    """`load_model` re-compiles a saved model (the compile hook must not look like an override)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(loss="mse", optimizer="adam")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer is not None
    np.testing.assert_allclose(
        loaded.evaluate(np.ones((8, 3)), np.ones((8, 2)), verbose=0),
        model.evaluate(np.ones((8, 3)), np.ones((8, 2)), verbose=0), rtol=1e-6,
    )
