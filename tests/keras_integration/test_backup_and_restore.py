"""`BackupAndRestore` under a strategy: `save_before_preemption=True` backs up on SIGTERM inside an
epoch and a restarted `fit` resumes after the batches trained, equal to an uninterrupted run.
(Several workers: tests/multi_worker/test_multi_worker_preemption.py.)"""

import json
import os
import signal

import keras
import numpy as np
import pytest

import keras_strategies as ks

x = np.random.default_rng(1).normal(size=(50, 5)).astype("float32")  # 4 batches of 16 (the last of 2)
y = x.sum(axis=1, keepdims=True)


def _model(strategy, weights=None):
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    if weights is not None:
        model.set_weights(weights)
    return model


class SigtermAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_backs_up_inside_the_epoch_and_fit_resumes_after_the_trained_batches(tmp_path):
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    initial = _model(strategy).get_weights()
    reference = _model(strategy, initial)
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    model = _model(strategy, initial)
    callbacks = [SigtermAt(epoch=1, batch=1), keras.callbacks.BackupAndRestore(backup, save_before_preemption=True)]
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    assert exited.value.code == 42
    with open(os.path.join(backup, "training_metadata.json")) as file:
        assert json.load(file) == {"epoch": 1, "batch": 1, "ks_trained_batches": 2}
    assert signal.getsignal(signal.SIGTERM) is before  # the callback gave SIGTERM back

    restarted = _model(strategy, initial)
    history = restarted.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                            callbacks=[keras.callbacks.BackupAndRestore(backup, save_before_preemption=True)])
    assert len(history.history["loss"]) == 2  # epochs 2 and 3
    for expected, actual in zip(reference.get_weights(), restarted.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert not os.path.exists(backup)


def test_without_save_before_preemption_nothing_changes():
    callback = keras.callbacks.BackupAndRestore("/tmp/unused")
    assert callback.save_before_preemption is False
    with pytest.raises(ValueError, match="save_before_preemption must be True or False"):
        keras.callbacks.BackupAndRestore("/tmp/unused", save_before_preemption="yes")
