"""Gradients cross workers in one flat buffer per dtype on JAX, and are applied from it.

XLA's CPU runtime makes one gloo call per operand of an all-reduce, so several
large gradients travel as one buffer, concatenated inside the replica program
and cut back inside the jitted optimizer update.
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_strategies.backend.jax import gradients, optimizer
from keras_strategies.multi_worker import packing


def _model(width, layers=3):
    model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(width) for _ in range(layers)] + [keras.layers.Dense(1)])
    model.build((None, 4))
    return model


def _grads(model, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=v.shape).astype("float32")) for v in model.trainable_variables]


def test_two_or_more_large_gradients_make_one_buffer_per_dtype_and_fewer_stay_as_they_are():
    large = _model(512)  # two 512 x 512 kernels of 1 MiB: each would be one gloo call of its own
    grads = _grads(large, 0)
    assert sum(g.size * 4 >= packing.SEPARATE_BYTES for g in grads) == 2
    (packed,) = gradients.pack_for_exchange(grads)
    np.testing.assert_array_equal(np.asarray(packed), np.concatenate([np.ravel(g) for g in grads]))
    assert gradients.packs_for_exchange(large.trainable_variables)
    # One large gradient goes alone either way, small ones share the exchange's pack: no copy.
    for model in (_model(512, layers=2), _model(8)):
        grads = _grads(model, 0)
        assert [g.shape for g in gradients.pack_for_exchange(grads)] == [g.shape for g in grads]
        assert not gradients.packs_for_exchange(model.trainable_variables)


@pytest.mark.parametrize("width", [8, 512], ids=["small, as they are", "large, packed"])
def test_an_update_from_the_exchanged_layout_equals_the_update_from_the_gradients(width):
    models = [_model(width) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    optimizers = [keras.optimizers.Adam(0.01, clipnorm=1.0) for _ in models]
    for step in range(2):
        grads = _grads(models[0], step)
        optimizer.apply_gradients(optimizers[0], grads, models[0].trainable_variables)
        optimizer.apply_exchanged_gradients(optimizers[1], gradients.pack_for_exchange(grads), models[1].trainable_variables)
    for a, b in zip(models[0].get_weights() + [v.numpy() for v in optimizers[0].variables],
                    models[1].get_weights() + [v.numpy() for v in optimizers[1].variables]):
        np.testing.assert_array_equal(a, b)


def test_buffers_that_do_not_fit_the_variables_are_refused():
    model = _model(512)
    (packed,) = gradients.pack_for_exchange(_grads(model, 0))
    with pytest.raises(RuntimeError, match="do not match the variables' layout"):
        optimizer.apply_exchanged_gradients(keras.optimizers.SGD(), [packed[:-1]], model.trainable_variables)
