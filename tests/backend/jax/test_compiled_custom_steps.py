"""On JAX, `ks.function` compiles a guide-style custom step as one program over the replicas' mesh.

The step is traced over the values of the variables it reads and writes
(`compiler.CustomStepProgram`, driven by `distribute/traced_function.py`):
every device runs its replica inline, the gradient sum is a collective and
each device applies the same update. The guide loop's exactness on every
batch shape is checked in `tests/distribute/test_custom_training_loop.py`;
here: that the step really is compiled, that it trains like one device with
metrics and Dropout, where the variables are afterwards, and which steps run
eagerly instead (with a warning when the step cannot be traced).
"""

import warnings

import jax
import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend.jax import replicas

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
GLOBAL_BATCH = 16


def _data(rows=64):
    rng = np.random.default_rng(5)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _model(dropout=0.0):
    keras.utils.set_random_seed(2)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=4))
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def _guide_loop(strategy, epochs=2, dropout=0.0, rows=64):
    """The guide's loop: a loss metric and a metric of the predictions, Adam; returns what it
    logged, the replica function's Python calls and the final weights."""
    with strategy.scope():
        model = _model(dropout)
        optimizer = keras.optimizers.Adam(0.01)
        error = keras.metrics.MeanAbsoluteError()
        mean_loss = keras.metrics.Mean()
    calls = {"replica": 0}

    def replica_step(x, y):
        calls["replica"] += 1

        def loss_fn():
            predictions = model(x, training=True)
            per_example = keras.losses.mean_squared_error(y, predictions)
            return ks.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH), predictions

        (loss, predictions), grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        error.update_state(y, predictions)
        return loss

    @ks.function
    def train_step(x, y):
        loss = strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None)
        mean_loss.update_state(loss)
        return loss

    dataset = strategy.make_experimental_numpy_dataset(_data(rows)).batch(GLOBAL_BATCH)
    losses = []
    for _ in range(epochs):
        for x, y in strategy.experimental_distribute_dataset(dataset):
            losses.append(float(ops.convert_to_numpy(train_step(x, y))))
    logged = [float(ops.convert_to_numpy(m.result())) for m in (mean_loss, error)]
    return losses, logged, calls["replica"], [ops.convert_to_numpy(w) for w in model.weights], model


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_the_guide_step_is_compiled_once_and_trains_like_one_device(dropout):
    losses, logged, replica_calls, weights, _ = _guide_loop(ks.MirroredStrategy(DEVICES), dropout=dropout)
    expected_losses, expected_logged, eager_calls, expected_weights, _ = _guide_loop(
        ks.OneDeviceStrategy("cpu:0"), dropout=dropout
    )
    assert len(losses) == 8
    # Replica code runs in Python only while the step is traced (twice: once to find the
    # variables it touches, once over them), not once per replica and step.
    assert replica_calls <= 2
    assert eager_calls <= 2  # one device: compiled too
    if not dropout:  # replicas draw other random numbers than one device does, as in `fit`
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logged, expected_logged, rtol=1e-5, atol=1e-6)
        for got, expected in zip(weights, expected_weights):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(losses))


def test_each_step_is_one_program_and_the_variables_are_read_on_the_first_device(monkeypatch):
    counts = {"programs": 0}
    dispatch = replicas.dispatch

    def counted(*args, **kwargs):
        counts["programs"] += 1
        return dispatch(*args, **kwargs)

    monkeypatch.setattr(replicas, "dispatch", counted)
    _, _, _, _, model = _guide_loop(ks.MirroredStrategy(DEVICES), epochs=1)
    assert counts["programs"] == 4  # one per step
    first = replicas.mesh_of(DEVICES).devices.flat[0]
    for variable in model.weights:
        assert variable.value.sharding.device_set == {first}
    # Eager code on committed arrays of the first device meets the variables there.
    committed = jax.device_put(np.ones((2, 4), "float32"), first)
    assert tuple(model(committed).shape) == (2, 1)


def test_a_step_with_python_control_flow_on_values_runs_eagerly_with_a_warning():
    strategy = ks.MirroredStrategy(DEVICES[:2])
    with strategy.scope():
        total = keras.Variable(0.0, aggregation="sum")  # the replicas' additions add up

    def replica_fn(x):
        value = ops.sum(x)
        if float(ops.convert_to_numpy(value)) > 0:  # needs the value in Python
            total.assign_add(value)
        return value

    step = ks.function(lambda x: strategy.reduce("sum", strategy.run(replica_fn, args=(x,)), axis=None))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ops.ones((2,)) * (ctx.replica_id_in_sync_group + 1)
    )
    with pytest.warns(UserWarning, match="ks.function runs this step eagerly: it cannot be traced"):
        first = step(values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        second = step(values)
    assert float(ops.convert_to_numpy(first)) == float(ops.convert_to_numpy(second)) == 6.0
    assert float(ops.convert_to_numpy(total.value)) == 12.0


def test_a_step_that_iterates_its_dataset_inside_runs_eagerly_and_loses_no_batch():
    strategy = ks.MirroredStrategy(DEVICES[:2])
    dataset = strategy.make_experimental_numpy_dataset(np.arange(12, dtype="float32").reshape(12, 1)).batch(4)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @ks.function
    def step():
        return strategy.reduce("sum", strategy.run(lambda x: ops.sum(x), args=(next(iterator),)), axis=None)

    with pytest.warns(UserWarning, match="cannot be iterated inside a compiled function"):
        sums = [float(ops.convert_to_numpy(step())) for _ in range(3)]
    assert sums == [6.0, 22.0, 38.0]


def test_central_storage_steps_run_eagerly_without_a_warning():
    strategy = ks.CentralStorageStrategy(DEVICES[:2])
    step = ks.function(lambda x: strategy.reduce("sum", strategy.run(lambda v: v * 2, args=(x,)), axis=None))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ops.ones(()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(ops.convert_to_numpy(step(values))) == 4.0


def test_uneven_shards_run_eagerly_and_exactly():
    # 18 rows: the last global batch (2 rows) gives replicas 1, 1, 0, 0 rows.
    losses, logged, _, weights, _ = _guide_loop(ks.MirroredStrategy(DEVICES), epochs=1, rows=18)
    expected_losses, expected_logged, _, expected_weights, _ = _guide_loop(ks.OneDeviceStrategy("cpu:0"), epochs=1, rows=18)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logged, expected_logged, rtol=1e-5, atol=1e-6)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
