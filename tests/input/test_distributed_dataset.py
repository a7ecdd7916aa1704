"""Distributed datasets: split invariants, iteration styles, options."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks


def strategy_of(replicas):
    return ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])


def steps(strategy, dataset):
    out = []
    for element in strategy.experimental_distribute_dataset(dataset):
        values = element.values if isinstance(element, ks.PerReplica) else (element,)
        out.append([ops.convert_to_numpy(v).tolist() for v in values])
    return out


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("size, batch, drop", [(10, 4, False), (10, 4, True), (7, 5, False), (4, 4, False), (8, 4, False)])
def test_batches_split_in_order_into_shards_differing_by_at_most_one_row(replicas, size, batch, drop):
    strategy = strategy_of(replicas)
    dataset = strategy.make_experimental_numpy_dataset(np.arange(size)).batch(batch, drop_remainder=drop)
    result = steps(strategy, dataset)
    expected_steps = size // batch if drop else -(-size // batch)
    assert len(result) == expected_steps
    flat = [x for step in result for shard in step for x in shard]
    assert flat == list(range(expected_steps * batch if drop else size))  # order kept, nothing lost
    for step in result:
        assert len(step) == replicas
        sizes = [len(shard) for shard in step]
        assert max(sizes) <= -(-batch // replicas) and max(sizes) - min(sizes) <= 1


def test_a_short_batch_splits_row_by_row_leaving_the_last_replicas_empty():
    assert steps(strategy_of(2), ks.get_strategy().make_experimental_numpy_dataset(np.arange(6)).batch(4)) == [[[0, 1], [2, 3]], [[4], [5]]]
    four = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert steps(four, four.make_experimental_numpy_dataset(np.arange(3)).batch(3)) == [[[0], [1], [2], []]]


def test_an_iterator_gives_every_batch_then_an_empty_optional():
    strategy = strategy_of(2)
    dist = strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset(np.arange(6)).batch(4))
    iterator = iter(dist)
    first = next(iterator)
    assert [ops.convert_to_numpy(v).tolist() for v in first.values] == [[0, 1], [2, 3]]
    second = iterator.get_next_as_optional()
    assert second.has_value()
    assert [ops.convert_to_numpy(v).tolist() for v in second.get_value().values] == [[4], [5]]
    end = iterator.get_next_as_optional()
    assert not end.has_value()
    with pytest.raises(ValueError, match="exhausted"):
        end.get_value()
    assert dist.reduce(0, lambda state, element: state + 1) == 2


@pytest.mark.parametrize("replicas", [1, 2])
def test_element_spec_of_a_distributed_tf_data_dataset(replicas):
    import tensorflow as tf

    strategy = strategy_of(replicas)
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((6, 2), "float32"), np.zeros((6,), "int64"))).batch(4)
    dist = strategy.experimental_distribute_dataset(dataset)
    expected = (tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((None,), tf.int64))  # shards differ in size
    for spec in (dist.element_spec, iter(dist).element_spec):
        if replicas == 1:
            assert spec == expected
        else:
            assert all(isinstance(leaf, ks.PerReplica) and leaf.values == (want,) * replicas for leaf, want in zip(spec, expected))
    per_replica = strategy.distribute_datasets_from_function(lambda context: dataset)
    first = per_replica.element_spec[0]
    assert (first if replicas == 1 else first.values) == (expected[0] if replicas == 1 else (expected[0],) * replicas)
    with pytest.raises(ValueError, match="element_spec is known for a distributed tf.data.Dataset; this one reads a NumpyDataset"):
        strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset(np.arange(4)).batch(2)).element_spec


def test_nested_elements_and_device_placement():
    strategy = strategy_of(2)
    x, y = np.arange(8, dtype="float32").reshape(4, 2), np.arange(4)
    element = next(iter(strategy.experimental_distribute_dataset(
        strategy.make_experimental_numpy_dataset({"x": x, "y": y}).batch(4))))
    assert isinstance(element["x"], ks.PerReplica)
    np.testing.assert_array_equal(ops.convert_to_numpy(element["x"].values[1]), x[2:])
    from keras_strategies.backend import engine

    expected = "cpu:0" if keras.backend.backend() == "torch" else "cpu:1"
    assert engine.devices.device_of(element["x"].values[1]) == expected


def test_distribute_datasets_from_function():
    strategy = strategy_of(3)
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return strategy.make_experimental_numpy_dataset(np.arange(10)).batch(context.get_per_replica_batch_size(6))

    result = [[ops.convert_to_numpy(v).tolist() for v in e.values] for e in strategy.distribute_datasets_from_function(dataset_fn)]
    assert result == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]
    (context,) = contexts
    assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (1, 0, 3)


def test_sources_python_iterables_py_dataset_and_errors():
    strategy = strategy_of(2)
    batches = [np.arange(4), np.arange(4, 6)]
    assert steps(strategy, batches) == [[[0, 1], [2, 3]], [[4], [5]]]
    with pytest.raises(ValueError, match="make_experimental_numpy_dataset"):
        strategy.experimental_distribute_dataset(np.arange(4)).__iter__().get_next()
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        strategy.experimental_distribute_dataset(batches, ks.InputOptions(experimental_replication_mode=ks.InputReplicationMode.PER_REPLICA))


def test_numpy_dataset_transformations():
    dataset = ks.get_strategy().make_experimental_numpy_dataset(np.arange(5))
    assert [int(v) for v in dataset] == [0, 1, 2, 3, 4]
    assert len(dataset.batch(2)) == 3 and len(dataset.batch(2, drop_remainder=True)) == 2
    assert [b.tolist() for b in dataset.batch(2).repeat(2)] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    assert sorted(int(v) for v in dataset.shuffle(5, seed=1)) == [0, 1, 2, 3, 4]


def test_numpy_dataset_reshuffles_at_every_iteration_deterministically():
    dataset = ks.get_strategy().make_experimental_numpy_dataset(np.arange(20)).shuffle(20, seed=3)
    first, second = [int(v) for v in dataset], [int(v) for v in dataset]
    assert sorted(first) == sorted(second) == list(range(20)) and first != second
    again = ks.get_strategy().make_experimental_numpy_dataset(np.arange(20)).shuffle(20, seed=3)
    assert [int(v) for v in again] == first  # the same seed gives every worker the same orders


if keras.backend.backend() == "tensorflow":

    def test_tf_data_rebatching_matches_the_documented_partial_batches():
        import tensorflow as tf

        assert steps(strategy_of(2), tf.data.Dataset.range(6).batch(4)) == [[[0, 1], [2, 3]], [[4], [5]]]
        assert steps(strategy_of(3), tf.data.Dataset.range(8).batch(4))[1] == [[4, 5], [6], [7]]
