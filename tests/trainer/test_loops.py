"""`fit` / `evaluate` / `predict` under MirroredStrategy (and CentralStorageStrategy) equal one device.

Every case trains the same model from the same initial weights with and
without the strategy on the same global batches, for 1 to 4 replicas and for
even, uneven, partial and smaller-than-replica-count batches. The
CentralStorageStrategy cases share Mirrored's replica steps, with the
variables and their update on the parameter device.
"""

import keras
import numpy as np
import pytest

import keras_strategies as ks

TOL = dict(rtol=1e-5, atol=1e-5)


def dense_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L1L2(1e-4, 1e-3)),
        ]
    )
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05, momentum=0.5), metrics=["mae"])
    return model


def conv_model():
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(0.01),
        metrics=["accuracy"],
    )
    return model


def regression_data(n):
    rng = np.random.default_rng(n)
    x = rng.uniform(size=(n, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def image_data(n):
    rng = np.random.default_rng(n)
    return rng.normal(size=(n, 6, 6, 2)).astype("float32"), rng.integers(0, 3, size=(n,))


def make_strategy(name, replicas, cross_device_ops=None):
    """A `name` ("mirrored" or "central storage") strategy over the first `replicas` CPU devices."""
    devices = [f"cpu:{i}" for i in range(replicas)]
    if name == "central storage":
        assert cross_device_ops is None
        return ks.CentralStorageStrategy(devices)
    return ks.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)


def assert_same_fit(build, x, y, batch_size, replicas, epochs=2, cross_device_ops=None, strategy="mirrored",
                    **fit_kwargs):
    """`fit` of `build()` on `replicas` devices equals one device (logs and weights); returns `(model, reference)`."""
    reference = build()
    strategy = make_strategy(strategy, replicas, cross_device_ops)
    with strategy.scope():
        model = build()
    model.set_weights(reference.get_weights())
    kwargs = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    expected, got = reference.fit(x, y, **kwargs).history, model.fit(x, y, **kwargs).history
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
    for got_w, expected_w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_w, expected_w, **TOL)
    return model, reference


def assert_same_training(build, x, y, batch_size, replicas, epochs=2, cross_device_ops=None, strategy="mirrored",
                         **fit_kwargs):
    """`fit`, then `evaluate` and `predict`, equal one device."""
    model, reference = assert_same_fit(build, x, y, batch_size, replicas, epochs, cross_device_ops, strategy,
                                       **fit_kwargs)
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=batch_size, verbose=0),
        reference.evaluate(x, y, batch_size=batch_size, verbose=0), **TOL,
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=batch_size, verbose=0),
        reference.predict(x, batch_size=batch_size, verbose=0), **TOL,
    )
    return model


@pytest.mark.parametrize(
    "strategy, replicas",
    [("mirrored", 1), ("mirrored", 2), ("mirrored", 3), ("mirrored", 4), ("central storage", 1),
     ("central storage", 3)],
)
@pytest.mark.parametrize(
    "samples, batch_size",
    [(12, 4), (10, 4), (10, 6), (101, 32), (5, 2)],
    ids=["even", "uneven", "partial", "101-by-32", "smaller-than-replicas"],
)
def test_dense_fit_equals_one_device(strategy, replicas, samples, batch_size):
    assert_same_training(dense_model, *regression_data(samples), batch_size, replicas, strategy=strategy)


@pytest.mark.parametrize("strategy, replicas", [("mirrored", 2), ("mirrored", 3), ("central storage", 2)])
def test_conv_fit_with_adam_and_accuracy_equals_one_device(strategy, replicas):
    assert_same_training(conv_model, *image_data(10), batch_size=4, replicas=replicas, strategy=strategy)


def token_data(n):
    rng = np.random.default_rng(3)
    return rng.integers(0, 20, size=(n, 6)).astype("int32"), rng.integers(0, 3, size=(n,))  # batches repeat tokens


def embedding_model(model_class=keras.Sequential):
    model = model_class([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.05), metrics=["accuracy"])
    return model


