"""Device names and virtual CPU devices, the same on every backend.

Devices are named `"<type>:<index>"` (`"cpu:0"`, `"gpu:1"`), as in
`keras.distribution.list_devices()`. TensorFlow-style names such as
`"/gpu:0"` or `"/job:localhost/replica:0/task:0/device:CPU:1"` are accepted.

On a CPU-only machine, `set_virtual_cpu_devices(n)` (or the environment
variable `KERAS_STRATEGIES_CPU_DEVICES=n`, read when `keras_strategies` is
imported) gives the backend `n` CPU devices so that multi-replica strategies
can run: TF logical devices, JAX host-platform devices, torch CPU replicas.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Iterable

from keras_strategies.backend import engine

ENV_VAR = "KERAS_STRATEGIES_CPU_DEVICES"

_DEVICE_RE = re.compile(r"(?:.*/)?(?:device:)?(?P<kind>cpu|gpu|tpu|cuda)(?::(?P<index>\d+))?$", re.I)


def canonical_device(name: str) -> str:
    """`"/GPU:0"`, `"cpu"`, `"/job:w/task:0/device:CPU:1"` -> `"gpu:0"`, `"cpu:0"`, `"cpu:1"`."""
    match = _DEVICE_RE.match(str(name).strip()) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"Invalid device {name!r}: use a name like 'cpu:0', 'gpu:1' or '/device:GPU:0'."
        )
    kind = match["kind"].lower()
    kind = "gpu" if kind == "cuda" else kind
    return f"{kind}:{int(match['index'] or 0)}"


def list_devices() -> list[str]:
    """This process's devices, accelerators first (e.g. `["gpu:0", "gpu:1", "cpu:0"]`).

    The same names on every backend; `ks.MirroredStrategy(devices=...)` takes them.

    Examples:
        >>> ks.list_devices()  # KERAS_STRATEGIES_CPU_DEVICES=4, no GPU
        ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
    """
    return engine.devices.list_devices()


def default_compute_devices() -> list[str]:
    """All local accelerators, else all (virtual) CPU devices."""
    devices = list_devices()
    accelerators = [d for d in devices if not d.startswith("cpu:")]
    return accelerators or [d for d in devices if d.startswith("cpu:")]


def resolve_devices(devices: Iterable[str]) -> list[str]:
    """Canonical names for `devices`, checked against the devices this process has."""
    if isinstance(devices, str):
        raise ValueError(
            f"`devices` must be a list of device names, e.g. [{devices!r}]; got the string {devices!r}."
        )
    names = [canonical_device(d) for d in devices]
    if not names:
        raise ValueError("`devices` must name at least one device, e.g. ['cpu:0'].")
    if len(set(names)) != len(names):
        raise ValueError(f"Duplicate devices in {list(devices)!r}: each device may appear once.")
    available = list_devices()
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(
            f"Unknown device(s) {missing}: this process has {available}. For more CPU "
            f"devices call ks.set_virtual_cpu_devices(n) or set {ENV_VAR}=n before the "
            "backend initialises."
        )
    return names


def set_virtual_cpu_devices(count: int) -> None:
    """Gives the backend `count` CPU devices; call before the backend initialises its devices.

    So multi-replica strategies run on a machine without accelerators (tests,
    laptops). The environment variable `KERAS_STRATEGIES_CPU_DEVICES=count`,
    read when `keras_strategies` is imported, does the same.

    Raises:
        ValueError: `count` is not an int >= 1.
        RuntimeError: The backend already initialised a different number of devices.

    Examples:
        >>> ks.set_virtual_cpu_devices(4)  # first thing in the program
        >>> ks.MirroredStrategy().num_replicas_in_sync
        4
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"The number of virtual CPU devices must be an int >= 1, got {count!r}.")
    engine.devices.set_virtual_cpu_devices(count)


def configure_from_environment() -> None:
    """Applies `KERAS_STRATEGIES_CPU_DEVICES` if it is set."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 1:
        raise ValueError(f"{ENV_VAR}={raw!r} is invalid: set it to a whole number >= 1, e.g. 4.")
    try:
        set_virtual_cpu_devices(count)
    except RuntimeError:
        # A backend operation ran before this import (a notebook cell, a library that imported
        # Keras first): the devices are fixed; the import goes on with them.
        warnings.warn(
            f"{ENV_VAR}={count} is set, but the backend had already set up its devices when "
            f"keras_strategies was imported; going on with those: {engine.devices.list_devices()}. "
            f"Import keras_strategies before any backend operation runs, or unset {ENV_VAR}.",
            stacklevel=2,
        )
