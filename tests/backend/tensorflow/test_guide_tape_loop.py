"""TensorFlow's custom-training guide, word for word with `ks` for `tf.distribute`.

Its model has no `Input`: it builds on its first call, inside `strategy.run` and
a `tf.function`, under a `tf.GradientTape` whose variables are read after the
forward pass. That trains like one device here as under `tf.distribute`: it equals the same
training written with `tf.GradientTape` alone on one device (`tests/reference_loops.py`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_strategies as ks
from reference_loops import split, train

GLOBAL_BATCH = 8


def guide_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(24, 6, 6, 1)).astype("float32"), rng.integers(0, 3, size=(24,))


def guide_model():
    return keras.Sequential([
        keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3),
    ])


def run_guide(strategy):
    keras.utils.set_random_seed(3)
    images, labels = guide_data()
    with strategy.scope():
        model = guide_model()
        optimizer = keras.optimizers.Adam(0.01)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def compute_loss(labels, predictions, model_losses):
        loss = ks.compute_average_loss(loss_object(labels, predictions), global_batch_size=GLOBAL_BATCH)
        if model_losses:
            loss += ks.scale_regularization_loss(tf.add_n(model_losses))
        return loss

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(ks.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = []
    for _ in range(2):
        losses += [float(distributed_train_step(inputs)) for inputs in dist_dataset]
    return losses, float(train_accuracy.result()), model.get_weights()


def reference_guide():
    """`run_guide` on one device: a `tf.GradientTape` step per batch, the accuracy counted by hand.
    The same seed gives the model the same initial weights."""
    keras.utils.set_random_seed(3)
    model = guide_model()
    model.build((None, 6, 6, 1))
    correct = []

    def loss_fn(batch, logits, model_losses):
        labels = tf.cast(batch[1], "int32")
        correct.extend((np.argmax(logits.numpy(), axis=-1) == labels.numpy()).tolist())
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return tf.reduce_sum(per_example) / GLOBAL_BATCH + tf.add_n(model_losses)

    losses = train(model, keras.optimizers.Adam(0.01), loss_fn, split(guide_data(), GLOBAL_BATCH, steps=6))
    return losses, float(np.mean(correct)), model.get_weights()


@pytest.mark.parametrize("replicas", [2, 3])
def test_the_guide_with_a_model_built_inside_run_trains_like_one_device(replicas):
    expected_losses, expected_accuracy, expected_weights = reference_guide()
    losses, accuracy, weights = run_guide(ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-5)
    assert accuracy == pytest.approx(expected_accuracy)
    assert len(weights) == len(expected_weights)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
