"""`optimizer.apply_gradients` inside `strategy.run`: summed across replicas, clipped after, applied once."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks


def make(strategy, optimizer, value):
    with strategy.scope():
        variable = keras.Variable(np.asarray(value, "float32"))
        optimizer.build([variable])
    return variable


def test_gradients_are_summed_across_replicas_keras_golden_step():
    """Keras' own test: 2 replicas, lr 0.5, grads [1, 6, 7, 2] each: [1, 2, 3, 4] -> [0, -4, -4, 2]."""
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer = keras.optimizers.SGD(0.5)
    variable = make(strategy, optimizer, [1.0, 2.0, 3.0, 4.0])
    strategy.run(lambda: optimizer.apply_gradients([(ops.convert_to_tensor([1.0, 6.0, 7.0, 2.0]), variable)]))
    np.testing.assert_allclose(ops.convert_to_numpy(variable.value), [0.0, -4.0, -4.0, 2.0], rtol=1e-6)
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 1


def test_per_replica_gradients_one_and_two_subtract_three():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer = keras.optimizers.SGD(1.0)
    variable = make(strategy, optimizer, 0.0)

    def step():
        grad = ops.convert_to_tensor(float(ks.get_replica_context().replica_id_in_sync_group + 1))
        optimizer.apply([grad], [variable])

    strategy.run(step)
    assert float(ops.convert_to_numpy(variable.value)) == pytest.approx(-3.0)


@pytest.mark.parametrize(
    "clipping, expected",
    [({"clipnorm": 1.0}, 0.70710677), ({"global_clipnorm": 1.0}, 0.70710677), ({"clipvalue": 1.0}, 1.0)],
)
def test_clipping_happens_after_the_sum(clipping, expected):
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer = keras.optimizers.SGD(1.0, **clipping)
    variable = make(strategy, optimizer, [0.0, 0.0])
    strategy.run(lambda: optimizer.apply_gradients([(ops.convert_to_tensor([100.0, 100.0]), variable)]))
    np.testing.assert_allclose(ops.convert_to_numpy(variable.value), [-expected, -expected], rtol=1e-6)


def test_skip_gradients_aggregation_for_users_who_all_reduce_themselves():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer = keras.optimizers.SGD(1.0)
    variable = make(strategy, optimizer, 0.0)

    def step():
        context = ks.get_replica_context()
        grad = context.all_reduce("mean", ops.convert_to_tensor(float(context.replica_id_in_sync_group + 1)))
        optimizer.apply_gradients([(grad, variable)], skip_gradients_aggregation=True)

    strategy.run(step)
    assert float(ops.convert_to_numpy(variable.value)) == pytest.approx(-1.5)


def test_cross_replica_context_raises_a_clear_runtime_error():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer = keras.optimizers.SGD(1.0)
    variable = make(strategy, optimizer, 0.0)
    with strategy.scope():
        with pytest.raises(RuntimeError, match=r"cannot be called in cross-replica context.*strategy.run"):
            optimizer.apply_gradients([(ops.ones(()), variable)])


def test_outside_strategies_the_optimizer_is_untouched():
    optimizer = keras.optimizers.SGD(1.0)
    variable = keras.Variable(1.0)
    optimizer.apply_gradients([(ops.ones(()), variable)])
    assert float(ops.convert_to_numpy(variable.value)) == 0.0


def test_an_optimizer_with_slots_first_built_inside_a_compiled_step():
    """Adam creates its slots on the first apply, here inside `ks.function` + `strategy.run`."""
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        variable = keras.Variable(np.array([1.0, 2.0], "float32"))
        optimizer = keras.optimizers.Adam(0.1)
    step = ks.function(lambda: strategy.run(lambda: optimizer.apply_gradients([(ops.ones((2,)), variable)])))
    step()
    # Adam's first step moves each weight by about the learning rate, against the gradient's sign.
    np.testing.assert_allclose(ops.convert_to_numpy(variable.value), [0.9, 1.9], rtol=1e-4)
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 1
