"""Our datasets as input to `fit` / `evaluate` / `predict` (`keras_strategies/input/keras_input.py`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_strategies as ks
from keras_strategies.input.keras_input import NumpyBatches

TOL = dict(rtol=1e-5, atol=1e-5)


def dense_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"])
    return model


def regression_data(n):
    rng = np.random.default_rng(n)
    x = rng.uniform(size=(n, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def _assert_same_weights(model, reference):
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, **TOL)


def _reference_and_mirrored(replicas=3):
    reference = dense_model()
    strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = dense_model()
    model.set_weights(reference.get_weights())
    return reference, model, strategy


def test_a_distributed_dataset_trains_evaluates_and_predicts_like_its_source_on_one_device():
    # Keras (and tf-keras) take a tf.distribute.DistributedDataset in fit; `s/tf.distribute/ks/` keeps that.
    x, y = regression_data(22)  # batches of 8: the last one is partial
    reference, model, strategy = _reference_and_mirrored()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    distributed = strategy.experimental_distribute_dataset(dataset)
    expected = reference.fit(dataset, epochs=2, validation_data=dataset, verbose=0).history
    got = model.fit(distributed, epochs=2, validation_data=distributed, verbose=0).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(model.evaluate(distributed, verbose=0), reference.evaluate(dataset, verbose=0), **TOL)
    np.testing.assert_allclose(model.predict(distributed, verbose=0), reference.predict(dataset, verbose=0), **TOL)


@pytest.mark.parametrize("distribute", [False, True], ids=["numpy dataset", "distributed numpy dataset"])
def test_a_shuffled_numpy_dataset_gives_each_epoch_its_next_iteration(distribute):
    # TensorFlow's `make_experimental_numpy_dataset` returns a tf.data.Dataset, which fit reads;
    # ours reads as the dataset iterates in a custom loop: a new order per epoch, in its own order
    # whatever `shuffle` says.
    x, y = regression_data(22)
    reference, model, strategy = _reference_and_mirrored()
    dataset = strategy.make_experimental_numpy_dataset((x, y)).shuffle(64, seed=4).batch(8)
    expected_orders = [list(dataset.iteration(number)) for number in range(2)]
    for epoch_batches in expected_orders:
        for batch_x, batch_y in epoch_batches:
            reference.train_on_batch(batch_x, batch_y)
    data = strategy.experimental_distribute_dataset(dataset) if distribute else dataset
    model.fit(data, epochs=2, shuffle=True, verbose=0)
    _assert_same_weights(model, reference)
    assert dataset.take_iteration() == 2  # one iteration per epoch; the peek that builds the model took none


def test_numpy_batches_rereads_an_unfinished_iteration_and_moves_on_after_the_last_batch():
    x = np.arange(10, dtype="float32")
    dataset = ks.MirroredStrategy(devices=["cpu:0"]).make_experimental_numpy_dataset(x).shuffle(10, seed=1).batch(4)
    batches = NumpyBatches(dataset)
    assert batches.num_batches == 3
    first = batches[0]
    np.testing.assert_array_equal(batches[0], first)  # a peek, then the epoch from its start
    epoch = [batches[0], batches[1], batches[2]]
    np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), x)
    next_epoch = [batches[i] for i in range(3)]
    assert not all(np.array_equal(a, b) for a, b in zip(epoch, next_epoch))
    np.testing.assert_array_equal(np.sort(np.concatenate(next_epoch)), x)
    with pytest.raises(IndexError, match="beyond"):
        batches[3]


def test_a_dataset_of_per_replica_batches_or_of_another_strategy_is_refused_clearly():
    x, y = regression_data(8)
    _, model, strategy = _reference_and_mirrored(2)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    per_replica = strategy.distribute_datasets_from_function(lambda context: dataset)
    with pytest.raises(ValueError, match="per-replica batches, for custom loops"):
        model.fit(per_replica, verbose=0)
    other = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]).experimental_distribute_dataset(dataset)
    with pytest.raises(ValueError, match=r"another strategy \(MirroredStrategy of 3 replicas\)"):
        model.evaluate(other, verbose=0)
    unbatched = strategy.make_experimental_numpy_dataset((x, y))
    with pytest.raises(ValueError, match=r"call `.batch\(global_batch_size\)`"):
        model.predict(unbatched, verbose=0)
