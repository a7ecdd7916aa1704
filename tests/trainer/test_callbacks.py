"""Keras callbacks keep working under `ks.MirroredStrategy`, on every backend.

Each test trains a model built in a 3- or 4-replica `MirroredStrategy` scope
and compares it with the same model trained without any strategy from the same
initial weights on the same (unshuffled) batches: the callback must see and do
the same thing. 20 samples in batches of 6 give batches [6, 6, 6, 2], so the
last batch splits unevenly across 3 replicas ([1, 1, 0]).

Initial weights are fixed NumPy arrays rather than random initialisers, so the
trajectories (and thus the epoch EarlyStopping stops at, the epochs
ModelCheckpoint keeps, when ReduceLROnPlateau fires) are the same on every
backend. With SGD(0.05, momentum=0.5) and the validation data below:

    val_loss per epoch ~ [2.13, 0.63, 0.94, 0.84, 0.86, ...]

it improves at epochs 0 and 1 and not in the next three.

The single-device reference runs eagerly (`run_eagerly=True`), which is the
same arithmetic without compiling Keras' own steps for every new model (about
2 s per model on JAX); the plain run (no callback that changes training) is
computed once and shared.
"""

import contextlib
import functools
import glob
import json
import os
import re

import keras
import numpy as np
import pytest

import keras_strategies as ks

TOL = dict(rtol=1e-5, atol=1e-5)
EPOCHS = 4
BATCH = 6
STEPS = 4  # ceil(20 / 6)
LOG_KEYS = ["loss", "mae", "val_loss", "val_mae"]


# --- models, data and helpers --------------------------------------------------


def initial_weights():
    rng = np.random.default_rng(42)
    return [
        rng.uniform(-0.6, 0.6, (3, 8)).astype("float32"),
        np.full((8,), 0.1, "float32"),
        rng.uniform(-0.6, 0.6, (8, 1)).astype("float32"),
        np.zeros((1,), "float32"),
    ]


def build(eager=False, lr=0.05):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        loss="mse", optimizer=keras.optimizers.SGD(lr, momentum=0.5), metrics=["mae"], run_eagerly=eager
    )
    model.set_weights(initial_weights())
    return model


def forward(weights, x):
    """The model's output computed with NumPy from its weights."""
    kernel1, bias1, kernel2, bias2 = weights
    return np.maximum(x @ kernel1 + bias1, 0.0) @ kernel2 + bias2


def data():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(20, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 2.0).astype("float32")
    x_val = rng.uniform(size=(8, 3)).astype("float32")
    return x, y, (x_val, np.ones((8, 1), "float32"))


def strategy_of(replicas):
    return ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])


def mirrored(replicas=3, **kwargs):
    """The model built and compiled in a `replicas`-replica MirroredStrategy scope."""
    with strategy_of(replicas).scope():
        model = build(**kwargs)
    assert_weights_equal(model.get_weights(), initial_weights())
    return model


def fit(model, callbacks=(), epochs=EPOCHS, verbose=0, **kwargs):
    x, y, validation_data = data()
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=verbose, callbacks=list(callbacks),
        validation_data=validation_data, **kwargs,
    )


def assert_weights_close(got, expected):
    assert len(got) == len(expected)
    for index, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(g, e, err_msg=f"weight {index}", **TOL)


def assert_weights_equal(got, expected):
    assert len(got) == len(expected)
    for index, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=f"weight {index}")


def optimizer_state(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables]


def assert_logs_close(got, expected):
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)


class Recorder(keras.callbacks.Callback):
    """Per epoch: its number, the learning rate at its start, the weights at its end."""

    def __init__(self):
        super().__init__()
        self.epochs, self.learning_rates, self.weights = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)
        self.learning_rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([np.array(w) for w in self.model.get_weights()])


@functools.lru_cache(maxsize=None)
def plain_reference():
    """The single-device run of EPOCHS epochs (computed once): logs, weights per epoch, end state."""
    model = build(eager=True)
    recorder = Recorder()
    history = fit(model, [recorder])
    return dict(
        history=history.history, params=history.params, weights=recorder.weights,
        final=model.get_weights(), optimizer=optimizer_state(model),
    )


# --- History and progress bar ---------------------------------------------------


def test_history_equals_one_device():
    expected = plain_reference()
    model = mirrored()
    history = fit(model)
    assert model.history is history
    assert sorted(history.history) == LOG_KEYS
    assert_logs_close(history.history, expected["history"])
    assert history.epoch == list(range(EPOCHS))
    assert history.params == expected["params"] == {"verbose": 0, "epochs": EPOCHS, "steps": STEPS}
    assert_weights_close(model.get_weights(), expected["final"])


