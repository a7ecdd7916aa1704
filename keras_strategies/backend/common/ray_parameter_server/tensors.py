"""How a shard and a worker move values between NumPy (what Ray carries) and the backend's tensors.

The defaults work on every backend; a backend's `parameter_server` module may
give `TENSOR_OPS`, a subclass that avoids copies and runs the optimizer
faster where its tensors allow it. A 16 MB round trip spends most of its time
in fresh 16 MB allocations, so each copy saved counts.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

import numpy as np


class TensorOps:
    """Conversions and the optimizer step of the Ray engine (backend-neutral defaults)."""

    def no_grad(self) -> contextlib.AbstractContextManager:
        """Where a shard or a worker updates variables: outside the backend's autodiff, where it records."""
        return contextlib.nullcontext()

    def gradients(self, keras: Any, arrays: list) -> list:
        """Backend tensors for gradients received from Ray (read-only NumPy arrays)."""
        return [keras.ops.convert_to_tensor(a) for a in arrays]

    def apply(self, keras: Any, optimizer: Any, grads: list, variables: list) -> None:
        """Applies `grads` to `variables` (a shard's pieces) with `optimizer`."""
        optimizer.apply(grads, variables)

    def assign(self, keras: Any, variable: Any, array: np.ndarray) -> None:
        """Assigns a value received from Ray (a read-only NumPy array) to a worker's variable."""
        variable.assign(array)

    def snapshot(self, keras: Any, value: Any, buffers: list) -> np.ndarray:
        """A NumPy copy of `value` that later updates of its variable leave unchanged (a shard's `read`).

        The copy goes into one of `buffers` (the piece's earlier copies) that nothing else references any
        more (Ray has serialized it), which saves allocating fresh memory; else into a new one, kept when
        `buffers` has fewer than two.
        """
        view = self.view(keras, value)
        for index in range(len(buffers)):
            # Held only by the list (and getrefcount's argument): Ray is done with it.
            if sys.getrefcount(buffers[index]) == 2 and buffers[index].shape == view.shape \
                    and buffers[index].dtype == view.dtype:
                np.copyto(buffers[index], view)
                return buffers[index]
        copy = np.array(view)
        if len(buffers) < 2:
            buffers.append(copy)
        return copy

    def view(self, keras: Any, value: Any) -> np.ndarray:
        """`value` as NumPy, a view where the backend allows it: only for values used before they change
        (a worker's gradients, which Ray copies when they are sent)."""
        if isinstance(value, keras.Variable):
            value = value.value
        if hasattr(value, "detach"):
            value = value.detach()
        return np.asarray(keras.ops.convert_to_numpy(value))


_OPS: dict = {}


def tensor_ops(backend: str) -> TensorOps:
    """The backend's `TENSOR_OPS` (its `parameter_server` module), or the defaults."""
    if backend not in _OPS:
        try:
            module = importlib.import_module(f"keras_strategies.backend.{backend}.parameter_server")
        except ImportError:
            module = None
        _OPS[backend] = getattr(module, "TENSOR_OPS", None) or TensorOps()
    return _OPS[backend]
