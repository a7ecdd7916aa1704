"""PyTorch replicas: one Python thread per replica (see `keras_strategies.replica_threads`).

PyTorch has no single-process SPMD program. `all_reduce` exchanges tensors
between the replica threads and is differentiable: its backward pass
all-reduces the incoming gradients the same way.
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable, Sequence

import torch

from keras_strategies import replica_threads
from keras_strategies.backend.torch.devices import torch_device
from keras_strategies.replica_variables import replica_copies

# Replicas may have different shard sizes: each runs its own shard unpadded.
EQUAL_SHARDS = False
NATIVE_SYNC_BATCH_NORM = False


def _sum_on(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = values[0].to(device)
    for value in values[1:]:
        total = total + value.to(device)
    return total


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):  # noqa: D102
        return _sum_on(replica_threads.exchange(tensor.detach()), tensor.device)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _sum_on(replica_threads.exchange(grad.contiguous()), grad.device)


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
    return list(_GlobalSum.apply(over_all_replicas, *[torch.as_tensor(v) for v in values]))


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas of the current run (inside a replica function)."""
    group, _ = replica_threads.current()
    if group is None or group.size == 1:
        return value
    return _AllReduceSum.apply(torch.as_tensor(value))


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (shard sizes may differ)."""
    tensor = torch.as_tensor(value)
    return torch.cat([v.to(tensor.device) for v in replica_threads.exchange(tensor.detach())], dim=axis)


def merge_call(fn: Callable[[list], Any], value: Any) -> Any:
    """`fn(values of every replica)` once, its result returned to every replica."""
    return replica_threads.merge_call(fn, value)


def mirrored_variables(variables: Sequence[Any], device: str, replica_id: int) -> contextlib.AbstractContextManager:
    """Replicas read the primary trainable variables (autograd differentiates them there).

    Replicas after the first compute with copies of the non-trainable ones
    (BatchNormalization statistics, metric state), whose writes are merged
    as `replica_variables.replica_copies` says.
    """
    copied = [v for v in variables if not v.trainable]
    if replica_id == 0 or not copied:
        return contextlib.nullcontext()
    target = torch_device(device)
    return replica_copies(copied, lambda value: value.detach().to(target, copy=True),
                          lambda delta, primary: delta.to(primary.device))


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica."""

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        if len(devices) == 1:
            return [fn(0, *shared, *per_replica[0])]
        return replica_threads.run(
            lambda i: fn(i, *shared, *per_replica[i]),
            len(devices),
            lambda i: torch.device(torch_device(devices[i])),
        )

    return run
