"""`s/tf.distribute/ks/`: the names of `tf.distribute` and `tf.distribute.experimental` resolve in `ks`,
or raise an `AttributeError` that says keras-strategies does not provide them."""

import pytest

import keras_strategies as ks
from keras_strategies import experimental

# The public names of tf.distribute and tf.distribute.experimental in TensorFlow 2.21.
TF_DISTRIBUTE = [
    "CrossDeviceOps", "DistributedDataset", "DistributedIterator", "DistributedValues", "HierarchicalCopyAllReduce",
    "InputContext", "InputOptions", "InputReplicationMode", "MirroredStrategy", "MultiWorkerMirroredStrategy",
    "NcclAllReduce", "OneDeviceStrategy", "ParameterServerStrategy", "ReduceOp", "ReductionToOneDevice",
    "ReplicaContext", "RunOptions", "Server", "Strategy", "StrategyExtended", "TPUStrategy", "cluster_resolver",
    "coordinator", "experimental", "experimental_set_strategy", "get_replica_context", "get_strategy",
    "has_strategy", "in_cross_replica_context",
]
TF_EXPERIMENTAL = [
    "CentralStorageStrategy", "CollectiveCommunication", "CollectiveHints", "CommunicationImplementation",
    "CommunicationOptions", "MultiWorkerMirroredStrategy", "ParameterServerStrategy", "PreemptionCheckpointHandler",
    "PreemptionWatcher", "TPUStrategy", "TerminationConfig", "ValueContext", "coordinator", "partitioners", "rpc",
]
NOT_PROVIDED = {"CollectiveHints", "PreemptionWatcher", "rpc"}


@pytest.mark.parametrize("module, names", [(ks, TF_DISTRIBUTE), (experimental, TF_EXPERIMENTAL)],
                         ids=["tf.distribute", "tf.distribute.experimental"])
def test_every_tf_distribute_name_resolves_or_says_it_is_not_provided(module, names):
    for name in names:
        if name in NOT_PROVIDED:
            with pytest.raises(AttributeError, match=f"keras-strategies does not provide tf.distribute.*{name}"):
                getattr(module, name)
            assert not hasattr(module, name)
        else:
            assert getattr(module, name) is not None, name


def test_the_experimental_names_are_the_stable_ones():
    # The multi-worker guide: CommunicationOptions(implementation=CommunicationImplementation.RING).
    options = ks.experimental.CommunicationOptions(implementation=ks.experimental.CommunicationImplementation.RING)
    assert isinstance(options, ks.CommunicationOptions)
    assert ks.experimental.CollectiveCommunication is ks.CommunicationImplementation
    assert ks.experimental.MultiWorkerMirroredStrategy is ks.MultiWorkerMirroredStrategy
    assert ks.experimental.ValueContext is ks.ValueContext


def test_other_missing_names_get_python_s_usual_message():
    with pytest.raises(AttributeError, match="module 'keras_strategies' has no attribute 'no_such_name'"):
        ks.no_such_name


def test_distributed_datasets_are_instances_of_ks_distributed_dataset():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    batches = [(list(range(4)),)]
    dataset = strategy.experimental_distribute_dataset(batches)
    from_function = strategy.distribute_datasets_from_function(lambda context: batches)
    assert isinstance(dataset, ks.DistributedDataset) and isinstance(from_function, ks.DistributedDataset)
    assert isinstance(iter(dataset), ks.DistributedIterator) and isinstance(iter(from_function), ks.DistributedIterator)
