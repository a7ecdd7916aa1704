"""Distributed values and regrouping of per-replica results."""

import collections

import keras_strategies as ks
from keras_strategies.distribute.values import regroup, select_replica


def test_per_replica_and_mirrored_hold_one_component_per_replica():
    value = ks.PerReplica([1, 2])
    assert isinstance(value, ks.DistributedValues)
    assert value.values == (1, 2)
    assert isinstance(ks.Mirrored([3, 3]), ks.DistributedValues)
    assert "0: 1" in repr(value)


def test_regroup_collapses_identical_python_values_and_none():
    assert regroup([3, 3]) == 3
    assert regroup([None, None]) is None
    grouped = regroup([1, 2])
    assert isinstance(grouped, ks.PerReplica) and grouped.values == (1, 2)


def test_regroup_and_select_replica_keep_nested_structure():
    Pair = collections.namedtuple("Pair", "a b")
    per_replica = [{"x": Pair(1, [10])}, {"x": Pair(2, [10])}]
    grouped = regroup(per_replica)
    assert isinstance(grouped["x"], Pair)
    assert grouped["x"].a.values == (1, 2)
    assert grouped["x"].b == [10]
    assert select_replica(1, grouped) == {"x": Pair(2, [10])}


def test_experimental_local_results_of_plain_and_distributed_values():
    strategy = ks.get_strategy()
    assert strategy.experimental_local_results(5) == (5,)
    assert strategy.experimental_local_results(ks.PerReplica([1, 2])) == (1, 2)
