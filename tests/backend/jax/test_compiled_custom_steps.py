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

import contextlib
import dataclasses
import warnings

import jax
import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend.jax import replicas
from test_one_program_steps import _count_dispatches  # noqa: E402 - this folder is on the path

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
GLOBAL_BATCH = 16


@contextlib.contextmanager
def _no_warnings(category=Warning):
    """Turns every warning of `category` into an error, except JAX's unreadable cache entries.

    `make test` runs the two JAX suites side by side on one persistent compilation cache: a run
    that reads an entry the other is still writing warns and compiles that program itself.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", category)
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
        yield


def _data(rows=64):
    rng = np.random.default_rng(5)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _model(dropout=0.0, batch_norm=False):
    keras.utils.set_random_seed(2)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=4))
    if batch_norm:  # synchronized: the global batch's statistics, as on one device
        # In a strategy's scope Keras' layer; outside every scope (the one-device run) ks' layer.
        layers.append(keras.layers.BatchNormalization(synchronized=True) if ks.has_strategy()
                      else ks.layers.SyncBatchNormalization())
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def _guide_loop(strategy, epochs=2, dropout=0.0, rows=64, batch_norm=False, keras_loss_mean=False):
    """The guide's loop: a loss metric and a metric of the predictions, Adam; returns what it
    logged, the replica function's Python calls, the final weights, the model and the shapes of
    the last step's per-replica predictions.

    The steps are called outside the strategy's scope, as in the guide: the step finds its
    strategy by its distributed arguments (on one device, plain arrays noted as its dataset's)."""
    with strategy.scope():
        model = _model(dropout, batch_norm)
        optimizer = keras.optimizers.Adam(0.01)
        error = keras.metrics.MeanAbsoluteError()
        mean_loss = keras.metrics.Mean()
    calls = {"replica": 0}
    replicas_in_sync = strategy.num_replicas_in_sync

    def replica_step(x, y):
        calls["replica"] += 1

        def loss_fn():
            predictions = model(x, training=True)
            if keras_loss_mean:  # the shard's own mean (what TensorFlow's guide warns against)
                return keras.losses.MeanSquaredError()(y, predictions) / replicas_in_sync, predictions
            per_example = keras.losses.mean_squared_error(y, predictions)
            return ks.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH), predictions

        (loss, predictions), grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        error.update_state(y, predictions)
        return loss, predictions

    @ks.function
    def train_step(x, y):
        losses, predictions = strategy.run(replica_step, args=(x, y))
        loss = strategy.reduce("sum", losses, axis=None)
        mean_loss.update_state(loss)
        return loss, predictions

    dataset = strategy.make_experimental_numpy_dataset(_data(rows)).batch(GLOBAL_BATCH)
    losses = []
    for _ in range(epochs):
        for x, y in strategy.experimental_distribute_dataset(dataset):
            loss, predictions = train_step(x, y)
            losses.append(float(ops.convert_to_numpy(loss)))
    shapes = [tuple(p.shape) for p in strategy.experimental_local_results(predictions)]
    logged = [float(ops.convert_to_numpy(m.result())) for m in (mean_loss, error)]
    return losses, logged, calls["replica"], [ops.convert_to_numpy(w) for w in model.weights], model, shapes