@pytest.mark.parametrize(
    "replicas, cross_device_ops",
    [(2, None), (3, None), (3, ks.ReductionToOneDevice()), (3, ks.HierarchicalCopyAllReduce()),
     (3, ks.HierarchicalCopyAllReduce(num_packs=0))],
    ids=["2 replicas", "3 replicas", "ReductionToOneDevice", "HierarchicalCopyAllReduce", "unpacked"],
)
def test_an_embedding_trained_with_adam_equals_one_device(replicas, cross_device_ops):
    """On TensorFlow the Embedding's gradient is an IndexedSlices, which Keras' Adam squares slice by slice:
    the replicas' slices must reach it as slices (concatenated), not as their dense sum."""
    assert_same_training(embedding_model, *token_data(11), batch_size=4, replicas=replicas,
                         cross_device_ops=cross_device_ops)


class UnitRows(keras.layers.Layer):
    """Scales each row to unit length: NaN on a row of zeros."""

    def call(self, x):
        return x / keras.ops.sqrt(keras.ops.sum(keras.ops.square(x), axis=-1, keepdims=True))


def unit_rows_model():
    model = keras.Sequential([keras.Input((3,)), UnitRows(), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
    return model


@pytest.mark.parametrize("sample_weight", [False, True], ids=["row mask", "sample weights"])
@pytest.mark.parametrize("replicas", [3, 4])
def test_a_model_that_is_nan_on_a_row_of_zeros_trains_like_one_device(replicas, sample_weight):
    """Padding rows are copies of real rows: weighted 0, a NaN row of zeros would still make the step NaN.

    10 rows in global batches of 4 and a partial one of 2: shards of uneven sizes
    (padded on JAX) and replicas without rows (a padding row on every backend).
    """
    x, y = regression_data(10)
    weights = dict(sample_weight=np.linspace(0.5, 1.5, 10).astype("float32")) if sample_weight else {}
    model = assert_same_training(unit_rows_model, x, y, batch_size=4, replicas=replicas, **weights)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_validation_split_sample_weight_and_class_weight():
    x, y = image_data(12)
    weights = np.linspace(0.5, 1.5, 12).astype("float32")
    assert_same_training(conv_model, x, y, 5, replicas=3, sample_weight=weights, validation_split=0.25)
    assert_same_training(conv_model, x, y, 5, replicas=2, class_weight={0: 1.0, 1: 2.0, 2: 0.5})


def test_seed_snippet_runs_with_datasets_numpy_and_a_replica_scaled_batch():
    tf = __import__("tensorflow") if keras.backend.backend() == "tensorflow" else None
    strategy = ks.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-4))]
        )
        model.compile(loss="mse", optimizer="sgd")
    if tf is not None:
        dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(10)
        assert len(model.fit(dataset, epochs=2, verbose=0).history["loss"]) == 2
        assert np.isfinite(model.evaluate(dataset, verbose=0))
    history = model.fit(np.ones((100, 1)), np.ones((100, 1)), epochs=2, batch_size=10, verbose=0)
    assert len(history.history["loss"]) == 2
    global_batch = 16 * strategy.num_replicas_in_sync
    history = model.fit(np.ones((200, 1)), np.ones((200, 1)), epochs=1, batch_size=global_batch, verbose=0)
    assert history.history["loss"][0] < 1.0


def test_on_batch_methods_equal_one_device():
    x, y = regression_data(7)
    reference = dense_model()
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = dense_model()
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.train_on_batch(x, y), reference.train_on_batch(x, y), **TOL)
    np.testing.assert_allclose(model.test_on_batch(x, y), reference.test_on_batch(x, y), **TOL)
    np.testing.assert_allclose(model.predict_on_batch(x), reference.predict_on_batch(x), **TOL)



def test_inputs_that_do_not_fit_the_model_get_keras_error():
    # On TensorFlow the replicas' traced shards hid the shape from Keras' check: the step failed
    # inside TensorFlow's graph ("Graph execution error") instead.
    x, y = regression_data(8)
    with ks.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = dense_model()
    wide = np.concatenate([x, x], axis=1)
    model.fit(x, y, verbose=0)  # built and traced: only the step itself sees the next inputs
    for call in (lambda: model.fit(wide, y, verbose=0), lambda: model.evaluate(wide, y, verbose=0),
                 lambda: model.predict(wide, verbose=0)):
        with pytest.raises(ValueError, match=r"incompatible with the layer: expected (shape=\(None, 3\)|axis -1 .* value 3)"):
            call()
    model.fit(x, y, verbose=0)  # and the model still trains
    model.predict(x, verbose=0)


