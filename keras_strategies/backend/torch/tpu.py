"""PyTorch has no TPU runtime here: every TPU call raises one clear error.

TPUs run PyTorch through torch-xla, which is built for its own torch version;
none matches the torch this package supports.
"""

from __future__ import annotations

from typing import Any

import torch

MESSAGE = (
    "TPUStrategy is not available on the PyTorch backend: PyTorch runs on TPUs through torch-xla, "
    "and no torch-xla release matches torch {version}. Use the JAX or TensorFlow backend on TPUs "
    "(KERAS_BACKEND=jax or tensorflow)."
)


def check_runtime() -> None:
    raise RuntimeError(MESSAGE.format(version=torch.__version__.split("+")[0]))


def _refuse(*_: Any, **__: Any) -> Any:
    check_runtime()


resolve = master = cluster_spec = num_accelerators = connect_to_cluster = _refuse
initialize_tpu_system = replica_devices = hosts = _refuse
