"""`ks.NcclAllReduce`: chosen by default between GPUs, refused elsewhere, and exact on 2 GPUs.

The tests marked `gpu` need 2 GPUs visible to the backend (`make test-gpu`);
elsewhere they skip with the reason. How each engine's NCCL is checked to run
is in `tests/backend/<name>/test_nccl.py`.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.distribute.cross_device_ops import select_cross_device_ops

CPUS = ["cpu:0", "cpu:1", "cpu:2"]


# --- what needs no GPU -----------------------------------------------------------------------
def test_nccl_is_the_default_between_several_gpus_only():
    assert isinstance(select_cross_device_ops(["gpu:0", "gpu:1"]), ks.NcclAllReduce)
    assert isinstance(select_cross_device_ops(["gpu:0", "gpu:1", "gpu:2", "gpu:3"]), ks.NcclAllReduce)
    assert isinstance(select_cross_device_ops(["gpu:0"]), ks.ReductionToOneDevice)
    assert isinstance(select_cross_device_ops(["gpu:0", "cpu:0"]), ks.ReductionToOneDevice)
    assert isinstance(select_cross_device_ops(CPUS), ks.ReductionToOneDevice)


def _on_cpus(values):
    return ks.PerReplica([engine.devices.copy_to(ops.convert_to_tensor(np.asarray(v, "float32")), d)
                          for v, d in zip(values, CPUS)])


@pytest.mark.parametrize("num_packs", [0, 1])
def test_nccl_refuses_cpu_devices_in_every_reduction(num_packs):
    cross_device_ops = ks.NcclAllReduce(num_packs=num_packs)
    with pytest.raises(ValueError, match=r"NcclAllReduce needs every replica on a GPU, but \['cpu:0'"):
        cross_device_ops.reduce("sum", _on_cpus([1.0, 2.0, 3.0]), "cpu:0")
    pairs = [(_on_cpus([[1.0], [2.0], [3.0]]), "cpu:0"), (_on_cpus([[4.0], [5.0], [6.0]]), "cpu:0")]
    with pytest.raises(ValueError, match="ks.ReductionToOneDevice"):
        cross_device_ops.batch_reduce("mean", pairs)


def test_fit_with_nccl_on_cpu_devices_fails_with_the_clear_error():
    strategy = ks.MirroredStrategy(CPUS[:2], cross_device_ops=ks.NcclAllReduce())
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    with pytest.raises(ValueError, match="NcclAllReduce needs every replica on a GPU"):
        model.fit(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), batch_size=4, verbose=0)


# --- on 2 GPUs -------------------------------------------------------------------------------
def _on_gpus(arrays, gpus):
    return ks.PerReplica([engine.devices.copy_to(ops.convert_to_tensor(a), d) for a, d in zip(arrays, gpus)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("float16", 1e-3)])
@pytest.mark.parametrize("num_packs", [0, 1, 2])
def test_reduce_and_batch_reduce_on_two_gpus_equal_the_host(gpus, dtype, tolerance, num_packs):
    rng = np.random.default_rng(3)
    parts = [[rng.normal(size=shape).astype(dtype) for _ in gpus] for shape in [(5,), (3, 4), (), (2, 2, 2)]]
    cross_device_ops = ks.NcclAllReduce(num_packs=num_packs)
    host_sum = lambda arrays: np.sum(np.stack(arrays).astype("float64"), axis=0)  # noqa: E731
    check = lambda got, expected: np.testing.assert_allclose(  # noqa: E731
        ops.convert_to_numpy(got).astype("float64"), expected, rtol=tolerance, atol=tolerance)

    for destination in gpus:
        summed = cross_device_ops.reduce("sum", _on_gpus(parts[1], gpus), destination)
        assert engine.devices.device_of(summed) == destination
        assert str(ops.convert_to_numpy(summed).dtype) == dtype
        check(summed, host_sum(parts[1]))
        check(cross_device_ops.reduce(ks.ReduceOp.MEAN, _on_gpus(parts[0], gpus), destination),
              host_sum(parts[0]) / len(gpus))
    for reduce_op, scale in [("sum", 1), ("mean", len(gpus))]:
        results = cross_device_ops.batch_reduce(reduce_op, [(_on_gpus(p, gpus), gpus[0]) for p in parts])
        assert len(results) == len(parts)
        for got, arrays in zip(results, parts):
            assert tuple(got.shape) == arrays[0].shape
            check(got, host_sum(arrays) / scale)


def _dense_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05, momentum=0.5), metrics=["mae"])
    return model


def assert_fit_on_gpus_equals_one_device(gpus, cross_device_ops, tolerance):
    rng = np.random.default_rng(7)
    x = rng.uniform(size=(40, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    reference = _dense_model()
    strategy = ks.MirroredStrategy(gpus, cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = _dense_model()
    model.set_weights(reference.get_weights())
    kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected, got = reference.fit(x, y, **kwargs).history, model.fit(x, y, **kwargs).history
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=tolerance, atol=tolerance, err_msg=key)
    for got_w, expected_w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_w, expected_w, rtol=tolerance, atol=tolerance)
    return strategy


@pytest.mark.gpu
def test_the_default_on_two_gpus_is_nccl_and_fit_equals_one_device(gpus):
    strategy = assert_fit_on_gpus_equals_one_device(gpus, None, 1e-5)
    assert isinstance(strategy.extended._cross_device_ops, ks.NcclAllReduce)


@pytest.mark.gpu
@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-5), ("mixed_float16", 1e-4)])
def test_fit_with_nccl_on_two_gpus_equals_one_device(gpus, policy, tolerance):
    keras.config.set_dtype_policy(policy)
    try:
        assert_fit_on_gpus_equals_one_device(gpus, ks.NcclAllReduce(), tolerance)
    finally:
        keras.config.set_dtype_policy("float32")