LOSS_RE = re.compile(r"(?<![a-z_])(val_)?loss: ([0-9.e+-]+)")


def printed_epoch_losses(out):
    """Per epoch, the last `loss` and `val_loss` printed (verbose=1 also prints timing-dependent updates)."""
    losses = []
    for section in re.split(r"Epoch \d+/\d+", out)[1:]:
        found = LOSS_RE.findall(section)
        train = [float(value) for prefix, value in found if not prefix]
        val = [float(value) for prefix, value in found if prefix]
        assert train and val, section
        losses.append((train[-1], val[-1]))
    return np.array(losses)


def test_progress_bar_verbose_1_then_2_then_0(capsys):
    """Epochs 1-2 with verbose=1, epochs 3-4 (initial_epoch=2) with verbose=2, then verbose=0."""
    expected = plain_reference()["history"]
    expected_losses = np.array([expected["loss"], expected["val_loss"]]).T
    model = mirrored()
    capsys.readouterr()

    fit(model, epochs=2, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out, out
    assert f"{STEPS}/{STEPS}" in out and "━" in out, out
    # Values are printed with 4 decimals.
    np.testing.assert_allclose(printed_epoch_losses(out), expected_losses[:2], rtol=1e-3, atol=1.5e-4)

    history = fit(model, epochs=4, initial_epoch=2, verbose=2)
    out = capsys.readouterr().out
    assert "Epoch 3/4" in out and "Epoch 4/4" in out and "Epoch 1/4" not in out, out
    assert re.search(rf"^{STEPS}/{STEPS} - .*s/step - loss: ", out, re.M), out
    assert "━" not in out, out
    np.testing.assert_allclose(printed_epoch_losses(out), expected_losses[2:], rtol=1e-3, atol=1.5e-4)
    assert history.epoch == [2, 3]
    assert_logs_close(history.history, {key: values[2:] for key, values in expected.items()})
    assert_weights_close(model.get_weights(), plain_reference()["final"])

    fit(model, epochs=5, initial_epoch=4, verbose=0)
    assert capsys.readouterr().out == ""


# --- EarlyStopping -------------------------------------------------------------


def test_early_stopping_stops_at_the_same_epoch_and_restores_best_weights():
    def run(model):
        stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
        recorder = Recorder()
        history = fit(model, [stopper, recorder], epochs=10)
        return stopper, recorder, history

    reference = build(eager=True)
    expected_stopper, expected_recorder, expected = run(reference)
    model = mirrored()
    stopper, recorder, history = run(model)
    # val_loss improves at epochs 0 and 1 only, so patience 2 stops after epoch 3.
    assert (expected_stopper.stopped_epoch, expected_stopper.best_epoch) == (3, 1)
    assert (stopper.stopped_epoch, stopper.best_epoch) == (3, 1)
    np.testing.assert_allclose(stopper.best, expected_stopper.best, **TOL)
    assert recorder.epochs == expected_recorder.epochs == [0, 1, 2, 3]
    assert history.epoch == [0, 1, 2, 3]
    assert_logs_close(history.history, expected.history)
    # The best (epoch 1) weights are restored exactly, not the last epoch's.
    assert_weights_equal(model.get_weights(), recorder.weights[1])
    assert not np.array_equal(recorder.weights[1][0], recorder.weights[-1][0])
    assert_weights_close(model.get_weights(), reference.get_weights())


# --- ModelCheckpoint -----------------------------------------------------------


def test_checkpointed_weights_round_trip_exactly_across_replica_counts(tmp_path):
    path = str(tmp_path / "ckpt.weights.h5")
    model = mirrored(replicas=4)
    fit(model, [keras.callbacks.ModelCheckpoint(path, save_weights_only=True)], epochs=2)
    assert os.path.exists(path)
    saved_weights, saved_state = model.get_weights(), optimizer_state(model)
    assert_weights_close(saved_weights, plain_reference()["weights"][1])

    def fresh(replicas=None):
        """A new model (in a `replicas`-replica strategy, if given) whose optimizer is built, so its state loads too."""
        strategy = strategy_of(replicas) if replicas else None
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build()
            model.optimizer.build(model.trainable_variables)
        return strategy, model

    def assert_loaded(model):
        assert_weights_equal(model.get_weights(), saved_weights)
        assert_weights_equal(optimizer_state(model), saved_state)
        return model

    # The 4-replica file into a 1-replica model (loaded inside its scope), a 2-replica and a plain one.
    one_replica, one = fresh(replicas=1)
    with one_replica.scope():
        one.load_weights(path)
    assert_loaded(one)
    _, two = fresh(replicas=2)
    two.load_weights(path)
    assert_loaded(two)
    _, plain = fresh()
    plain.load_weights(path)
    assert_loaded(plain)

    # Saved again and reloaded along a chain: 1 replica -> 2 replicas -> plain -> 4 replicas.
    previous = one
    for index, replicas in enumerate([2, None, 4]):
        file = str(tmp_path / f"chain-{index}.weights.h5")
        previous.save_weights(file)
        _, previous = fresh(replicas)
        previous.load_weights(file)
        assert_loaded(previous)

    # The 2-replica model goes on training from the 4-replica checkpoint (weights and momentum)
    # exactly as the single-device run went on.
    expected = plain_reference()
    history = fit(two, epochs=EPOCHS, initial_epoch=2)
    assert_logs_close(history.history, {key: values[2:] for key, values in expected["history"].items()})
    assert_weights_close(two.get_weights(), expected["final"])


def test_full_model_checkpoint_with_save_best_only_on_val_loss(tmp_path):
    def run(model, directory):
        checkpoint = keras.callbacks.ModelCheckpoint(
            str(directory / "best-{epoch:02d}.keras"), monitor="val_loss", save_best_only=True
        )
        recorder = Recorder()
        history = fit(model, [checkpoint, recorder])
        return checkpoint, recorder, history, sorted(os.listdir(directory))

    (tmp_path / "reference").mkdir()
    (tmp_path / "mirrored").mkdir()
    expected_checkpoint, _, expected, expected_files = run(build(eager=True), tmp_path / "reference")
    checkpoint, recorder, history, files = run(mirrored(), tmp_path / "mirrored")
    # val_loss improves at epochs 0 and 1 (file names count from 1), then gets worse.
    assert expected_files == ["best-01.keras", "best-02.keras"]
    assert files == expected_files
    np.testing.assert_allclose(checkpoint.best, expected_checkpoint.best, **TOL)
    assert_logs_close(history.history, expected.history)

    # Loaded outside every scope: a plain compiled Keras model with the best epoch's state.
    assert not ks.has_strategy()
    loaded = keras.models.load_model(str(tmp_path / "mirrored" / "best-02.keras"))
    assert_weights_equal(loaded.get_weights(), recorder.weights[1])
    reference_loaded = keras.models.load_model(str(tmp_path / "reference" / "best-02.keras"))
    assert_weights_close(loaded.get_weights(), reference_loaded.get_weights())
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 2 * STEPS
    assert_weights_close(optimizer_state(loaded), optimizer_state(reference_loaded))
    x = data()[0]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), forward(recorder.weights[1], x), **TOL)


