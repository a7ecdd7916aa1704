"""TensorFlow devices: logical CPU devices stand in for accelerators."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf
from keras import ops


def set_virtual_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` logical devices (before TF initialises)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    try:
        tf.config.set_logical_device_configuration(cpu, wanted)
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return
        raise RuntimeError(
            f"Cannot give TensorFlow {count} virtual CPU devices: it has already initialised "
            f"its devices ({have} CPU device(s)). Call ks.set_virtual_cpu_devices() or set "
            "KERAS_STRATEGIES_CPU_DEVICES before any TensorFlow operation runs."
        ) from error


def _is_local(name: str) -> bool:
    """Once this process has joined a cluster, TF also lists the other workers' devices."""
    from keras_strategies.backend.tensorflow import collectives

    task = collectives.local_task()
    if task is None:
        return True
    spec = tf.DeviceSpec.from_string(name)
    return spec.job is None or (spec.job, spec.task) == task


def list_devices() -> list[str]:
    """Local devices as `"<type>:<index>"`, accelerators first."""
    names = []
    for kind in ("GPU", "TPU", "CPU"):
        for device in tf.config.list_logical_devices(kind):
            if _is_local(device.name):
                index = int(device.name.rsplit(":", 1)[1])
                names.append(f"{kind.lower()}:{index}")
    return names


@contextlib.contextmanager
def device_scope(name: str) -> Iterator[None]:
    """Places variables and operations created inside on device `name`."""
    kind, index = name.split(":")
    with tf.device(f"/device:{kind.upper()}:{index}"):
        yield


def device_of(value: Any) -> str:
    """The device holding a tensor or variable, as `"<type>:<index>"`."""
    tensor = getattr(value, "value", value)  # a Keras variable wraps a tf.Variable
    spec = tf.DeviceSpec.from_string(tensor.device)
    return f"{spec.device_type.lower()}:{spec.device_index}"


def copy_to(value: Any, name: str) -> Any:
    """A copy of tensor `value` on device `name`."""
    with device_scope(name):
        return tf.identity(value)


def place_each(values: list, names: list) -> list:
    """Each of `values` as a tensor on the device of the same index in `names` (an `IndexedSlices`
    stays one, its parts copied)."""
    return [tf.IndexedSlices(copy_to(value.values, name), copy_to(value.indices, name), value.dense_shape)
            if isinstance(value, tf.IndexedSlices) else copy_to(ops.convert_to_tensor(value), name)
            for value, name in zip(values, names)]


def has_gpu() -> bool:
    """Whether GPUs are present (without initialising the runtime)."""
    return bool(tf.config.list_physical_devices("GPU"))
