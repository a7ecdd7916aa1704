"""PyTorch replicas: one Python thread per replica, collectives by rendezvous.

PyTorch has no single-process SPMD program, so every replica runs the same
function in its own thread (as TensorFlow's MirroredStrategy does eagerly);
`all_reduce` exchanges tensors between the threads and is differentiable:
its backward pass all-reduces the incoming gradients the same way.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from keras_strategies.backend.torch.devices import torch_device

# Replicas may have different shard sizes: each runs its own shard unpadded.
EQUAL_SHARDS = False
NATIVE_SYNC_BATCH_NORM = False


class _Group:
    """The replicas of one run, taking turns like TensorFlow's MirroredStrategy threads.

    Exactly one replica runs at a time (Keras layers keep per-call bookkeeping
    that concurrent calls would race on); control passes to the next replica
    when the running one reaches a collective or finishes. The last replica to
    reach a collective completes it and hands control back to replica 0.
    """

    def __init__(self, size: int):
        self.size = size
        self.condition = threading.Condition()
        self.turn = 0
        self.generation = 0
        self.slots: list = [None] * size
        self.results: dict = {}
        self.error: BaseException | None = None

    def _wait(self, predicate) -> None:
        self.condition.wait_for(lambda: self.error is not None or predicate())
        if self.error is not None:
            raise _Aborted() from self.error

    def start(self, replica_id: int) -> None:
        with self.condition:
            self._wait(lambda: self.turn == replica_id)

    def finish(self, replica_id: int) -> None:
        with self.condition:
            self.turn = replica_id + 1
            self.condition.notify_all()

    def abort(self, error: BaseException) -> None:
        with self.condition:
            self.error = error
            self.condition.notify_all()

    def exchange(self, replica_id: int, value: Any) -> list:
        """Every replica's `value`, once all replicas have reached this collective."""
        with self.condition:
            self.slots[replica_id] = value
            generation = self.generation
            if replica_id == self.size - 1:
                self.results = {generation: list(self.slots)}
                self.generation += 1
                self.turn = 0
            else:
                self.turn = replica_id + 1
            self.condition.notify_all()
            self._wait(lambda: self.generation > generation and self.turn == replica_id)
            return self.results[generation]


class _Aborted(Exception):
    """Another replica failed; this one stops."""


_local = threading.local()


def _sum_on(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = values[0].to(device)
    for value in values[1:]:
        total = total + value.to(device)
    return total


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):  # noqa: D102
        group, replica_id = _local.group, _local.replica_id
        ctx.group, ctx.replica_id = group, replica_id
        return _sum_on(group.exchange(replica_id, tensor.detach()), tensor.device)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _sum_on(ctx.group.exchange(ctx.replica_id, grad.contiguous()), grad.device)


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas of the current run (inside a replica function)."""
    group = getattr(_local, "group", None)
    if group is None or group.size == 1:
        return value
    return _AllReduceSum.apply(torch.as_tensor(value))


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (shard sizes may differ)."""
    group = getattr(_local, "group", None)
    tensor = torch.as_tensor(value)
    if group is None or group.size == 1:
        return tensor
    values = group.exchange(_local.replica_id, tensor.detach())
    return torch.cat([v.to(tensor.device) for v in values], dim=axis)


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica.

    Returns the list of per-replica results. An exception in one replica
    stops the others too, and that error is raised.
    """

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        size = len(devices)
        if size == 1:
            return [fn(0, *shared, *per_replica[0])]
        group = _Group(size)
        results: list = [None] * size
        errors: list = []

        def target(replica_id: int) -> None:
            _local.group, _local.replica_id = group, replica_id
            try:
                group.start(replica_id)
                with torch.device(torch_device(devices[replica_id])):
                    results[replica_id] = fn(replica_id, *shared, *per_replica[replica_id])
                group.finish(replica_id)
            except _Aborted:
                pass
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                group.abort(error)
            finally:
                _local.group = None

        threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

    return run