# --- BackupAndRestore ----------------------------------------------------------


class Interrupt(Exception):
    pass


class InterruptAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Interrupt(f"interrupted at epoch {epoch}")


def test_backup_and_restore_resumes_an_interrupted_job(tmp_path):
    backup_dir = str(tmp_path / "backup")
    expected = plain_reference()

    first_recorder = Recorder()
    with pytest.raises(Interrupt):
        fit(mirrored(), [keras.callbacks.BackupAndRestore(backup_dir), first_recorder, InterruptAtEpoch(2)])
    assert first_recorder.epochs == [0, 1, 2]
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 2
    assert not ks.has_strategy()  # the exception left the strategy scope

    # The job restarts: a new strategy and a new model, the same backup_dir.
    model = mirrored()
    recorder = Recorder()
    history = fit(model, [keras.callbacks.BackupAndRestore(backup_dir), recorder])
    assert recorder.epochs == history.epoch == [2, 3]
    assert_logs_close(history.history, {key: values[2:] for key, values in expected["history"].items()})
    assert_weights_close(model.get_weights(), expected["final"])
    assert_weights_close(optimizer_state(model), expected["optimizer"])
    assert not os.path.exists(backup_dir)  # deleted after the completed run


# --- TensorBoard ---------------------------------------------------------------


