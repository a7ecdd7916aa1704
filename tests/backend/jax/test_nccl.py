"""JAX sums `ks.NcclAllReduce`'s values with one XLA all-reduce over the devices (NCCL on GPUs)."""

import jax
import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.backend.jax import nccl
from keras_strategies.backend.jax.devices import jax_device


def _parts(count):
    return [[np.full((2, 3), i + 1, "float32") for i in range(count)], [np.float16(i) for i in range(count)]]


def assert_sums_with_one_all_reduce(devices):
    parts = _parts(len(devices))
    sums = nccl.all_reduce_sum(parts, devices)
    for value_sums, arrays in zip(sums, parts):
        assert [next(iter(s.devices())) for s in value_sums] == [jax_device(d) for d in devices]
        for total in value_sums:
            assert total.shape == np.shape(arrays[0]) and total.dtype == np.asarray(arrays[0]).dtype
            np.testing.assert_allclose(np.asarray(total), np.sum(arrays, axis=0))
    compiled, _ = nccl.program(devices)
    hlo = compiled.lower(*nccl.split_arrays(parts, devices)).compile().as_text()
    assert "all-reduce" in hlo


def test_the_engine_sums_with_one_xla_all_reduce_over_the_devices():
    # On CPU devices XLA runs the same all-reduce with its CPU collectives.
    assert_sums_with_one_all_reduce(["cpu:0", "cpu:1", "cpu:2"])


@pytest.mark.gpu
def test_the_engine_sums_with_one_xla_all_reduce_over_two_gpus(gpus):
    assert_sums_with_one_all_reduce(gpus)


@pytest.mark.gpu
def test_nccl_all_reduce_and_fit_on_two_gpus_run_the_engines_all_reduce(gpus):
    compiled, _ = nccl.program(gpus)
    compiled.clear_cache()
    parts = [np.arange(4, dtype="float32") * (i + 1) for i in range(2)]
    value = ks.PerReplica([engine.devices.copy_to(jax.numpy.asarray(p), d) for p, d in zip(parts, gpus)])
    summed = ks.NcclAllReduce().reduce("sum", value, gpus[0])
    np.testing.assert_allclose(ops.convert_to_numpy(summed), parts[0] + parts[1])
    assert compiled._cache_size() == 1  # compiled for this one signature, i.e. the sum ran through it

    strategy = ks.MirroredStrategy(gpus, cross_device_ops=ks.NcclAllReduce())
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer="sgd")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    assert compiled._cache_size() > 1  # the gradients' pack too


@pytest.mark.gpu
def test_eager_replicas_on_two_gpus_all_reduce_with_the_engines_all_reduce(gpus):
    # `strategy.run` (custom loops, a model's own `train_step`) runs replicas as eager threads.
    compiled, _ = nccl.program(gpus)
    compiled.clear_cache()
    strategy = ks.MirroredStrategy(gpus)

    def replica_fn():
        context = ks.get_replica_context()
        return context.all_reduce("sum", jax.numpy.full((4,), context.replica_id_in_sync_group + 1.0))

    result = strategy.run(replica_fn)
    for value, device in zip(result.values, gpus):
        assert engine.devices.device_of(value) == device
        np.testing.assert_allclose(np.asarray(value), np.full((4,), 3.0))
    assert compiled._cache_size() == 1
