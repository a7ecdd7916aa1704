"""PyTorch replicas: one Python thread per replica (see `keras_strategies.backend.common.replica_threads`).

PyTorch has no single-process SPMD program. `all_reduce` exchanges tensors
between the replica threads (one `torch.cuda.nccl` all-reduce when each replica
has its own GPU, copies added otherwise) and is differentiable: its backward
pass all-reduces the incoming gradients the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from keras.src import tree

from keras_strategies.backend.common import partition, replica_threads
from keras_strategies.backend.torch import module_buffers, nccl, vectorized
from keras_strategies.backend.torch.devices import device_scope, torch_device


def batch_leaf(value: Any) -> Any:
    """A leaf of a global batch, ready to be cut into shards: a CPU torch tensor as a NumPy view.

    Slices of one torch tensor share its autograd version counter, and Keras'
    losses scale sample weights in place (`sample_weight *= mask`): on one
    replica's shard that would break the other replicas' backward passes.
    Tensors made from slices of a NumPy view do not share it, and they share
    memory just as the shards of NumPy batches do, so batches from a
    `DataLoader` train exactly as NumPy batches. (bfloat16, which NumPy lacks,
    and GPU tensors stay as they are.)
    """
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype != torch.bfloat16:
        return value.detach().numpy()
    return value


# A leaf of a global batch cut into its shards' rows (slices share the batch's memory).
split_rows = partition.row_slices


def _sum_on(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = values[0].to(device)
    for value in values[1:]:
        total = total + value.to(device)
    return total


def _replica_sum(tensor: torch.Tensor) -> torch.Tensor:
    """This replica's sum of `tensor` over the replica threads: one NCCL all-reduce when every
    replica has its own GPU (replica 0 runs it for all), else the copies added on its device.
    Every replica sees the same exchanged values, so all take the same path."""
    values = replica_threads.exchange(tensor)
    if not nccl.one_per_gpu(values):
        return _sum_on(values, tensor.device)
    _, replica_id = replica_threads.current()
    devices = [f"gpu:{v.device.index}" for v in values]
    sums = nccl.all_reduce_sum([values], devices)[0] if replica_id == 0 else None
    return replica_threads.exchange(sums)[0][replica_id]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):  # noqa: D102
        return _replica_sum(tensor.detach())

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _replica_sum(grad.contiguous())


class _GlobalSum(torch.autograd.Function):
    """Sums over every replica of every worker; the gradient is the same sum of the incoming gradients."""

    @staticmethod
    def forward(ctx, over_all_replicas, *tensors):  # noqa: D102
        ctx.over_all_replicas = over_all_replicas
        # A copy each: replicas on the same device must not share one output tensor.
        return tuple(t.clone() for t in over_all_replicas([t.detach() for t in tensors]))

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        return (None,) + tuple(ctx.over_all_replicas([g.contiguous() for g in grads]))


def global_sum(values: list, across_workers: Callable[[list], list], over_all_replicas: Callable[[list], list]) -> list:
    """Sums of `values` over every replica of every worker, differentiable (inside a replica function).

    `over_all_replicas(tensors)` is the strategy's sum from the replica
    threads (not differentiable); this adds the gradient rule: the same
    global sum of the incoming gradients (synchronized BatchNormalization
    across workers). `across_workers` is not needed here.
    """
    vectorized.only_in_threads("a sum across workers")
    return list(_GlobalSum.apply(over_all_replicas, *[torch.as_tensor(v) for v in values]))


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas of the current run (inside a replica function)."""
    if vectorized.active():
        return vectorized.replica_sums([value])[0]
    group, _ = replica_threads.current()
    if group is None or group.size == 1:
        return value
    return _AllReduceSum.apply(torch.as_tensor(value))


