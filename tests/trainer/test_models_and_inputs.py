"""Models, layers and input types under MirroredStrategy train like one device."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from test_loops import TOL, assert_same_fit, assert_same_training, regression_data  # noqa: E402

BACKEND = keras.backend.backend()


def functional_two_inputs():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Concatenate()([keras.layers.Dense(4, name="da")(a), b])
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(hidden))
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
    return model


def dict_data(n):
    rng = np.random.default_rng(7)
    x = {"a": rng.uniform(size=(n, 3)).astype("float32"), "b": rng.uniform(size=(n, 2)).astype("float32")}
    return x, (x["a"].sum(1, keepdims=True) - x["b"][:, :1]).astype("float32")


class PenalisedModel(keras.Model):
    """Subclassed, with a constant and a data-mean `add_loss`."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        hidden = self.hidden(x)
        outputs = self.out(hidden)
        self.add_loss(0.01 * ops.mean(ops.square(hidden)))
        self.add_loss(1e-3 * ops.sum(ops.square(self.out.kernel)))
        return outputs


def penalised_model():
    model = PenalisedModel()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    model(np.zeros((1, 3), "float32"))
    return model


def test_a_functional_model_with_dict_inputs_trains_like_one_device():
    assert_same_training(functional_two_inputs, *dict_data(11), batch_size=4, replicas=3)


def two_output_model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu")(inputs)
    outputs = {"a": keras.layers.Dense(1, activation="sigmoid", name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)}
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": "binary_crossentropy", "b": "mse"},
                  loss_weights={"a": 0.5, "b": 1.0}, metrics={"a": ["accuracy"], "b": ["mae"]})
    return model


def two_output_data(n):
    x, y = regression_data(n)
    return x, {"a": (y > 0.5).astype("float32"), "b": y}


def test_a_model_with_several_outputs_logs_each_outputs_loss_like_one_device():
    x, targets = two_output_data(12)  # 3 batches of 4, on 3 replicas: 2 + 1 + 1 rows
    model, reference = assert_same_fit(two_output_model, x, targets, batch_size=4, replicas=3)
    assert {"a_loss", "b_loss"} <= set(model.history.history)
    # Equal batches: on a partial one, Keras' own TensorFlow trainer logs another value (see below).
    expected = reference.evaluate(x, targets, batch_size=4, return_dict=True, verbose=0)
    got = model.evaluate(x, targets, batch_size=4, return_dict=True, verbose=0)
    assert got.keys() == expected.keys() and got["a_loss"] > 0 and got["b_loss"] > 0
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)


def test_each_outputs_loss_weighs_a_partial_last_batch_by_its_rows():
    """The epoch's `<output>_loss` is the row-weighted mean of the batches' losses.

    Computed by hand: Keras' own TensorFlow trainer logs another value here
    (its relaxed retrace loses the batch size of the last batch).
    """
    x, targets = two_output_data(11)  # batches of 4, 4 and 3 rows
    reference, model = _reference_and_mirrored(two_output_model, 3)
    totals = {"a": 0.0, "b": 0.0}
    for start in range(0, 11, 4):
        rows = slice(start, start + 4)
        batch = {name: target[rows] for name, target in targets.items()}
        predicted = {name: ops.convert_to_numpy(p) for name, p in reference(x[rows]).items()}
        totals["a"] += float(ops.sum(keras.losses.binary_crossentropy(batch["a"], predicted["a"])))
        totals["b"] += float(np.sum(np.mean((predicted["b"] - batch["b"]) ** 2, axis=-1)))
        reference.train_on_batch(x[rows], batch)
    history = model.fit(x, targets, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["a_loss"], [totals["a"] / 11], **TOL)
    np.testing.assert_allclose(history["b_loss"], [totals["b"] / 11], **TOL)
    _assert_same_weights(model, reference)


def _shuffled_input(kind, x, y):
    """fit's input for `kind`; `fit(shuffle=True)` shuffles arrays and a PyDataset's batch order."""
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=4)
    if kind == "PyDataset":
        return dict(x=Batches(x, y, 4))
    if kind == "tf.data":  # reshuffles on every pass: an extra pass would shift every epoch's order
        import tensorflow as tf

        return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=3).batch(4))
    import torch

    torch.manual_seed(5)  # Keras seeds torch on the torch backend only
    rows = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    return dict(x=torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True))


@pytest.mark.parametrize("kind, shuffle", [("arrays", True), ("PyDataset", True), ("DataLoader", True),
                                           ("tf.data", True), ("tf.data", False)],
                         ids=["arrays", "PyDataset", "DataLoader", "tf.data", "tf.data, shuffle=False"])
