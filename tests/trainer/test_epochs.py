"""The epoch loop shared by every `fit`: validation on the epochs `validation_freq` selects (an int
or a list of epochs), stopping and the History, as in Keras' own `fit`.

`ParameterServerStrategy`'s `fit` runs the same loop: its tests are in
`tests/strategies/test_parameter_server.py` (they need a cluster).
"""

import keras
import numpy as np
import pytest

import keras_strategies as ks

TOL = dict(rtol=1e-5, atol=1e-5)


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(22, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-0.5], [2.0]], "float32")).astype("float32")


@pytest.mark.parametrize("validation_freq, validated", [(2, 2), ([1, 3, 4], 3)], ids=["every-2nd", "list"])
def test_validation_runs_on_the_epochs_validation_freq_selects_as_on_one_device(validation_freq, validated):
    x, y = _data()
    kwargs = dict(batch_size=5, epochs=4, shuffle=False, verbose=0, validation_data=(x[:7], y[:7]),
                  validation_freq=validation_freq)
    reference = _model()
    expected = reference.fit(x, y, **kwargs).history
    with ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).scope():
        model = _model()
    got = model.fit(x, y, **kwargs).history
    assert sorted(got) == sorted(expected) == ["loss", "mae", "val_loss", "val_mae"]
    assert len(got["loss"]) == 4 and len(got["val_loss"]) == validated
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)


def test_a_callback_that_stops_training_ends_the_loop_after_its_epoch_and_train_end_sees_its_logs():
    x, y = _data()
    seen = {}

    class StopAtSecondEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

        def on_train_end(self, logs=None):
            seen.update(logs)

    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model()
    history = model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[StopAtSecondEpoch()])
    assert len(history.history["loss"]) == 2
    assert seen["loss"] == pytest.approx(history.history["loss"][-1])


def test_a_validation_freq_that_is_neither_int_nor_list_gets_keras_error():
    x, y = _data()
    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model()
    with pytest.raises(ValueError, match="validation_freq"):
        model.fit(x, y, epochs=1, verbose=0, validation_data=(x, y), validation_freq="often")