def all_reduce_sums(values: list) -> list:
    """`all_reduce_sum` of each of `values` (in one call where replicas are vectorised)."""
    if vectorized.active():
        return vectorized.replica_sums(values)
    return [all_reduce_sum(value) for value in values]


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (shard sizes may differ)."""
    vectorized.only_in_threads("all_gather")
    tensor = torch.as_tensor(value)
    return torch.cat([v.to(tensor.device) for v in replica_threads.exchange(tensor.detach())], dim=axis)


def merge_call(fn: Callable[[list], Any], value: Any) -> Any:
    """`fn(values of every replica)` once, its result returned to every replica."""
    vectorized.only_in_threads("merge_call")
    return replica_threads.merge_call(fn, value)


def replica_view(value: Any, device: str) -> Any:
    """A primary variable's value as a replica reads it: the tensor itself (autograd differentiates it there)."""
    return value


def onto(value: Any, like: Any) -> torch.Tensor:
    """`value` on the device of `like`."""
    return value.to(like.device)


class _PrivateGrads(replica_threads.ThreadState):
    """Each replica's own `.grad` on the shared parameters.

    Keras' torch `train_step` (and code written like it) calls
    `zero_grad()` and `loss.backward()` and reads `.grad`; replicas take
    turns at collectives, also inside a backward pass (synchronized
    BatchNormalization), so without this they would clear and add to each
    other's gradients.
    """

    def __init__(self, parameters: list, size: int):
        self.parameters = parameters
        initial = [p.grad for p in parameters]
        self.grads = {k: [None if g is None else g.clone() if k else g for g in initial] for k in range(size)}

    def save(self, replica_id: int) -> None:
        self.grads[replica_id] = [p.grad for p in self.parameters]

    def restore(self, replica_id: int) -> None:
        for parameter, grad in zip(self.parameters, self.grads[replica_id]):
            parameter.grad = grad


def _on_device(name: str) -> contextlib.AbstractContextManager:
    """Where a replica's torch calls create tensors: its device. Not entered for the CPU, torch's
    default: `with torch.device(...)` routes every torch call through a Python function mode
    (about a sixth of the replica threads' CPU time in a profile of a small MLP)."""
    device = torch_device(name)
    return contextlib.nullcontext() if device == "cpu" else torch.device(device)


def replica_device_scope(replica_id: int, devices: Sequence[str]) -> contextlib.AbstractContextManager:
    """Where Keras creates a replica's tensors in a replicated step: the replica's GPU.

    Keras on PyTorch keeps its device in the state that a step carries into the
    replica threads (there: the first device, from the strategy's scope).
    Vectorised replicas share one device, where the step already is.
    """
    if vectorized.active():
        return contextlib.nullcontext()
    device = devices[replica_id]
    return contextlib.nullcontext() if torch_device(device) == "cpu" else device_scope(device)


def _shared_on(shared: tuple, name: str) -> tuple:
    """The shared state as the replica on `name` reads it: a copy on its GPU, so that its
    computation and gradients stay there; on the CPU, the tensors themselves."""
    device = torch_device(name)
    if device == "cpu":
        return shared
    return tree.map_structure(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, shared)


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool, variables: Sequence[Any] = ()) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica.

    `variables`: the trainable ones get a private `.grad` per replica.
    Compiled (Keras' own stateless steps): replicas that share one physical
    device run as one vectorised program where the step allows it (`vectorized.py`).
    """
    parameters = [v.value for v in variables if v.trainable and isinstance(v.value, torch.Tensor)]

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        try:
            if len(devices) == 1:
                results = [fn(0, *shared, *per_replica[0])]
            else:
                results = replica_threads.run(
                    lambda i: fn(i, *_shared_on(shared, devices[i]), *per_replica[i]),
                    len(devices),
                    lambda i: _on_device(devices[i]),
                    _PrivateGrads(parameters, len(devices)) if parameters else None,
                )
        except BaseException:
            module_buffers.discard()
            raise
        module_buffers.combine()  # wrapped torch modules' buffers, from the replicas' copies
        return results

    if compiled and len(devices) > 1 and len({torch_device(d) for d in devices}) == 1:
        return vectorized.Vectorized(fn, len(devices), run)
    return run