def test_shuffled_fit_takes_the_same_batches_as_one_device_under_the_same_seed(kind, shuffle):
    # Each path reads the batches as the backend's own trainer does, with no extra pass that would
    # reshuffle (on TensorFlow Keras builds the model without reading a batch; so do we). A tf.data
    # dataset shuffles itself, whatever `shuffle` says, and moves to its next order on each pass.
    from test_loops import dense_model

    x, y = regression_data(22)  # the last batch is partial: its place in the order shows
    reference, model = _reference_and_mirrored(dense_model, 3)
    histories = []
    for fitted in (reference, model):
        keras.utils.set_random_seed(5)
        histories.append(fitted.fit(**_shuffled_input(kind, x, y), epochs=2, shuffle=shuffle, verbose=0).history)
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], **TOL)
    _assert_same_weights(model, reference)


class Autoencoder(keras.Model):
    """Trained by its `add_loss` alone (no targets, no compiled loss); `call` mixes its input with tensors."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = keras.layers.Dense(2), keras.layers.Dense(3)

    def call(self, x):
        reconstruction = self.decode(self.encode(x))
        self.add_loss(ops.mean(ops.square(reconstruction - x)))
        return reconstruction


class AutoencoderWithOwnSteps(Autoencoder):
    def train_step(self, *args):
        return super().train_step(*args)


@pytest.mark.parametrize("model_class", [Autoencoder, AutoencoderWithOwnSteps], ids=["Keras steps", "own steps"])
def test_a_model_trained_by_add_loss_alone_on_inputs_without_targets(model_class):
    def build():
        model = model_class()
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        model(np.zeros((1, 3), "float32"))
        return model

    x, _ = regression_data(13)  # batches of 5 on 3 replicas: uneven shards (2, 2, 1), then (1, 1, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*do not split evenly")  # JAX runs these steps eagerly
        model, reference = assert_same_fit(build, x, None, batch_size=5, replicas=3)
    np.testing.assert_allclose(model.evaluate(x, batch_size=5, verbose=0), reference.evaluate(x, batch_size=5, verbose=0), **TOL)
    np.testing.assert_allclose(model.predict(x, batch_size=5, verbose=0), reference.predict(x, batch_size=5, verbose=0), **TOL)


def test_subclassed_model_with_add_loss_counts_each_term_once():
    # 10 samples with batch 4 on 2 replicas: even shards (2+2, then 1+1).
    assert_same_training(penalised_model, *regression_data(10), batch_size=4, replicas=2)


def test_a_data_mean_add_loss_term_is_exact_on_a_partial_last_batch():
    # 10 samples with batch 6 on 3 replicas: even shards, then a partial batch of 4 (2, 1, 1). JAX
    # pads uneven shards to one shape for its compiled program, and padding rows would enter the
    # data-mean term: that step runs eagerly on unpadded shards, the full ones stay compiled.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*do not split evenly")  # only the last batch is uneven
        assert_same_training(penalised_model, *regression_data(10), batch_size=6, replicas=3)


class OwnLoss(keras.Model):
    """Overrides `compute_loss` with a term over the whole batch it is given."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * ops.mean(ops.abs(y_pred))


def test_an_overridden_compute_loss_trains_like_one_device_on_uneven_shards():
    def build():
        model = OwnLoss()
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), metrics=["mae"])
        model(np.zeros((1, 3), "float32"))
        return model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*do not split evenly")  # JAX runs these steps eagerly
        assert_same_training(build, *regression_data(11), batch_size=4, replicas=3)


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def _reference_and_mirrored(build, replicas):
    reference = build()
    strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = build()
    model.set_weights(reference.get_weights())
    return reference, model


def _assert_same_weights(model, reference):
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, **TOL)


def test_py_dataset_and_generator_inputs():
    from test_loops import dense_model

    x, y = regression_data(10)
    reference, model = _reference_and_mirrored(dense_model, 3)
    expected = reference.fit(Batches(x, y, 4), epochs=2, shuffle=False, verbose=0).history
    got = model.fit(Batches(x, y, 4), epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], expected["loss"], **TOL)
    _assert_same_weights(model, reference)

    def generator():
        while True:
            for start in range(0, 10, 4):
                yield x[start:start + 4], y[start:start + 4]

    expected = reference.fit(generator(), steps_per_epoch=3, epochs=2, verbose=0).history
    got = model.fit(generator(), steps_per_epoch=3, epochs=2, verbose=0).history
    np.testing.assert_allclose(got["loss"], expected["loss"], **TOL)
    _assert_same_weights(model, reference)
    np.testing.assert_allclose(model.predict(Batches(x, y, 4), verbose=0), reference.predict(Batches(x, y, 4), verbose=0), **TOL)


def test_a_py_dataset_read_by_workers_takes_the_batches_of_one_device():
    # With `workers`, a PyDataset's enqueuer keeps its place between iterators: reading a batch to
    # build the model moved it one batch on. Keras' own TensorFlow trainer builds from a spec and
    # reads none (its JAX and PyTorch trainers read one, and so do we there), so on TensorFlow
    # every epoch started one batch late against training without a strategy. (Threads: forking a
    # JAX process for `use_multiprocessing` risks a deadlock, and the enqueuer is the same.)
    from test_loops import dense_model

    x, y = regression_data(10)
    reference, model = _reference_and_mirrored(dense_model, 3)
    batches = lambda: Batches(x, y, 4, workers=2)  # noqa: E731
    expected = reference.fit(batches(), epochs=2, shuffle=False, verbose=0).history
    got = model.fit(batches(), epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], expected["loss"], **TOL)
    _assert_same_weights(model, reference)


