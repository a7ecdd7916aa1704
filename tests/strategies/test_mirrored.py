"""`MirroredStrategy` construction, placement and cross-replica primitives."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine

TORCH = keras.backend.backend() == "torch"


def test_defaults_to_every_virtual_cpu_device():
    strategy = ks.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 4
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    assert strategy.cluster_resolver is None


def test_device_subsets_accept_tf_style_names():
    strategy = ks.MirroredStrategy(devices=["/cpu:1", "CPU:3"])
    assert strategy.extended.worker_devices == ("cpu:1", "cpu:3")
    assert strategy.num_replicas_in_sync == 2


def test_primary_variables_live_on_the_first_replica_device():
    strategy = ks.MirroredStrategy(devices=["cpu:2", "cpu:3"])
    with strategy.scope():
        variable = keras.Variable(np.ones((2,), "float32"))
    assert engine.devices.device_of(variable) == ("cpu:0" if TORCH else "cpu:2")
    assert strategy.extended.variable_created_in_scope(variable)


def test_run_gives_replica_ids_and_regroups():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    result = strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group)
    assert isinstance(result, ks.PerReplica) and result.values == (0, 1, 2)
    assert strategy.run(lambda: 3) == 3
    assert strategy.run(lambda: None) is None


def test_run_refuses_arguments_that_are_not_a_tuple():
    # `args=x` for `args=(x,)` failed with "'int' object is not iterable" (or unpacked a value).
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(TypeError, match=r"`args` of `strategy.run` must be a tuple .* got int: pass one argument as `args=\(value,\)`"):
        strategy.run(lambda value: value, args=3)
    with pytest.raises(TypeError, match="`kwargs` of `strategy.run` must be a dict, got list"):
        strategy.run(lambda value: value, kwargs=[3])
    assert strategy.run(lambda value: value, args=[3]) == 3


def test_reduce_sums_or_averages_replica_values_and_uneven_shards_along_an_axis():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    scalars = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(3 + 10 * ctx.replica_id_in_sync_group)
    )
    assert float(ops.convert_to_numpy(strategy.reduce("SUM", scalars, axis=None))) == 39.0
    assert float(ops.convert_to_numpy(strategy.reduce("mean", scalars, axis=None))) == 13.0
    uneven = ks.PerReplica([np.ones((1, 2), "float32"), np.ones((2, 2), "float32"), np.ones((3, 2), "float32")])
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.reduce("sum", uneven, axis=0)), [6.0, 6.0])
    np.testing.assert_allclose(ops.convert_to_numpy(strategy.reduce("mean", uneven, axis=0)), [1.0, 1.0])
    assert tuple(strategy.gather(uneven, axis=0).shape) == (6, 2)


def test_reducing_a_plain_value_with_sum_over_several_replicas_is_refused():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="non-DistributedValues value"):
        strategy.reduce("sum", np.float32(1.0), axis=None)
    assert float(ops.convert_to_numpy(strategy.reduce("mean", np.float32(1.0), axis=None))) == 1.0


def test_all_reduce_all_gather_and_merge_call_inside_run_span_every_replica():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])

    def fn():
        context = ks.get_replica_context()
        value = ops.convert_to_tensor(float(context.replica_id_in_sync_group + 1))
        summed = context.all_reduce("sum", {"a": value, "b": [value * 2]})
        mean = context.all_reduce(ks.ReduceOp.MEAN, value)
        gathered = context.all_gather(ops.reshape(value, (1,)), axis=0)
        merged = context.merge_call(lambda s, v: (ks.in_cross_replica_context(), s.experimental_local_results(v)), args=(value,))
        return summed, mean, gathered, merged

    summed, mean, gathered, merged = strategy.run(fn)
    for i in range(3):
        assert float(ops.convert_to_numpy(summed["a"].values[i])) == 6.0
        assert float(ops.convert_to_numpy(summed["b"][0].values[i])) == 12.0
        assert float(ops.convert_to_numpy(mean.values[i])) == 2.0
        np.testing.assert_allclose(ops.convert_to_numpy(gathered.values[i]), [1.0, 2.0, 3.0])
    in_cross_replica, local = merged
    assert in_cross_replica is True
    assert [float(ops.convert_to_numpy(v)) for v in local] == [1.0, 2.0, 3.0]


def test_an_error_in_one_replica_stops_the_others_and_is_raised():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def fn():
        context = ks.get_replica_context()
        if context.replica_id_in_sync_group == 1:
            raise ValueError("replica 1 failed")
        return context.all_reduce("sum", ops.ones(()))

    with pytest.raises(ValueError, match="replica 1 failed"):
        strategy.run(fn)


def test_metrics_updated_inside_run_aggregate_over_replicas():
    """A Mean fed [1, 1, 1] on replica 0 and [10] on replica 1 reads 3.25, the mean of all four values."""
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        metric = keras.metrics.Mean()
    values = ks.PerReplica([np.ones((3,), "float32"), np.full((1,), 10.0, "float32")])
    strategy.run(lambda v: metric.update_state(v), args=(values,))
    assert float(ops.convert_to_numpy(metric.result())) == pytest.approx(3.25)


def test_all_reduce_is_differentiable():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        w = keras.Variable(1.0)

    def step():
        scale = float(ks.get_replica_context().replica_id_in_sync_group + 1)

        def loss():
            # L_i = (sum_j scale_j * w)^2 = (3w)^2 on every replica.
            return ops.square(ks.get_replica_context().all_reduce("sum", scale * w.value))

        return ks.value_and_grad(loss, [w])[1][0]

    grads = strategy.run(step)
    # The all-reduce's backward pass sums the cotangents of every replica's loss (2 * 3w each):
    # replica i gets 12 * scale_i, and the sum over replicas, 36, is d(L_1 + L_2)/dw.
    assert [float(ops.convert_to_numpy(g)) for g in grads.values] == pytest.approx([12.0, 24.0])


def test_replicas_making_different_collective_calls_fail_instead_of_hanging():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def fn():
        context = ks.get_replica_context()
        if context.replica_id_in_sync_group == 0:
            return context.all_reduce("sum", ops.ones(()))
        return None

    with pytest.raises(RuntimeError, match="different collective calls|merge_call"):
        strategy.run(fn)


def test_a_keras_distribution_and_a_strategy_are_refused_together():
    # On JAX the mix failed inside a jitted step ("Received incompatible devices").
    from keras import distribution

    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    distribution.set_distribution(distribution.DataParallel(devices=["cpu:0", "cpu:1"]))
    try:
        with pytest.raises(RuntimeError, match=r"keras.distribution is set to DataParallel.*set_distribution\(None\)"):
            model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32"), verbose=0)
        with pytest.raises(RuntimeError, match="use one of them"):
            with strategy.scope():
                pass
    finally:
        distribution.set_distribution(None)
    with strategy.scope():  # unset, the strategy works again
        model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32"), verbose=0)
