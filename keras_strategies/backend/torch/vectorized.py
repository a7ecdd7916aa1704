"""Replicas that share one physical device, run as one batched program (`torch.func.vmap`).

Replica threads take turns under the GIL, and each pays Keras' per-call
dispatch for its own shard: four CPU replicas of a small MLP took five times
the step of one device. Here the shards are stacked on a replica axis and the
replica function runs once, vectorised over it, with the semantics of separate
replicas (each layer sees its own shard: BatchNormalization statistics stay
per replica). The sum over replicas is an `autograd.Function` whose vmap rule
sums over the replica axis, and whose gradient is the same sum of the incoming
gradients (what `psum` does on JAX); gradients inside come from `torch.func`.

Whatever cannot be vectorised (random ops, data-dependent Python control flow,
conversions to NumPy, `all_gather`, `merge_call`) raises inside `vmap`; the
step then runs in replica threads from then on, with the same results.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from keras.src import tree

_state = threading.local()  # `active`: this thread runs a vectorised program (vmap runs in the caller's thread)
_TENSOR = object()  # marks where a replica's output has a tensor


def active() -> bool:
    """Whether the caller runs inside a vectorised replica program."""
    return getattr(_state, "active", False)


class NotVectorizable(RuntimeError):
    """Raised inside a vectorised program by what only replica threads can do."""


def only_in_threads(what: str) -> None:
    """Sends the step to replica threads when `what` is asked for inside a vectorised program."""
    if active():
        raise NotVectorizable(f"{what} needs the replicas in threads")


class ReplicaSum(torch.autograd.Function):
    """Sums over the replica axis, broadcast back to every replica; differentiable.

    Takes several tensors at once: each call of a function under `vmap` and
    `grad` costs far more than the sums themselves.
    """

    @staticmethod
    def forward(*tensors):  # noqa: D102 - outside vmap there is one replica
        return tuple(tensor.clone() for tensor in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: D102
        pass

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        return ReplicaSum.apply(*grads)

    @staticmethod
    def vmap(info, in_dims, *tensors):  # noqa: D102
        sums, axes = [], []
        for tensor, axis in zip(tensors, in_dims):
            if axis is None:  # the same value on every replica
                sums.append(tensor * info.batch_size)
            else:
                sums.append(tensor.sum(axis, keepdim=True).expand_as(tensor).clone())
            axes.append(axis)
        return tuple(sums), tuple(axes)


def replica_sums(values: list) -> list:
    """The sums of `values` over the replicas of the vectorised program running now."""
    return list(ReplicaSum.apply(*[torch.as_tensor(value) for value in values]))


def _stack(per_replica: Sequence[tuple]) -> Optional[list]:
    """The replicas' argument leaves stacked on a new first axis, or None when their shapes
    differ (uneven shards) or a leaf is not an array."""
    flat = [tree.flatten(args) for args in per_replica]
    stacked = []
    for leaves in zip(*flat):
        if all(leaf is None for leaf in leaves):
            stacked.append(None)
            continue
        if any(leaf is None for leaf in leaves):
            return None
        tensors = [torch.as_tensor(np.asarray(leaf) if not isinstance(leaf, torch.Tensor) else leaf) for leaf in leaves]
        if len({(t.shape, t.dtype, t.device) for t in tensors}) != 1:
            return None
        stacked.append(torch.stack(tensors))
    return stacked


class Vectorized:
    """`run(shared, per_replica)` as `make_replicated`'s, vectorised where it can be (module docstring)."""

    def __init__(self, fn: Callable, size: int, threaded: Callable):
        self._fn, self._size, self._threaded = fn, size, threaded
        self.fallback_reason: Optional[str] = None  # why the replicas run in threads from now on

    def __call__(self, shared: tuple, per_replica: Sequence[tuple]) -> list:
        stacked = None if self.fallback_reason else _stack(per_replica)
        if stacked is None:
            return self._threaded(shared, per_replica)
        try:
            return self._vectorized(shared, per_replica[0], stacked)
        except Exception as error:  # noqa: BLE001 - the threads give the same results, or the real error
            self.fallback_reason = f"{type(error).__name__}: {error}"
            return self._threaded(shared, per_replica)

    def _vectorized(self, shared: tuple, template: tuple, stacked: list) -> list:
        arguments = [i for i, leaf in enumerate(stacked) if leaf is not None]
        traced: dict = {}  # the outputs' structure, and their leaves that are not tensors (the same on every replica)

        def replica(replica_id, *leaves):
            flat: list = [None] * len(stacked)
            for index, leaf in zip(arguments, leaves):
                flat[index] = leaf
            outputs = self._fn(replica_id, *shared, *tree.pack_sequence_as(template, flat))
            # PyTorch's own tree functions: Keras' leave reference cycles that hold the structure they
            # were given, which would keep the vectorised outputs (and their memory) until the
            # cycle collector ran; only the outputs' structure is kept, not the outputs.
            found, structure = pytree.tree_flatten(outputs)
            traced.update(structure=structure, leaves=[_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in found])
            return tuple(leaf for leaf in found if isinstance(leaf, torch.Tensor))

        _state.active = True
        try:
            results = torch.func.vmap(replica)(torch.arange(self._size), *[stacked[i] for i in arguments])
        finally:
            _state.active = False
        per_replica = [list(torch.unbind(leaf)) for leaf in results]
        outputs = []
        for i in range(self._size):
            tensors = iter([leaf[i] for leaf in per_replica])
            flat = [next(tensors) if leaf is _TENSOR else leaf for leaf in traced["leaves"]]
            outputs.append(pytree.tree_unflatten(flat, traced["structure"]))
        return outputs
