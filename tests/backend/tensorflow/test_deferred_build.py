"""TensorFlow: a model with its own `train_step` and no `call` (a GAN) trains under a strategy, as without one.

Keras' own TensorFlow trainer builds a model when its step is first traced, so
Keras' DCGAN example (two sub-models, two optimizers, `tf.GradientTape` in
`train_step`) runs without ever calling the model. Building it from the first
batch's shapes before `fit`, as on JAX and PyTorch, failed with "Unable to
automatically build the model".
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_strategies as ks
from trainer.test_loops import TOL


class GAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        rows = tf.shape(real)[0]
        latent = tf.tanh(real[:, :2])  # "noise" derived from the data, so that runs are comparable
        with tf.GradientTape() as tape:
            logits = tf.concat([self.discriminator(self.generator(latent)), self.discriminator(real)], 0)
            labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
            d_loss = self.bce(labels, logits)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.bce(tf.zeros((rows, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build():
    model = GAN()
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.5))
    return model


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_gan_without_call_trains_like_one_device(replicas):
    real = np.random.default_rng(0).normal(size=(22, 4)).astype("float32") + 2.0  # batches 8, 8, 6
    reference = build()
    with ks.MirroredStrategy([f"cpu:{i}" for i in range(replicas)]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected, got = reference.fit(real, **kwargs).history, model.fit(real, **kwargs).history
    assert got.keys() == expected.keys() == {"d_loss", "g_loss"}
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
    for got_w, expected_w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_w, expected_w, **TOL)


def test_a_model_without_call_and_without_its_own_step_still_fails_clearly():
    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = keras.Model()
        model.compile(loss="mse", optimizer="sgd")
    with pytest.raises(RuntimeError, match="Unable to automatically build the model"):
        model.fit(np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32"), verbose=0)