def _assert_alike(got, expected):
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)  # losses
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)  # logged metrics
    for weight, expected_weight in zip(got[3], expected[3]):
        np.testing.assert_allclose(weight, expected_weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_the_guide_step_is_compiled_once_and_trains_like_one_device(dropout):
    got = _guide_loop(ks.MirroredStrategy(DEVICES), dropout=dropout)
    expected = _guide_loop(ks.OneDeviceStrategy("cpu:0"), dropout=dropout)
    assert len(got[0]) == 8
    # Replica code runs in Python only while the step is traced (twice: once to find the
    # variables it touches, once over them), not once per replica and step.
    assert got[2] <= 2
    assert expected[2] <= 2  # one device: compiled too
    if not dropout:  # replicas draw other random numbers than one device does, as in `fit`
        _assert_alike(got, expected)
    assert np.all(np.isfinite(got[0]))


def test_each_step_is_one_program_and_the_variables_are_read_on_the_first_device(monkeypatch):
    counts = _count_dispatches(monkeypatch)
    model = _guide_loop(ks.MirroredStrategy(DEVICES), epochs=1)[4]
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
    with _no_warnings():  # once
        second = step(values)
    assert float(ops.convert_to_numpy(first)) == float(ops.convert_to_numpy(second)) == 6.0
    assert float(ops.convert_to_numpy(total.value)) == 12.0


def test_a_step_that_iterates_its_dataset_inside_runs_eagerly_and_loses_no_batch():
    # Given no distributed value and called outside every scope, the step is not compiled: its
    # Python code (here `next`) runs once per call, as written.
    strategy = ks.MirroredStrategy(DEVICES[:2])
    dataset = strategy.make_experimental_numpy_dataset(np.arange(12, dtype="float32").reshape(12, 1)).batch(4)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @ks.function
    def step():
        return strategy.reduce("sum", strategy.run(lambda x: ops.sum(x), args=(next(iterator),)), axis=None)

    with _no_warnings():
        sums = [float(ops.convert_to_numpy(step())) for _ in range(3)]
    assert sums == [6.0, 22.0, 38.0]
    with strategy.scope(), pytest.warns(UserWarning, match="cannot be iterated inside a compiled function"):
        # In the strategy's scope it is traced, which refuses to read the dataset, and runs eagerly.
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        assert float(ops.convert_to_numpy(step())) == 6.0


def test_central_storage_steps_run_eagerly_without_a_warning():
    strategy = ks.CentralStorageStrategy(DEVICES[:2])
    step = ks.function(lambda x: strategy.reduce("sum", strategy.run(lambda v: v * 2, args=(x,)), axis=None))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ops.ones(()))
    with _no_warnings():
        assert float(ops.convert_to_numpy(step(values))) == 4.0


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_partial_last_batch_is_padded_into_the_full_batches_program_and_trains_like_one_device(batch_norm, monkeypatch):
    counts = _count_dispatches(monkeypatch)
    # 18 rows: the last global batch (2 rows) gives replicas 1, 1, 0 and 0 rows.
    got = _guide_loop(ks.MirroredStrategy(DEVICES), rows=18, batch_norm=batch_norm)
    assert counts["programs"] == 4  # every step, the partial ones too, one program
    expected = _guide_loop(ks.OneDeviceStrategy("cpu:0"), rows=18, batch_norm=batch_norm)
    assert got[2] <= 2  # no trace for the partial batch
    _assert_alike(got, expected)
    assert got[5] == [(1, 1), (1, 1), (0, 1), (0, 1)]  # per-replica outputs without their padding rows


def test_the_row_masks_travel_once_each_in_a_steps_one_transfer(monkeypatch):
    # 72 rows: four full global batches and a partial one, three epochs. Each step's program
    # takes the replicas' row masks (16 rows); a full batch's and the partial batch's are sent
    # once each, the partial batch's in the one transfer that also sends its padded shards.
    sends = []
    device_put = replicas.jax.device_put

    def recording(values, *args, **kwargs):
        sends.append([np.shape(leaf) for leaf in jax.tree_util.tree_leaves(values) if isinstance(leaf, np.ndarray)])
        return device_put(values, *args, **kwargs)

    monkeypatch.setattr(replicas.jax, "device_put", recording)
    got = _guide_loop(ks.MirroredStrategy(DEVICES), rows=72, epochs=3)
    monkeypatch.undo()
    with_masks = [shapes for shapes in sends if (GLOBAL_BATCH,) in shapes]
    assert [shapes.count((GLOBAL_BATCH,)) for shapes in with_masks] == [1, 1]
    assert sorted(with_masks[-1]) == [(GLOBAL_BATCH,), (GLOBAL_BATCH, 1), (GLOBAL_BATCH, 4)]
    _assert_alike(got, _guide_loop(ks.OneDeviceStrategy("cpu:0"), rows=72, epochs=3))


def test_a_step_whose_loss_reduces_the_rows_itself_runs_its_uneven_batches_eagerly(monkeypatch):
    with pytest.warns(UserWarning, match="a Keras loss reduces the shard's rows itself"):
        got = _guide_loop(ks.MirroredStrategy(DEVICES), epochs=1, rows=37, keras_loss_mean=True)
    assert got[5] == [(2, 1), (1, 1), (1, 1), (1, 1)]
    from keras_strategies.backend import engine

    eager = dataclasses.replace(engine.capabilities, traces_custom_steps=False)
    monkeypatch.setattr(engine, "capabilities", eager)  # every step eager
    _assert_alike(got, _guide_loop(ks.MirroredStrategy(DEVICES), epochs=1, rows=37, keras_loss_mean=True))


def test_steps_without_a_strategy_run_as_written_and_train_like_one_device():
    # The default strategy's dataset elements name it, but without a strategy Keras' own code runs
    # unchanged (an optimizer built at its first update inside a trace would leak traced values):
    # such a step runs eagerly, as written, without a warning.
    with _no_warnings(UserWarning):
        got = _guide_loop(ks.get_strategy(), epochs=1)
    _assert_alike(got, _guide_loop(ks.OneDeviceStrategy("cpu:0"), epochs=1))
