"""How the writes of replicas in `strategy.run` combine into the primary variables."""

import keras
import numpy as np
from keras import ops

import keras_strategies as ks
from keras_strategies.backend.common.replica_variables import outside_replica_scope, weigh_writes


def value(variable):
    return ops.convert_to_numpy(variable.value)


def test_writes_stay_with_each_replica_and_combine_by_aggregation():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        statistic = keras.Variable(np.zeros(2, "float32"))  # aggregation "none": the mean of the writes
        total = keras.Variable(np.zeros((), "float32"), aggregation="sum")  # metric state: deltas add up
        counter = keras.Variable(0, dtype="int32", trainable=False)  # not float: the first writing replica's value
        untouched = keras.Variable(np.ones(2, "float32"))
    writes = strategy.extended._replica_writes(["cpu:0", "cpu:1", "cpu:2"])
    for replica_id, new in enumerate([3.0, 6.0, None]):
        with writes.scope(replica_id):
            if new is not None:
                statistic.assign(np.full(2, new, "float32"))
                counter.assign(replica_id + 5)
                np.testing.assert_allclose(value(statistic), new)  # the replica reads its own write
            total.assign_add(1.0 + replica_id)
        np.testing.assert_allclose(ops.convert_to_numpy(statistic._value), 0.0)  # primaries untouched
    writes.combine()
    np.testing.assert_allclose(value(statistic), (3.0 + 6.0) / 2)  # the mean of the values written
    np.testing.assert_allclose(value(total), 1.0 + 2.0 + 3.0)
    assert int(value(counter)) == 5
    np.testing.assert_allclose(value(untouched), 1.0)


def test_a_merge_writes_the_primary_and_every_replica_then_reads_it():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        weight = keras.Variable(np.ones(2, "float32"))
    writes = strategy.extended._replica_writes(["cpu:0", "cpu:1"])
    with writes.scope(0):
        with outside_replica_scope():
            weight.assign(np.full(2, 7.0, "float32"))
        np.testing.assert_allclose(value(weight), 7.0)
    with writes.scope(1):
        np.testing.assert_allclose(value(weight), 7.0)
    writes.combine()
    np.testing.assert_allclose(value(weight), 7.0)


def test_one_replica_writes_the_primaries_directly():
    strategy = ks.MirroredStrategy(devices=["cpu:0"])
    with strategy.scope():
        statistic = keras.Variable(np.zeros(2, "float32"))
    writes = strategy.extended._replica_writes(["cpu:0"])
    with writes.scope(0):
        statistic.assign(np.ones(2, "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(statistic._value), 1.0)


def test_a_write_weighed_zero_does_not_count_even_if_it_is_nan():
    # BatchNormalization on an empty shard: its statistics are NaN, and it weighs them 0.
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        statistic = keras.Variable(np.zeros(2, "float32"))
        untouched_by_all = keras.Variable(np.ones(2, "float32"))
    writes = strategy.extended._replica_writes(["cpu:0", "cpu:1"])
    with writes.scope(0):
        statistic.assign(np.full(2, 5.0, "float32"))
    with writes.scope(1):
        statistic.assign(np.full(2, np.nan, "float32"))
        untouched_by_all.assign(np.full(2, np.nan, "float32"))
        weigh_writes([statistic, untouched_by_all], lambda: 0.0)
    writes.combine()
    np.testing.assert_allclose(value(statistic), 5.0)
    np.testing.assert_allclose(value(untouched_by_all), 1.0)  # no write counted: unchanged
