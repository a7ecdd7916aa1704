"""Random draws in replicas differ per replica; the generator state stays mirrored (`replica_seeds.py`)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.keras_integration import replica_seeds


def _local(strategy, values):
    return [ops.convert_to_numpy(v) for v in strategy.experimental_local_results(values)]


def test_each_replica_draws_its_own_numbers_and_the_state_advances_as_in_keras():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        generator = keras.random.SeedGenerator(seed=3)
    plain = keras.random.SeedGenerator(seed=3)
    draws = _local(strategy, strategy.run(lambda: keras.random.uniform((6,), seed=generator)))
    np.testing.assert_array_equal(draws[0], ops.convert_to_numpy(keras.random.uniform((6,), seed=plain)))
    assert len({d.tobytes() for d in draws}) == 3, draws
    np.testing.assert_array_equal(ops.convert_to_numpy(generator.state.value), ops.convert_to_numpy(plain.state.value))


def dropout_model():
    # Every row is ones; the zero kernel's SGD update counts, per feature, the rows whose
    # dropout mask kept it (see `_kept_counts`).
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dropout(0.5, seed=5),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
    ])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(1.0))
    return model


def _kept_counts(model, rows):
    """Per feature, how many rows kept it: the kernel is lr * (4 / B) * count after one step from zero."""
    return np.rint(model.get_weights()[0][:, 0] * rows / 4.0)


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_dropout_in_fit_draws_a_different_mask_on_each_replica(run_eagerly):
    # Two rows, one per replica: with one mask repeated on both replicas every feature would be
    # kept by 0 or 2 rows; one device (and here) keeps some features in exactly one row.
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = dropout_model()
    model.run_eagerly = run_eagerly
    model.train_on_batch(np.ones((2, 64), "float32"), np.ones((2, 1), "float32"))
    counts = _kept_counts(model, 2)
    assert set(counts.tolist()) <= {0.0, 1.0, 2.0} and (counts == 1).any(), counts


def test_one_replica_draws_exactly_what_keras_draws():
    reference = dropout_model()
    with ks.MirroredStrategy(devices=["cpu:0"]).scope():
        model = dropout_model()
    x, y = np.ones((8, 64), "float32"), np.ones((8, 1), "float32")
    reference.train_on_batch(x, y)
    model.train_on_batch(x, y)
    np.testing.assert_array_equal(model.get_weights()[0], reference.get_weights()[0])


@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64"])
def test_replica_offsets_wrap_modulo_2_to_the_32(dtype):
    seed = ops.convert_to_tensor(np.array([7, 11], dtype))
    for replica in (0, 1, 5):
        got = ops.convert_to_numpy(replica_seeds.replica_offset(seed, replica)).astype("int64")
        expected_first = (7 + replica * replica_seeds.STRIDE) % 2**32
        assert got[1] == 11
        assert got[0] % 2**32 == expected_first, (dtype, replica, got)
