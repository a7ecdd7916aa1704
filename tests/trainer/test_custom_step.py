"""Models overriding `train_step` / `test_step` / `predict_step` under MirroredStrategy (the documented contract)."""

import functools
import warnings

import keras
import numpy as np
import pytest

import keras_strategies as ks
from test_loops import (  # noqa: E402
    TOL,
    assert_moving_statistics_average_the_replicas,
    assert_same_fit,
    assert_same_training,
    batch_norm_model,
    embedding_model,
    regression_data,
    token_data,
)


class CountingModel(keras.Model):
    """Overrides every step and defers to Keras' own (the signature differs per backend)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))
        self.out = keras.layers.Dense(1)
        self.steps = {"train": 0, "test": 0, "predict": 0}

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, *args):
        self.steps["train"] += 1
        return super().train_step(*args)

    def test_step(self, *args):
        self.steps["test"] += 1
        return super().test_step(*args)

    def predict_step(self, *args):
        self.steps["predict"] += 1
        return super().predict_step(*args)


def build():
    model = CountingModel()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05, clipnorm=1.0), metrics=["mae"])
    model(np.zeros((1, 3), "float32"))
    return model


def test_custom_steps_run_per_replica_and_train_exactly_like_one_device():
    x, y = regression_data(10)  # batch 4 on 3 replicas: shards [2, 1, 1], then [1, 1, 0]
    model, reference = assert_same_fit(build, x, y, batch_size=4, replicas=3)
    # 3 batches per epoch: 3 + 3 + 2 replica calls (the last batch leaves replica 2 empty).
    assert model.steps["train"] == 2 * 8
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=4, verbose=0), reference.evaluate(x, y, batch_size=4, verbose=0), **TOL
    )
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), reference.predict(x, batch_size=4, verbose=0), **TOL)
    assert model.steps["test"] == 8 and model.steps["predict"] == 8


class OwnTrainStep(keras.Model):
    """A functional model whose `train_step` is its own (deferring to Keras')."""

    def train_step(self, *args):
        return super().train_step(*args)


def test_a_step_on_shards_of_one_size_is_one_compiled_program_on_jax():
    # Batch 8 on 2 replicas: shards [4, 4] at every step. JAX traces the replica program once
    # (Keras' own JAX trainer traces a model's step once too); the other backends call the
    # step once per replica and step: 2 epochs x 2 batches x 2 replicas.
    x, y = regression_data(16)
    model, _ = assert_same_fit(build, x, y, batch_size=8, replicas=2)
    assert model.steps["train"] == (1 if keras.backend.backend() == "jax" else 8)


class MergingTrainStep(OwnTrainStep):
    """A step that calls `merge_call`: in a compiled JAX replica program every device runs the
    merge function on the replicas' values gathered."""

    def train_step(self, *args):
        ks.get_replica_context().merge_call(lambda strategy: None)
        return super().train_step(*args)


def _compile_warnings_of_fit(model_class):
    """Fits a small `model_class` model on 2 replicas, checked against one device; the warnings
    that its step could not be compiled."""
    x, y = regression_data(16)

    def build():
        inputs = keras.Input((3,))
        model = model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05))
        return model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_fit(build, x, y, batch_size=8, replicas=2)
    return [str(w.message) for w in caught if "could not be compiled" in str(w.message)]


def test_a_step_that_calls_merge_call_trains_like_one_device_without_a_warning():
    assert not _compile_warnings_of_fit(MergingTrainStep)


class PythonValueTrainStep(OwnTrainStep):
    """A step that needs its replica's id as a Python number, which a compiled JAX replica program
    (one trace for every device) does not have."""

    def train_step(self, *args):
        if int(ks.get_replica_context().replica_id_in_sync_group) < 0:
            raise AssertionError("never")
        return super().train_step(*args)


def test_a_step_that_cannot_be_compiled_runs_eagerly_after_one_warning_and_trains_like_one_device():
    compiled_warnings = _compile_warnings_of_fit(PythonValueTrainStep)
    if keras.backend.backend() == "jax":
        assert len(compiled_warnings) == 1, compiled_warnings
        assert "train_step" in compiled_warnings[0] and "Concretization" in compiled_warnings[0], compiled_warnings[0]
    else:  # TensorFlow's and PyTorch's steps run eagerly anyway
        assert not compiled_warnings


