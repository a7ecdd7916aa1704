"""JAX devices: the host platform can be split into several CPU devices."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import numpy as np
from jax._src import xla_bridge


def set_virtual_cpu_devices(count: int) -> None:
    """Asks XLA for `count` host-platform CPU devices (before JAX initialises)."""
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have == count:
            return
        raise RuntimeError(
            f"Cannot give JAX {count} virtual CPU devices: it has already initialised its "
            f"devices ({have} CPU device(s)). Call ks.set_virtual_cpu_devices() or set "
            "KERAS_STRATEGIES_CPU_DEVICES before any JAX operation runs."
        )
    jax.config.update("jax_num_cpu_devices", count)


def _platform_name(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def list_devices() -> list[str]:
    """Local devices as `"<type>:<index>"`, accelerators first."""
    accelerators = [d for d in jax.local_devices() if d.platform != "cpu"]
    names = [f"{_platform_name(d.platform)}:{i}" for i, d in enumerate(accelerators)]
    names += [f"cpu:{i}" for i, _ in enumerate(jax.local_devices(backend="cpu"))]
    return names


def jax_device(name: str) -> "jax.Device":
    kind, index = name.split(":")
    if kind == "cpu":
        return jax.local_devices(backend="cpu")[int(index)]
    return [d for d in jax.local_devices() if _platform_name(d.platform) == kind][int(index)]


@contextlib.contextmanager
def device_scope(name: str) -> Iterator[None]:
    """Places arrays created inside on device `name`."""
    with jax.default_device(jax_device(name)):
        yield


def device_of(value: Any) -> str:
    """The device holding an array or variable, as `"<type>:<index>"`."""
    array = getattr(value, "value", value)
    (device,) = array.devices()
    kind = _platform_name(device.platform)
    same_kind = [d for d in jax.local_devices(backend=device.platform)]
    return f"{kind}:{same_kind.index(device)}"


def copy_to(value: Any, name: str) -> Any:
    """Array `value` on device `name`: itself when it is there already (JAX arrays are
    immutable, and a `device_put` that moves nothing still costs a dispatch). A traced value
    stays as it is: inside a compiled program its placement is the compiler's."""
    if isinstance(value, jax.core.Tracer):
        return value
    device = jax_device(name)
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        if value.sharding.device_set == {device}:
            return value
    return jax.device_put(value, device)


def place_each(values: list, names: list) -> list:
    """Each of `values` (arrays, host or device) on the device of the same index in `names`:
    one batched transfer of those not there yet (each array costs the transfer a dispatch)."""
    arrays = [v if isinstance(v, (jax.Array, np.ndarray)) else np.asarray(v) for v in values]
    targets = [jax_device(name) for name in names]
    moving = [i for i, (array, device) in enumerate(zip(arrays, targets))
              if not (isinstance(array, jax.Array) and array.is_fully_addressable
                      and array.sharding.device_set == {device})]
    if moving:
        for i, moved in zip(moving, jax.device_put([arrays[i] for i in moving], [targets[i] for i in moving])):
            arrays[i] = moved
    return arrays


def has_gpu() -> bool:
    """Whether JAX's CUDA plugin is installed (checked without initialising JAX's backends)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