def test_an_uncompiled_model_predicts_and_asks_for_compile_elsewhere():
    # `predict` needs no `compile` in Keras; it failed under a strategy with "no attribute
    # 'optimizer'", as did `evaluate` (which Keras' torch trainer also lets through unchecked).
    x, _ = regression_data(7)
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), reference.predict(x, verbose=0), **TOL)
    np.testing.assert_allclose(model.predict_on_batch(x), reference.predict_on_batch(x), **TOL)
    for call in (lambda: model.evaluate(x, x[:, :2], verbose=0), lambda: model.fit(x, x[:, :2], verbose=0),
                 lambda: model.train_on_batch(x, x[:, :2]), lambda: model.test_on_batch(x, x[:, :2])):
        with pytest.raises(ValueError, match=r"You must call `compile\(\)`"):
            call()

@pytest.mark.parametrize("strategy", ["mirrored", "central storage"])
def test_per_batch_logs_equal_one_device(strategy):
    """11 samples, batch 4, 2 replicas: the last batch splits [2, 1]."""
    x = np.arange(11, dtype="float32").reshape(11, 1) / 10.0
    y = 2.0 * x + 1.0

    def build():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
        return model

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    reference, expected = build(), Record()
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[expected])
    with make_strategy(strategy, 2).scope():
        model = build()
    got = Record()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[got])
    np.testing.assert_allclose(got.losses, expected.losses, **TOL)


def batch_normalization(synchronized, **kwargs):
    """Keras' layer with `synchronized=True` in a strategy's scope; outside every scope (the
    one-device reference), where Keras refuses the argument off TensorFlow, ks' layer."""
    if synchronized and not ks.has_strategy():
        return ks.layers.SyncBatchNormalization(**kwargs)
    return keras.layers.BatchNormalization(synchronized=synchronized, **kwargs)


def batch_norm_model(synchronized, kernel_size=3, model_class=keras.Model):
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.Conv2D(3, kernel_size, padding="same", use_bias=False)(inputs)
    hidden = batch_normalization(synchronized, momentum=0.5)(hidden)
    hidden = keras.layers.ReLU()(hidden)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(hidden))
    model = model_class(inputs, outputs)
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05))
    return model


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_synchronized_batch_norm_trains_exactly_like_one_device(replicas):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 4, 4, 2)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")
    model = assert_same_training(lambda: batch_norm_model(True), x, y, batch_size=4, replicas=replicas)
    assert model.layers[2].synchronized


def test_synchronized_batch_norm_after_shards_change_size_trains_exactly_like_one_device():
    """Shards of 2, 2, 2 rows, then 2, 1, 1: on TensorFlow the second program failed ("Dimension 0
    in both shapes must be equal"), its replicas making different backward all-reduces."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 4, 4, 2)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")
    assert_same_training(lambda: batch_norm_model(True), x, y, batch_size=6, replicas=3)


def assert_moving_statistics_average_the_replicas(model_class=keras.Model):
    """Unsynchronized BatchNormalization on 2 replicas whose shards are constant: the moving statistics are the means."""
    x = np.concatenate([np.zeros((2, 4, 4, 2)), np.full((2, 4, 4, 2), 4.0)]).astype("float32")
    y = np.zeros((4, 1), "float32")
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = batch_norm_model(False, kernel_size=1, model_class=model_class)
    conv = model.layers[1]
    conv.set_weights([np.ones_like(conv.get_weights()[0])])
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[2]
    # 1x1 conv outputs are constant per replica shard (0 and 8), so each shard's variance is 0
    # and the moving variance is 0.5 * 1 + 0.5 * mean(0, 0) = 0.5 (one device: 0.5 + 0.5 * 16);
    # the moving mean is 0.5 * 0 + 0.5 * mean(0, 8) = 2 (the first replica's alone: 0).
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bn.moving_variance), 0.5, atol=1e-6)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bn.moving_mean), 2.0, atol=1e-6)


def test_unsynchronized_batch_norm_uses_per_replica_statistics():
    """Each replica normalises with its own shard's statistics; moving statistics average them."""
    assert_moving_statistics_average_the_replicas()