@pytest.mark.parametrize("replicas", [2, 3])
def test_synchronized_batch_norm_in_a_custom_train_step_trains_exactly_like_one_device(replicas):
    # Every replica runs the step and computes the same global statistics; the moving
    # statistics move once per step (not once per replica), on every backend.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 4, 4, 2)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")
    assert_same_training(lambda: batch_norm_model(True, model_class=OwnTrainStep), x, y, batch_size=4, replicas=replicas)


def test_unsynchronized_batch_norm_in_a_custom_train_step_averages_the_replicas_moving_statistics():
    assert_moving_statistics_average_the_replicas(OwnTrainStep)


class GlobalSumPenalty(keras.layers.Layer):
    """Adds 0.01 * (sum of its inputs over the whole global batch), summed with `ReplicaContext.all_reduce`."""

    def call(self, inputs):
        replica_context = ks.get_replica_context()
        total = keras.ops.sum(inputs)
        if replica_context is not None:  # None while Keras builds the model in cross-replica context
            total = replica_context.all_reduce("sum", total)
        self.add_loss(0.01 * total)
        return inputs


def test_a_differentiable_all_reduce_in_a_custom_train_step_trains_exactly_like_one_device():
    # Each replica's gradients are weighted by its shard's share afterwards (shards [2, 1, 1],
    # then [1, 1, 0]): the all_reduce's backward pass must weigh the gradients it sums. Only
    # `fit` runs the model's own step; `evaluate` runs Keras', where the replica without rows
    # runs a padding row (weight 0) whose inputs this all_reduce would sum, so it is not compared.
    def build():
        inputs = keras.Input((3,))
        hidden = GlobalSumPenalty()(keras.layers.Dense(4, activation="tanh")(inputs))
        model = OwnTrainStep(inputs, keras.layers.Dense(1)(hidden))
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05))
        return model

    x, y = regression_data(10)
    assert_same_fit(build, x, y, batch_size=4, replicas=3)


class OwnStepEmbedding(keras.Sequential):
    def train_step(self, *args):
        return super().train_step(*args)


def test_an_embedding_in_a_custom_train_step_trains_exactly_like_one_device():
    # TensorFlow: the replicas' IndexedSlices gradients are weighted by their shares as slices.
    build = functools.partial(embedding_model, OwnStepEmbedding)
    assert_same_fit(build, *token_data(11), batch_size=4, replicas=3)


def mean_error(y_true, y_pred):
    """A metric function that returns the batch's mean (a scalar), not one value per sample."""
    return keras.ops.mean(keras.ops.abs(y_true - y_pred))


class GuideTestStep(keras.Model):
    """`test_step` as Keras' guide "Customizing what happens in fit()" writes it (the JAX form takes
    and returns the state): the loss tracker gets `update_state(loss)`, a scalar without weights."""

    def test_step(self, *args):
        if len(args) == 2:  # JAX
            (trainable, non_trainable, metrics_variables), (x, y) = args
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=False)
        else:
            (x, y), metrics_variables = args[0], None
            y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        new_variables, logs = [], {}
        for metric in self.metrics:
            arguments = (loss,) if metric.name == "loss" else (y, y_pred)
            if metrics_variables is None:
                metric.update_state(*arguments)
                logs[metric.name] = metric.result()
                continue
            own = metrics_variables[len(new_variables):len(new_variables) + len(metric.variables)]
            own = metric.stateless_update_state(own, *arguments)
            logs[metric.name] = metric.stateless_result(own)
            new_variables += own
        if metrics_variables is None:
            return logs
        return logs, (trainable, non_trainable, new_variables)


@pytest.mark.parametrize("replicas, batch_size", [(3, 4), (4, 4), (2, 3)])
def test_a_guide_style_test_step_logs_the_loss_of_one_device(replicas, batch_size):
    # Each replica's `update_state(loss)` (and the scalar of `mean_error`) counts with its shard's
    # share: shards [2, 1, 1] then [1, 1, 0] (3 replicas), or batches whose last one leaves
    # replicas idle. Counted once per replica, the loss was the unweighted mean of the replicas'
    # means and a batch weighed as much as its replicas with rows.
    def build():
        inputs = keras.Input((3,))
        model = GuideTestStep(inputs, keras.layers.Dense(1)(inputs))
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae", mean_error])
        return model

    x, y = regression_data(10)
    model, reference = assert_same_fit(build, x, y, batch_size=batch_size, replicas=replicas, validation_data=(x, y))
    expected = reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    got = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert got.keys() == expected.keys() == {"loss", "mae", "mean_error"}
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
