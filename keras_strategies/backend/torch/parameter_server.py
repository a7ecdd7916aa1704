"""ParameterServerStrategy's engine on PyTorch: Ray actors hold the variables and run the closures.

The runtime is backend-neutral (`backend/common/ray_parameter_server`); this
module gives it the engine interface every backend's `parameter_server` has,
and `TENSOR_OPS`, the PyTorch ways of a shard's updates and reads.
"""

import warnings
from typing import Any

import numpy as np

from keras_strategies.backend.common.ray_parameter_server import (  # noqa: F401
    connect,
    current_worker_index,
    serve,
)
from keras_strategies.backend.common.ray_parameter_server.tensors import TensorOps


class _TorchTensorOps(TensorOps):
    """Zero-copy gradients and views; reads stay copies, because PyTorch optimizers update in place and Ray
    serializes a returned value after the shard's lock is released."""

    def no_grad(self) -> Any:
        import torch

        return torch.no_grad()

    def gradients(self, keras: Any, arrays: list) -> list:
        import torch

        with warnings.catch_warnings():
            # Ray's arrays are read-only; the optimizer only reads its gradients (and `assign` copies
            # them into the variable), so they need no copy of their own.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            tensors = []
            for array in arrays:
                try:
                    tensors.append(torch.from_numpy(array))
                except TypeError:  # a dtype PyTorch lacks
                    tensors.append(keras.ops.convert_to_tensor(array))
            return tensors

    def assign(self, keras: Any, variable: Any, array: np.ndarray) -> None:
        # The variable copies the values in place: no copy before that (Keras' conversion makes one).
        tensor = self.gradients(keras, [array])[0]
        if isinstance(tensor, np.ndarray) or tensor.dtype != variable.value.dtype:
            variable.assign(array)
        else:
            variable.assign(tensor)

    def view(self, keras: Any, value: Any) -> np.ndarray:
        import torch

        if isinstance(value, keras.Variable):
            value = value.value
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype != torch.bfloat16:
            return value.detach().numpy()
        return super().view(keras, value)


TENSOR_OPS = _TorchTensorOps()
