"""TensorFlow sums between GPUs with its own `tf.distribute.NcclAllReduce`: for `ks.NcclAllReduce`
and for the all-reduce inside a replicated step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.backend.tensorflow import nccl, replicas


def _nccl_op_devices(devices):
    """The devices of the `NcclAllReduce` ops in the traced engine sum of two values over `devices`."""

    def reduce(a, b):
        placed = []
        for value, device in zip((a, b), devices):
            with tf.device("/device:" + device.upper()):
                placed.append(tf.identity(value))
        return nccl.all_reduce_sum([placed], devices)

    spec = tf.TensorSpec([3], tf.float32)
    graph_def = tf.function(reduce).get_concrete_function(spec, spec).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sorted(n.device for n in nodes if n.op == "NcclAllReduce")


def test_the_engine_hands_the_values_to_tensorflows_nccl_all_reduce():
    assert isinstance(nccl.CROSS_DEVICE_OPS, tf.distribute.NcclAllReduce)
    # Traced only: NCCL has no CPU kernel. One NCCL op per device, as between GPUs.
    assert _nccl_op_devices(["cpu:0", "cpu:1"]) == ["/device:CPU:0", "/device:CPU:1"]


def test_replicated_steps_all_reduce_with_nccl_between_gpus_only():
    assert isinstance(replicas.in_step_cross_device_ops(["gpu:0", "gpu:1"]), tf.distribute.NcclAllReduce)
    assert isinstance(replicas.in_step_cross_device_ops(["gpu:0"]), tf.distribute.ReductionToOneDevice)
    assert isinstance(replicas.in_step_cross_device_ops(["cpu:0", "cpu:1"]), tf.distribute.ReductionToOneDevice)


@pytest.fixture
def fresh_program(monkeypatch):
    """The engine's NCCL program, traced anew in this test (its count of traces starts at 0)."""
    program = tf.function(nccl._sums)
    monkeypatch.setattr(nccl, "_program", program)
    return program


@pytest.mark.gpu
def test_nccl_all_reduce_runs_tensorflows_nccl_ops_on_two_gpus(gpus, fresh_program):
    assert _nccl_op_devices(gpus) == ["/device:GPU:0", "/device:GPU:1"]
    parts = [np.arange(6, dtype="float32").reshape(2, 3) * (i + 1) for i in range(2)]
    value = ks.PerReplica([engine.devices.copy_to(tf.constant(p), d) for p, d in zip(parts, gpus)])
    summed = ks.NcclAllReduce().reduce("sum", value, gpus[1])
    np.testing.assert_allclose(ops.convert_to_numpy(summed), parts[0] + parts[1])
    assert engine.devices.device_of(summed) == gpus[1]
    assert fresh_program.experimental_get_tracing_count() == 1  # the sum went through the engine's NCCL program


@pytest.mark.gpu
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit NcclAllReduce"])
def test_fit_on_two_gpus_sums_gradients_with_nccl(gpus, explicit, fresh_program):
    strategy = ks.MirroredStrategy(gpus, cross_device_ops=ks.NcclAllReduce() if explicit else None)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer="sgd")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    if explicit:  # summed on the host by ks.NcclAllReduce: the engine's NCCL program
        assert fresh_program.experimental_get_tracing_count() >= 1
    else:  # summed inside the step by TensorFlow's MirroredStrategy, with its NcclAllReduce
        in_step = replicas._strategies[tuple(gpus)].extended._cross_device_ops
        assert isinstance(in_step, tf.distribute.NcclAllReduce)
