"""`ks.experimental.Checkpoint` / `CheckpointManager` save and restore Keras state on every backend."""

import os

import keras
import numpy as np
import pytest

import keras_strategies as ks


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def _train(model, steps=2):
    x = np.arange(12, dtype="float32").reshape(4, 3) / 10
    for _ in range(steps):
        model.train_on_batch(x, np.ones((4, 2), "float32"))


def test_a_restore_brings_back_weights_and_optimizer_slots_even_before_the_first_step(tmp_path):
    model = _model()
    _train(model)
    checkpoint = ks.experimental.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1") and os.path.exists(path + ".npz")
    saved = [np.array(v) for v in model.optimizer.variables]

    fresh = _model()  # its Adam has no slots yet: the restore builds them
    ks.experimental.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    for expected, actual in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(expected, actual)
    assert [np.array(v).tolist() for v in fresh.optimizer.variables] == [v.tolist() for v in saved]
    _train(model, 1)
    _train(fresh, 1)
    for expected, actual in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(expected, actual, rtol=1e-6)


def test_a_strategy_model_restores_into_every_replica(tmp_path):
    model = _model()
    _train(model)
    ks.experimental.Checkpoint(model=model).write(str(tmp_path / "one"))
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mirrored = _model()
    ks.experimental.Checkpoint(model=mirrored).read(str(tmp_path / "one"))
    x = np.ones((4, 3), "float32")
    np.testing.assert_allclose(mirrored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_the_manager_numbers_keeps_the_newest_and_restores_the_latest(tmp_path):
    model = _model()
    manager = ks.experimental.CheckpointManager(ks.experimental.Checkpoint(model=model), str(tmp_path), max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.restore_or_initialize() is None
    for number in (1, 2, 7):
        model.layers[0].kernel.assign(np.full((3, 2), number, "float32"))
        manager.save(checkpoint_number=number)
    assert manager.checkpoints == [str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-7")]
    assert manager.save() == str(tmp_path / "ckpt-8")
    model.layers[0].kernel.assign(np.zeros((3, 2), "float32"))
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-8")
    assert float(np.asarray(model.layers[0].kernel)[0, 0]) == 7.0


def test_bad_input_gets_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one object"):
        ks.experimental.Checkpoint()
    with pytest.raises(ValueError, match="has no variables"):
        ks.experimental.Checkpoint(model="not a model")
    with pytest.raises(ValueError, match="max_to_keep"):
        ks.experimental.CheckpointManager(ks.experimental.Checkpoint(model=_model()), str(tmp_path), max_to_keep=0)
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        ks.experimental.Checkpoint(model=_model()).read(str(tmp_path / "missing"))
    small = _model()
    ks.experimental.Checkpoint(model=small).write(str(tmp_path / "small"))
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="holds 2 variable"):
        ks.experimental.Checkpoint(model=other).read(str(tmp_path / "small"))
