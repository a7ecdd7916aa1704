"""`ks.value_and_grad` and `ks.function`, the same on every backend."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks


def test_value_and_grad_of_keras_variables():
    w, b = keras.Variable(np.array([1.0, 2.0], "float32")), keras.Variable(3.0)
    unused = keras.Variable(5.0)

    def loss():
        return ops.sum(ops.square(w.value)) + 2.0 * b.value

    value, grads = ks.value_and_grad(loss, [w, b, unused])
    assert float(ops.convert_to_numpy(value)) == pytest.approx(11.0)
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]), [2.0, 4.0])
    assert float(ops.convert_to_numpy(grads[1])) == pytest.approx(2.0)
    assert float(ops.convert_to_numpy(grads[2])) == 0.0


def test_value_and_grad_through_a_model_with_aux_and_arguments():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
    x = np.array([[1.0, 2.0]], "float32")

    def loss(inputs, scale=1.0):
        prediction = model(inputs)
        return scale * ops.sum(prediction), prediction

    (value, prediction), (grad,) = ks.value_and_grad(loss, model.trainable_variables, x, scale=2.0)
    assert float(ops.convert_to_numpy(value)) == pytest.approx(6.0)
    np.testing.assert_allclose(ops.convert_to_numpy(prediction), [[3.0]])
    np.testing.assert_allclose(ops.convert_to_numpy(grad), [[2.0], [4.0]])


def test_batch_norm_statistics_are_updated_by_a_gradient_step():
    model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(momentum=0.0)])
    x = np.array([[1.0], [3.0]], "float32")
    ks.value_and_grad(lambda: ops.sum(model(x, training=True)), model.trainable_variables)
    assert float(ops.convert_to_numpy(model.layers[0].moving_mean)[0]) == pytest.approx(2.0)


def test_value_and_grad_needs_variables():
    with pytest.raises(ValueError, match="at least one variable"):
        ks.value_and_grad(lambda: 0.0, [])
    unbuilt = keras.Sequential([keras.layers.Dense(1)])  # the guide's model lists none before its first call
    with pytest.raises(ValueError, match=r"call it once on a batch \(or `model.build\(input_shape\)`\)"):
        ks.value_and_grad(lambda: ops.sum(unbuilt(np.ones((2, 3), "float32"))), unbuilt.trainable_variables)


def test_function_wraps_a_step_that_runs():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    step = ks.function(lambda v: strategy.reduce("sum", strategy.run(lambda t: t * 2, args=(v,)), axis=None))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ops.convert_to_tensor(float(ctx.replica_id_in_sync_group)))
    assert float(ops.convert_to_numpy(step(values))) == pytest.approx(2.0)
