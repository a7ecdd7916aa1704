"""Cross-device reductions between replica devices."""

import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.distribute.cross_device_ops import select_cross_device_ops

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def per_replica(values):
    return ks.PerReplica(
        [engine.devices.copy_to(ops.convert_to_tensor(np.asarray(v, "float32")), d) for v, d in zip(values, DEVICES)]
    )


@pytest.mark.parametrize(
    "cross_device_ops",
    [ks.ReductionToOneDevice(), ks.ReductionToOneDevice(reduce_to_device="cpu:2"),
     ks.HierarchicalCopyAllReduce(), ks.HierarchicalCopyAllReduce(num_packs=2)],
    ids=["to-one-device", "to-cpu2", "hierarchical", "hierarchical-2-packs"],
)
def test_reduce_and_batch_reduce_sum_or_average_replica_values_onto_the_destination(cross_device_ops):
    value = per_replica([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_allclose(ops.convert_to_numpy(cross_device_ops.reduce("sum", value, "cpu:0")), [9.0, 12.0])
    np.testing.assert_allclose(ops.convert_to_numpy(cross_device_ops.reduce(ks.ReduceOp.MEAN, value, "cpu:1")), [3.0, 4.0])
    pairs = [(per_replica([[1.0], [2.0], [3.0]]), "cpu:0"), (per_replica([np.eye(2)] * 3), "cpu:0"), (per_replica([5.0, 6.0, 7.0]), "cpu:0")]
    results = cross_device_ops.batch_reduce("sum", pairs)
    np.testing.assert_allclose(ops.convert_to_numpy(results[0]), [6.0])
    np.testing.assert_allclose(ops.convert_to_numpy(results[1]), 3 * np.eye(2))
    np.testing.assert_allclose(ops.convert_to_numpy(results[2]), 18.0)
    assert engine.devices.device_of(results[0]) == engine.devices.device_of(engine.devices.copy_to(results[0], "cpu:0"))


def test_broadcast_puts_one_copy_per_device():
    copies = ks.ReductionToOneDevice().broadcast(np.float32(2.0), DEVICES)
    assert isinstance(copies, ks.Mirrored)
    assert [float(ops.convert_to_numpy(c)) for c in copies.values] == [2.0, 2.0, 2.0]


def test_default_is_reduction_to_one_device_on_cpu():
    assert isinstance(select_cross_device_ops(DEVICES), ks.ReductionToOneDevice)
    assert isinstance(ks.MirroredStrategy(DEVICES).extended._cross_device_ops, ks.ReductionToOneDevice)


def test_cross_device_ops_must_be_a_cross_device_ops():
    with pytest.raises(ValueError, match="cross_device_ops must be a ks.CrossDeviceOps"):
        ks.MirroredStrategy(DEVICES, cross_device_ops="nccl")
