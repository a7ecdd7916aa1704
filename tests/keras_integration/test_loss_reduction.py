"""Every Keras loss reduction, and losses of any shape, train like one device on uneven shards.

23 samples in global batches of 11 on 3 replicas: shards of 4, 4 and 3 rows (JAX pads
the last to 4) and a last batch of one row (two replicas run a padding row).
"""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from trainer.test_loops import assert_same_fit

N, BATCH, REPLICAS = 23, 11, 3


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "steps": rng.normal(size=(N, 6, 2)).astype("float32"),
        "step_targets": rng.normal(size=(N, 6, 1)).astype("float32"),
        "step_classes": rng.integers(0, 3, size=(N, 6)),
        "images": rng.normal(size=(N, 4, 4, 1)).astype("float32"),
        "masks": (rng.uniform(size=(N, 4, 4, 1)) > 0.5).astype("float32"),
        "x": rng.normal(size=(N, 4)).astype("float32"),
        "y": rng.normal(size=(N, 1)).astype("float32"),
        "weights": rng.uniform(0.2, 2.0, size=(N,)).astype("float32"),
    }


def _sequence_model(units, loss):
    def build():
        model = keras.Sequential([keras.Input((6, 2)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(units)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model
    return build


def _pixel_model(loss):
    def build():
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.2), loss=loss)
        return model
    return build


def _elementwise_squares(y_true, y_pred):
    return ops.square(y_true - y_pred)  # not reduced over the last axis: (rows, 6, 1)


def _dice(y_true, y_pred):  # one value per row
    overlap = ops.sum(y_true * y_pred, axis=(1, 2, 3))
    return 1 - 2 * overlap / (ops.sum(y_true, axis=(1, 2, 3)) + ops.sum(y_pred, axis=(1, 2, 3)) + 1)


CASES = {
    "per-timestep mse": (_sequence_model(1, "mse"), "steps", "step_targets"),
    "per-timestep sparse crossentropy": (
        _sequence_model(3, keras.losses.SparseCategoricalCrossentropy(from_logits=True)), "steps", "step_classes"),
    "unreduced custom loss": (_sequence_model(1, _elementwise_squares), "steps", "step_targets"),
    # 4x4 pixels on shards of 4 rows: a (rows,) weight would broadcast along the wrong axis.
    "per-pixel crossentropy": (_pixel_model("binary_crossentropy"), "images", "masks"),
    "per-row dice": (_pixel_model(_dice), "images", "masks"),
    "mean_with_sample_weight, no weights": (
        _pixel_model(keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight")), "images", "masks"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_losses_of_any_shape_leave_padding_rows_out(case):
    build, x, y = CASES[case]
    data = _data()
    assert_same_fit(build, data[x], data[y], batch_size=BATCH, replicas=REPLICAS)


def _tagger(reduction, run_eagerly=False):
    """Per-token tags of zero-padded sequences: the outputs carry Keras' mask into the loss."""
    def build():
        model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4, mask_zero=True),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.2), run_eagerly=run_eagerly,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        return model
    return build


def _padded_tokens(seed):
    """Token ids of sequences zero-padded after a random length; the generator, for more draws."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 20, size=(N, 6))
    for row, length in enumerate(rng.integers(1, 7, size=N)):
        tokens[row, length:] = 0
    return rng, tokens


def _masking_tagger():
    """Masked where features are -1: JAX's zero padding rows are not masked, yet not valid either."""
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.Masking(mask_value=-1.0), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_padding_rows_are_no_valid_entries_of_a_masked_loss():
    rng = np.random.default_rng(5)
    features = rng.normal(size=(N, 6, 2)).astype("float32")
    for row, length in enumerate(rng.integers(1, 7, size=N)):
        features[row, length:] = -1.0
    tags = rng.integers(0, 3, size=(N, 6))
    weights = rng.uniform(0.2, 2.0, size=(N, 6)).astype("float32")
    assert_same_fit(_masking_tagger, features, tags, batch_size=BATCH, replicas=REPLICAS, sample_weight=weights)


@pytest.mark.parametrize("reduction, weighted, run_eagerly", [
    ("sum_over_batch_size", False, False), ("sum_over_batch_size", True, False), ("mean_with_sample_weight", True, False),
    # Eager replicas (JAX: threads, whose in-step sums must live on each replica's device).
    ("sum_over_batch_size", True, True),
])
def test_a_masked_loss_divides_by_the_valid_entries_of_the_global_batch(reduction, weighted, run_eagerly):
    # Keras divides a masked mean by the batch's unmasked entries; each replica's own count
    # would weigh its shard wrongly.
    rng, tokens = _padded_tokens(4)
    tags = rng.integers(0, 3, size=(N, 6))
    kwargs = {"sample_weight": rng.uniform(0.2, 2.0, size=(N, 6)).astype("float32")} if weighted else {}
    # Eagerly, JAX compiles every operation per shard shape: 2 replicas (shards of 6 and 5), 1 epoch.
    replicas, epochs = (2, 1) if run_eagerly else (REPLICAS, 2)
    assert_same_fit(_tagger(reduction, run_eagerly), tokens, tags, batch_size=BATCH, replicas=replicas, epochs=epochs,
                    **kwargs)


def test_metrics_of_masked_outputs_leave_the_masked_entries_out():
    # The mask travels with the replicas' predictions to the metrics (by hand: accuracy over the
    # unmasked tokens), in `fit` logs (learning rate 0: the weights stay) and in `evaluate`.
    rng, tokens = _padded_tokens(6)
    tags = rng.integers(0, 3, size=(N, 6))

    def build():
        model = _tagger("sum_over_batch_size")()
        model.compile(optimizer=keras.optimizers.SGD(0.0), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = build()
    with ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(REPLICAS)]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    predicted = np.argmax(reference.predict(tokens, verbose=0), axis=-1)
    expected = float(np.mean((predicted == tags)[tokens != 0]))
    assert expected != pytest.approx(float(np.mean(predicted == tags)), abs=1e-3)
    history = model.fit(tokens, tags, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    assert history["accuracy"][0] == pytest.approx(expected, abs=1e-6)
    got = model.evaluate(tokens, tags, batch_size=BATCH, verbose=0, return_dict=True)
    want = reference.evaluate(tokens, tags, batch_size=BATCH, verbose=0, return_dict=True)
    assert got["accuracy"] == pytest.approx(expected, abs=1e-6)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


class MeanPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.3 * ops.mean(ops.square(inputs)))
        return inputs


def _summed_loss_with_penalty():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), MeanPenalty(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.MeanSquaredError(reduction="sum"))
    return model


def _two_reductions(model_class=keras.Model):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    model = model_class(inputs, {"r": keras.layers.Dense(1, name="r")(hidden),
                                 "c": keras.layers.Dense(1, activation="sigmoid", name="c")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.02),
                  loss={"r": keras.losses.MeanSquaredError(reduction="sum"),
                        "c": keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight")})
    return model


def _mean_loss_with_penalty():
    model = _summed_loss_with_penalty()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("build", [_summed_loss_with_penalty, _mean_loss_with_penalty], ids=["sum", "mean"])
def test_a_data_dependent_add_loss_term_counts_once_also_beside_replicas_without_rows(build):
    # 25 rows in batches of 12: shards of 4 rows, then one row on the first replica only. The
    # others run a padding row, whose `add_loss` term must not count (nor, on JAX, could a
    # padding row of a shard with real rows be told apart from them: see docs/guide/limits.md).
    data = _data(1)
    x, y = np.concatenate([data["x"], data["x"][:2]]), np.concatenate([data["y"], data["y"][:2]])
    assert_same_fit(build, x, y, batch_size=12, replicas=REPLICAS)


@pytest.mark.parametrize("weighted", [False, True], ids=["no weights", "sample weights"])
def test_each_output_keeps_its_own_reduction(weighted):
    # "sum" adds the replicas' sums; "mean_with_sample_weight" divides by the global weight total.
    # Two full batches of 11 (shards of 4, 4, 3): on a partial batch Keras' TensorFlow trainer
    # logs per-output losses differently (docs/guide/limits.md).
    data = {key: value[:22] for key, value in _data(2).items()}
    targets = {"r": data["y"], "c": (data["y"] > 0).astype("float32")}
    kwargs = {"sample_weight": data["weights"]} if weighted else {}
    model, reference = assert_same_fit(_two_reductions, data["x"], targets, batch_size=BATCH, replicas=REPLICAS, **kwargs)
    np.testing.assert_allclose(
        model.evaluate(data["x"], targets, batch_size=BATCH, verbose=0, **kwargs),
        reference.evaluate(data["x"], targets, batch_size=BATCH, verbose=0, **kwargs), rtol=1e-5, atol=1e-5)


class OwnSteps(keras.Model):
    """A functional model with its own `train_step` / `test_step`, run per replica (deferring to Keras')."""

    def train_step(self, *args):
        return super().train_step(*args)

    def test_step(self, *args):
        return super().test_step(*args)


def _two_reductions_own_steps():
    return _two_reductions(OwnSteps)


def test_a_models_own_steps_get_the_same_exact_reductions():
    # The optimizer weighs each replica's gradients by its share; a "sum" loss divided by that
    # share first adds up to the global sum (and so does the logged loss).
    data = {key: value[:22] for key, value in _data(2).items()}
    targets = {"r": data["y"], "c": (data["y"] > 0).astype("float32")}
    # 2 replicas (shards of 6 and 5 rows): JAX runs own steps eagerly, compiling per shard shape.
    model, reference = assert_same_fit(_two_reductions_own_steps, data["x"], targets, batch_size=BATCH,
                                       replicas=2, epochs=1, sample_weight=data["weights"])
    np.testing.assert_allclose(
        model.evaluate(data["x"], targets, batch_size=BATCH, verbose=0, sample_weight=data["weights"]),
        reference.evaluate(data["x"], targets, batch_size=BATCH, verbose=0, sample_weight=data["weights"]),
        rtol=1e-5, atol=1e-5)


EAGER_WARNING = "do not split evenly over"


def _scalar_mse(y_true, y_pred):
    """A loss function that averages over the batch itself (returns a scalar)."""
    return ops.mean(ops.square(y_true - y_pred))


def _scalar_loss_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_scalar_mse)
    return model


def test_a_loss_returning_a_scalar_trains_like_one_device_on_even_shards():
    data = _data()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_WARNING)  # even shards: compiled on every engine
        assert_same_fit(_scalar_loss_model, data["x"][:18], data["y"][:18], batch_size=6, replicas=REPLICAS)


def test_a_loss_returning_a_scalar_trains_like_one_device_on_uneven_shards():
    # Weighted by the shard's share, a scalar loss of each shard is exact when shards have their
    # own sizes. JAX pads uneven shards to one shape for its compiled program, and no weight can
    # leave the padding rows out of a scalar: there such steps run eagerly, on unpadded shards.
    # Every full batch is uneven here (11 rows on 3 replicas), which is worth a word where it is slower.
    data = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, reference = assert_same_fit(_scalar_loss_model, data["x"], data["y"], batch_size=BATCH, replicas=REPLICAS)
    eager_warnings = [w for w in caught if EAGER_WARNING in str(w.message)]
    assert len(eager_warnings) == (1 if engine.capabilities.equal_shards else 0)
    np.testing.assert_allclose(model.evaluate(data["x"], data["y"], batch_size=BATCH, verbose=0),
                               reference.evaluate(data["x"], data["y"], batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6)


def test_a_shuffled_masked_loss_with_per_step_weights_trains_like_one_device():
    # Keras' masked losses scale the sample weights in place; on PyTorch the shuffled batches come
    # from a DataLoader, whose shards must not share one tensor's autograd state.
    rng, tokens = _padded_tokens(8)
    tags = rng.integers(0, 3, size=(N, 6))
    weights = rng.uniform(0.2, 2.0, size=(N, 6)).astype("float32")
    build = _tagger("mean_with_sample_weight")
    reference = build()
    with ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(REPLICAS)]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    histories = []
    for fitted in (reference, model):
        keras.utils.set_random_seed(3)
        histories.append(fitted.fit(tokens, tags, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=True,
                                    verbose=0).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5, atol=1e-5)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