if BACKEND == "torch":

    def test_a_torch_data_loader_trains_like_one_device():
        import torch
        from test_loops import dense_model

        x, y = regression_data(10)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=4)
        reference, model = _reference_and_mirrored(dense_model, 3)
        expected = reference.fit(loader, epochs=2, verbose=0).history
        got = model.fit(loader, epochs=2, verbose=0).history
        np.testing.assert_allclose(got["loss"], expected["loss"], **TOL)
        _assert_same_weights(model, reference)

if BACKEND == "tensorflow":

    def test_a_tf_data_dataset_with_a_partial_batch_trains_like_one_device():
        import tensorflow as tf
        from test_loops import dense_model

        x, y = regression_data(10)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        reference, model = _reference_and_mirrored(dense_model, 3)
        expected = reference.fit(dataset, epochs=2, verbose=0).history
        got = model.fit(dataset, epochs=2, verbose=0).history
        np.testing.assert_allclose(got["loss"], expected["loss"], **TOL)
        _assert_same_weights(model, reference)


def test_gradient_accumulation_and_initial_epoch():
    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
        return model

    x, y = regression_data(12)
    model = assert_same_training(build, x, y, batch_size=3, replicas=2, epochs=3, initial_epoch=1)
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 4  # 8 batches / 2 accumulation steps


def test_gradients_are_clipped_after_the_sum_across_replicas():
    """Each replica's gradient is [100, 100]-like; clipnorm=1 must clip the summed gradient."""

    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(loss="mae", optimizer=keras.optimizers.SGD(1.0, clipnorm=1.0))
        return model

    x = np.full((4, 2), 100.0, "float32")
    y = np.full((4, 1), 1.0, "float32")
    model = assert_same_training(build, x, y, batch_size=4, replicas=2, epochs=1)
    np.testing.assert_allclose(model.get_weights()[0].ravel(), [0.70710677, 0.70710677], rtol=1e-6)


def test_an_optimizers_loss_scale_factor_scales_the_loss_as_on_one_device():
    # Keras' step multiplies the loss by `loss_scale_factor` and `apply` divides the gradients by
    # it; the replicas did not scale the loss, so SGD stepped 8 times too short.
    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.01, loss_scale_factor=8.0, global_clipnorm=5.0))
        return model

    x, y = regression_data(10)
    assert_same_training(build, x, y, batch_size=4, replicas=3)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_like_one_device_within_half_float_rounding(policy):
    from test_loops import dense_model

    keras.config.set_dtype_policy(policy)
    try:
        x, y = regression_data(10)
        reference, model = _reference_and_mirrored(dense_model, 2)
        assert model.layers[0].compute_dtype == policy.split("_")[1]
        expected = reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        got = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-2, atol=1e-2)
        for got_w, expected_w in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got_w, expected_w, rtol=1e-2, atol=1e-2)
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_float64_model_trains_like_one_device():
    # TensorFlow refused to multiply the float64 loss by the replicas' float32 shares. (JAX
    # computes in float32 unless `jax_enable_x64` is set, with or without a strategy.)
    from test_loops import dense_model

    keras.config.set_floatx("float64")
    try:
        x, y = (a.astype("float64") for a in regression_data(10))
        model = assert_same_training(dense_model, x, y, batch_size=4, replicas=3)
        expected = "float32" if BACKEND == "jax" else "float64"
        assert {w.dtype for w in model.get_weights()} == {np.dtype(expected)}
    finally:
        keras.config.set_floatx("float32")


def test_dropout_trains_and_inference_matches_one_device():
    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
        return model

    x, y = regression_data(12)
    reference, model = _reference_and_mirrored(build, 3)
    history = model.fit(x, y, batch_size=6, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), **TOL)


def test_validation_and_predict_between_shuffled_fits_keep_the_batches_of_one_device():
    # Keras' own PyTorch trainer reads every loop through a `DataLoader`, whose iterator draws a
    # seed from torch's global generator even unshuffled: validation, `evaluate` and `predict`
    # move the order of every later shuffle. Ours read the same pipeline, so the orders stay equal.
    from test_loops import dense_model

    x, y = regression_data(22)
    reference, model = _reference_and_mirrored(dense_model, 3)
    histories = []
    for fitted in (reference, model):
        keras.utils.set_random_seed(5)
        history = fitted.fit(x, y, batch_size=4, epochs=3, validation_data=(x[:7], y[:7]), verbose=0).history
        fitted.predict(x[:5], batch_size=2, verbose=0)
        fitted.evaluate(x[:5], y[:5], batch_size=2, verbose=0)
        again = fitted.fit(x, y, batch_size=4, epochs=1, shuffle=True, verbose=0).history
        histories.append(history["loss"] + history["val_loss"] + again["loss"])
    np.testing.assert_allclose(histories[1], histories[0], **TOL)
    _assert_same_weights(model, reference)
