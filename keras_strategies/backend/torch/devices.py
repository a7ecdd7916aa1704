"""PyTorch devices: one host CPU can carry several replicas.

PyTorch has no virtual CPU devices, so the engine keeps the number of CPU
replicas itself; every `cpu:<i>` maps to the one `torch.device("cpu")`.
The count is fixed the first time devices are listed, like the other backends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from keras import ops

_cpu_devices = {"count": 1, "frozen": False}


def set_virtual_cpu_devices(count: int) -> None:
    """Gives the CPU `count` replica slots (before devices are first listed)."""
    if _cpu_devices["frozen"] and _cpu_devices["count"] != count:
        raise RuntimeError(
            f"Cannot give PyTorch {count} virtual CPU devices: the device list was already "
            f"used with {_cpu_devices['count']} CPU device(s). Call "
            "ks.set_virtual_cpu_devices() or set KERAS_STRATEGIES_CPU_DEVICES before "
            "creating a strategy."
        )
    _cpu_devices["count"] = count


def list_devices() -> list[str]:
    """Local devices as `"<type>:<index>"`, accelerators first."""
    _cpu_devices["frozen"] = True
    gpus = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    return gpus + [f"cpu:{i}" for i in range(_cpu_devices["count"])]


def torch_device(name: str) -> str:
    """The torch device string for a `"<type>:<index>"` name (all CPU slots share "cpu")."""
    kind, index = name.split(":")
    return "cpu" if kind == "cpu" else f"cuda:{index}"


@contextlib.contextmanager
def device_scope(name: str) -> Iterator[None]:
    """Makes Keras create tensors and variables on device `name`."""
    from keras.src.backend.torch import device_scope as keras_device_scope

    with keras_device_scope(torch_device(name)):
        yield


def device_of(value: Any) -> str:
    """The device holding a tensor or variable, as `"<type>:<index>"`."""
    device = getattr(value, "value", value).device
    if device.type == "cpu":
        return "cpu:0"
    return f"gpu:{device.index or 0}"


def copy_to(value: Any, name: str) -> Any:
    """`value` on device `name` (no copy when it is already there)."""
    return value.to(torch_device(name))


def place_each(values: list, names: list) -> list:
    """Each of `values` as a tensor on the device of the same index in `names`."""
    return [copy_to(ops.convert_to_tensor(value), name) for value, name in zip(values, names)]


def has_gpu() -> bool:
    """Whether CUDA GPUs are present."""
    return torch.cuda.is_available()