def event_scalars(event_dir, tag):
    import tensorflow as tf  # the TensorBoard callback itself writes with tf.summary

    values = []
    for path in sorted(glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values.append((event.step, float(tf.make_ndarray(value.tensor))))
    return values


def test_tensorboard_writes_train_and_validation_events(tmp_path):
    log_dir = tmp_path / "logs"
    expected = plain_reference()["history"]
    history = fit(mirrored(), [keras.callbacks.TensorBoard(log_dir=str(log_dir), histogram_freq=1)], epochs=2)
    train_dir, validation_dir = str(log_dir / "train"), str(log_dir / "validation")
    assert glob.glob(os.path.join(train_dir, "events.out.tfevents.*"))
    assert glob.glob(os.path.join(validation_dir, "events.out.tfevents.*"))
    losses = event_scalars(train_dir, "epoch_loss")
    assert [step for step, _ in losses] == [0, 1]
    np.testing.assert_allclose([v for _, v in losses], history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in losses], expected["loss"][:2], **TOL)
    val_losses = event_scalars(validation_dir, "epoch_loss")
    np.testing.assert_allclose([v for _, v in val_losses], expected["val_loss"][:2], **TOL)
    np.testing.assert_allclose([v for _, v in event_scalars(train_dir, "epoch_learning_rate")], [0.05] * 2, rtol=1e-6)


# --- Learning-rate callbacks ---------------------------------------------------


def test_learning_rate_scheduler_equals_one_device():
    def run(model):
        recorder = Recorder()
        scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.08 / (1 + epoch))
        return recorder, fit(model, [scheduler, recorder])

    reference = build(eager=True)
    expected_recorder, expected = run(reference)
    model = mirrored()
    recorder, history = run(model)
    np.testing.assert_allclose(expected_recorder.learning_rates, [0.08, 0.04, 0.08 / 3, 0.02], rtol=1e-6)
    np.testing.assert_allclose(recorder.learning_rates, expected_recorder.learning_rates, rtol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"], recorder.learning_rates, rtol=1e-6)
    assert_logs_close(history.history, expected.history)
    assert_weights_close(model.get_weights(), reference.get_weights())


def test_reduce_lr_on_plateau_equals_one_device():
    def run(model):
        recorder = Recorder()
        reducer = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_lr=0.01)
        return recorder, fit(model, [reducer, recorder], epochs=5)

    reference = build(eager=True)
    expected_recorder, expected = run(reference)
    model = mirrored()
    recorder, history = run(model)
    # val_loss gets worse after epoch 1: the rate halves after epochs 2, 3 and 4 (floored at 0.01).
    np.testing.assert_allclose(expected_recorder.learning_rates, [0.05, 0.05, 0.05, 0.025, 0.0125], rtol=1e-6)
    np.testing.assert_allclose(recorder.learning_rates, expected_recorder.learning_rates, rtol=1e-6)
    # The logged rate is the one the epoch trained with (it is logged before the reduction).
    np.testing.assert_allclose(history.history["learning_rate"], recorder.learning_rates, rtol=1e-6)
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)), 0.01, rtol=1e-6)
    assert_logs_close(history.history, expected.history)
    assert_weights_close(model.get_weights(), reference.get_weights())


# --- Custom callbacks ----------------------------------------------------------


class ReadsModel(keras.callbacks.Callback):
    """Reads `self.model` at each epoch end: its weights (two ways), its logs, and predicts with it."""

    def __init__(self, probe):
        super().__init__()
        self.probe = probe
        self.models, self.logs, self.weights, self.kernels, self.predictions = [], [], [], [], []

    def on_epoch_end(self, epoch, logs=None):
        self.models.append(self.model)
        self.logs.append(dict(logs))
        self.weights.append([np.array(w) for w in self.model.get_weights()])
        self.kernels.append(np.array(keras.ops.convert_to_numpy(self.model.layers[-1].kernel)))
        self.predictions.append(self.model.predict(self.probe, verbose=0))


def test_custom_callback_reads_model_weights_on_epoch_end():
    expected = plain_reference()
    probe = data()[0][:5]
    model = mirrored()
    callback = ReadsModel(probe)
    history = fit(model, [callback])
    assert len(callback.models) == EPOCHS and all(m is model for m in callback.models)
    for epoch in range(EPOCHS):
        assert sorted(callback.logs[epoch]) == LOG_KEYS
        assert_weights_close(callback.weights[epoch], expected["weights"][epoch])
        np.testing.assert_array_equal(callback.kernels[epoch], callback.weights[epoch][2])
        np.testing.assert_allclose(callback.predictions[epoch], forward(callback.weights[epoch], probe), **TOL)
    # The weights read at the last epoch end are the final weights, and predicting inside fit changed nothing.
    assert_weights_equal(model.get_weights(), callback.weights[-1])
    assert_logs_close(history.history, expected["history"])