def test_sync_batch_normalization_works_outside_strategies_on_every_backend():
    """On one device its statistics are the batch's own, as plain BatchNormalization's."""
    x = np.random.default_rng(0).normal(size=(4, 4, 4, 2)).astype("float32")
    sync, plain = ks.layers.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(sync(x, training=True)),
                               keras.ops.convert_to_numpy(plain(x, training=True)), atol=1e-6)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(sync.moving_variance),
                               keras.ops.convert_to_numpy(plain.moving_variance), atol=1e-6)
    model = batch_norm_model(True)
    assert isinstance(model.layers[2], ks.layers.SyncBatchNormalization) and model.layers[2].synchronized
    model.fit(x, np.zeros((4, 1), "float32"), epochs=1, verbose=0)


class CountingReduction(ks.CrossDeviceOps):
    """A user-defined CrossDeviceOps: sums on the destination device and counts its calls."""

    def __init__(self):
        self.calls = 0

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.calls += 1
        return ks.ReductionToOneDevice().reduce(reduce_op, per_replica_value, destinations)


@pytest.mark.parametrize(
    "make_ops",
    [ks.ReductionToOneDevice, lambda: ks.ReductionToOneDevice(reduce_to_device="cpu:2"),
     ks.HierarchicalCopyAllReduce, lambda: ks.HierarchicalCopyAllReduce(num_packs=2), CountingReduction],
    ids=["to-one-device", "to-cpu2", "hierarchical", "hierarchical-2-packs", "user-defined"],
)
def test_every_cross_device_ops_trains_like_one_device(make_ops):
    x, y = regression_data(10)
    reference = dense_model()
    cross_device_ops = make_ops()
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = dense_model()
    model.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, **TOL)
    if isinstance(cross_device_ops, CountingReduction):
        assert cross_device_ops.calls > 0


class AbsoluteErrorSum(keras.metrics.Metric):
    """A metric whose update subtracts its arguments with `-`, as user metrics often do."""

    def __init__(self, **kwargs):
        super().__init__(name="absolute_error_sum", **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))

    def result(self):
        return keras.ops.convert_to_tensor(self.total)


def test_a_metric_gets_tensors_not_numpy_arrays():
    # Shards are cut as NumPy arrays; on PyTorch `y_true - y_pred` failed for an unshuffled `fit`
    # and for `evaluate` (NumPy array minus torch tensor).
    def build():
        model = dense_model()
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=[AbsoluteErrorSum()])
        return model

    x, y = regression_data(10)
    assert_same_training(build, x, y, batch_size=4, replicas=3)


def test_an_input_without_samples_gets_a_clear_error():
    # Keras' own loops fail deep inside on these (StopIteration, UnboundLocalError, a gradient of
    # a non-scalar), or, on TensorFlow, train on nothing without a word.
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = dense_model()
    x, y = regression_data(4)
    calls = {
        "fit": lambda: model.fit(x[:0], y[:0], verbose=0),
        "evaluate": lambda: model.evaluate(x[:0], y[:0], verbose=0),
        "predict": lambda: model.predict(x[:0], verbose=0),
        "train_on_batch": lambda: model.train_on_batch(x[:0], y[:0]),
        "test_on_batch": lambda: model.test_on_batch(x[:0], y[:0]),
        "predict_on_batch": lambda: model.predict_on_batch(x[:0]),
    }
    for method, call in calls.items():
        with pytest.raises(ValueError, match=f"`{method}` got an? .*0 samples|`{method}` got an input without any samples"):
            call()
    import tensorflow as tf

    unknown_and_empty = tf.data.Dataset.from_tensor_slices(x).filter(lambda row: False).batch(2)
    with pytest.raises(ValueError, match="`predict` read no batch from its input"):
        model.predict(unknown_and_empty, verbose=0)
    assert model.predict(x, verbose=0).shape == (4, 1)  # and the model still works
