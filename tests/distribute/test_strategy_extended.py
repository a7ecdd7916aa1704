"""`strategy.extended`'s cross-replica helpers, as in tf.distribute: reduce_to, batch_reduce_to, broadcast_to, update."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def _numpy(value):
    return [ops.convert_to_numpy(v) for v in ks.get_strategy().experimental_local_results(value)] \
        if isinstance(value, ks.DistributedValues) else ops.convert_to_numpy(value)


@pytest.fixture
def strategy():
    return ks.MirroredStrategy(devices=DEVICES)


def _per_replica(strategy):
    # Replica i returns [i + 1, 2 (i + 1)].
    return strategy.run(lambda: ops.convert_to_tensor([1.0, 2.0]) * (ks.get_replica_context().replica_id_in_sync_group + 1))


def test_reduce_to_a_device_and_to_a_variable(strategy):
    values = _per_replica(strategy)
    with strategy.scope():
        variable = keras.Variable(np.zeros((2,), "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.extended.reduce_to("sum", values, "cpu:1")), [6.0, 12.0])
    mirrored = strategy.extended.reduce_to(ks.ReduceOp.MEAN, values, variable)
    assert isinstance(mirrored, ks.Mirrored) and len(mirrored.values) == 3
    for copy in mirrored.values:
        np.testing.assert_allclose(ops.convert_to_numpy(copy), [2.0, 4.0])


def test_batch_reduce_to_reduces_each_pair(strategy):
    values = _per_replica(strategy)
    first, second = strategy.extended.batch_reduce_to("sum", [(values, "cpu:0"), (values, ["cpu:1", "cpu:2"])])
    np.testing.assert_allclose(ops.convert_to_numpy(first), [6.0, 12.0])
    assert [ops.convert_to_numpy(copy).tolist() for copy in second.values] == [[6.0, 12.0]] * 2


def test_broadcast_to_copies_a_value_to_each_destination(strategy):
    with strategy.scope():
        variable = keras.Variable(np.zeros((2,), "float32"))
    copies = strategy.extended.broadcast_to(ops.convert_to_tensor([3.0, 4.0]), variable)
    assert [ops.convert_to_numpy(copy).tolist() for copy in copies.values] == [[3.0, 4.0]] * 3


def test_update_runs_the_update_once_with_mirrored_arguments_unwrapped(strategy):
    with strategy.scope():
        variable = keras.Variable(np.ones((2,), "float32"))
    delta = strategy.extended.broadcast_to(ops.convert_to_tensor([0.5, 1.5]), variable)
    strategy.extended.update(variable, lambda var, d: var.assign_add(d), args=(delta,))
    np.testing.assert_allclose(ops.convert_to_numpy(variable.value), [1.5, 2.5])
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.extended.read_var(variable)), [1.5, 2.5])
    assert strategy.extended.value_container(variable) is variable


def test_a_non_distributed_sum_is_refused_and_replica_context_is_refused(strategy):
    with pytest.raises(ValueError, match="cannot be reduced"):
        strategy.extended.reduce_to("sum", ops.ones((2,)), "cpu:0")
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.extended.reduce_to("sum", ops.ones((2,)), "cpu:0"))


def test_colocate_vars_with_works_in_scope_only(strategy):
    with strategy.scope():
        variable = keras.Variable(1.0)
        with strategy.extended.colocate_vars_with(variable):
            slot = keras.Variable(0.0)
    assert strategy.extended.variable_created_in_scope(slot)
    with pytest.raises(RuntimeError, match="inside the strategy's `scope\\(\\)`"):
        with strategy.extended.colocate_vars_with(variable):
            pass
