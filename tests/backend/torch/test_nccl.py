"""PyTorch sums between GPUs with `torch.cuda.nccl`: for `ks.NcclAllReduce` and for the all-reduce
of replicas that each have their own GPU. The GPU tests look for NCCL's all-reduce kernels in a
profile of what ran."""

import keras
import numpy as np
import pytest
import torch
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.backend.torch import nccl


def test_only_tensors_one_per_gpu_go_to_nccl():
    # The replicas' all-reduce on CPU devices adds copies, as before.
    assert not nccl.one_per_gpu([torch.ones(3), torch.ones(3)])
    assert not nccl.one_per_gpu([torch.ones(3)])


def nccl_all_reduce_kernels(run):
    """The names of the NCCL all-reduce kernels that ran on the GPUs during `run()`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run()
        torch.cuda.synchronize()
    names = [event.name for event in profiler.events()]
    assert any(event.device_type.name == "CUDA" for event in profiler.events()), "the profile holds no GPU kernels"
    return [name for name in names if "nccl" in name.lower() and "allreduce" in name.lower().replace("_", "")]


@pytest.mark.gpu
def test_nccl_all_reduce_runs_nccls_kernels_on_two_gpus(gpus):
    parts = [torch.arange(6, dtype=torch.float32) * (i + 1) for i in range(2)]
    value = ks.PerReplica([engine.devices.copy_to(p, d) for p, d in zip(parts, gpus)])
    results = []
    kernels = nccl_all_reduce_kernels(lambda: results.append(ks.NcclAllReduce().reduce("sum", value, gpus[1])))
    assert kernels
    np.testing.assert_allclose(ops.convert_to_numpy(results[0]), (parts[0] + parts[1]).numpy())
    assert engine.devices.device_of(results[0]) == gpus[1]


@pytest.mark.gpu
def test_replicas_on_two_gpus_all_reduce_with_nccl(gpus):
    strategy = ks.MirroredStrategy(gpus)

    def replica_fn():
        context = ks.get_replica_context()
        return context.all_reduce("sum", torch.full((4,), float(context.replica_id_in_sync_group + 1)))

    results = []
    assert nccl_all_reduce_kernels(lambda: results.append(strategy.run(replica_fn)))
    for value, device in zip(results[0].values, gpus):
        assert engine.devices.device_of(value) == device
        np.testing.assert_allclose(value.cpu().numpy(), np.full((4,), 3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit NcclAllReduce"])
def test_fit_on_two_gpus_sums_gradients_with_nccl(gpus, explicit):
    strategy = ks.MirroredStrategy(gpus, cross_device_ops=ks.NcclAllReduce() if explicit else None)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer="sgd")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    assert nccl_all_reduce_kernels(lambda: model.fit(x, y, batch_size=4, verbose=0))
