"""TensorFlow's TPU runtime: `tf.distribute.TPUStrategy` runs the replica program.

The resolver, the connection and the TPU system are TensorFlow's own
(`tf.distribute.cluster_resolver.TPUClusterResolver`,
`tf.config.experimental_connect_to_cluster`,
`tf.tpu.experimental.initialize_tpu_system`); their errors are re-raised as
plain `ValueError` / `RuntimeError` with TensorFlow's message, without the
runtime's stack. The replicas of the Keras steps then run under a
`tf.distribute.TPUStrategy` (see `replicas._tf_strategy`).
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from keras_strategies.backend.tensorflow import replicas

NOT_FOUND = "TPUs not found in the cluster."


def check_runtime() -> None:
    """TensorFlow has a TPU runtime: nothing to refuse."""


def _first_line(error: BaseException) -> str:
    message = getattr(error, "message", None) or str(error)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__


def resolve(tpu: Optional[str], **kwargs: Any) -> Any:
    """TensorFlow's `TPUClusterResolver(tpu, ...)`; its errors as `ValueError` with its message."""
    try:
        return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu, **kwargs)
    except ValueError as error:
        raise ValueError(_first_line(error)) from None
    except Exception as error:  # e.g. a TPU name that cannot be looked up (no network, no GCE)
        raise ValueError(f"Cannot resolve the TPU {tpu!r}: {_first_line(error)}") from None


def master(handle: Any) -> str:
    return handle.master()


def cluster_spec(handle: Any) -> dict:
    return handle.cluster_spec().as_dict()


def num_accelerators(handle: Any) -> dict:
    try:
        return dict(handle.num_accelerators())
    except Exception:  # noqa: BLE001  (no TPU to ask)
        return {}


def connect_to_cluster(handle: Any) -> None:
    """`tf.config.experimental_connect_to_cluster`, for a remote TPU (a local one needs nothing)."""
    if not handle.cluster_spec().as_dict():
        return
    try:
        tf.config.experimental_connect_to_cluster(handle)
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"Cannot connect to the TPU cluster {handle.master()!r}: {_first_line(error)}") from None


def initialize_tpu_system(handle: Any) -> Any:
    """`tf.tpu.experimental.initialize_tpu_system`: the TPU topology."""
    try:
        return tf.tpu.experimental.initialize_tpu_system(handle)
    except Exception as error:  # noqa: BLE001
        message = _first_line(error)
        raise RuntimeError(message if message.startswith(NOT_FOUND) else f"{NOT_FOUND} {message}") from None


def replica_devices(handle: Any, device_assignment: Any, spmd: bool) -> list[str]:
    """The TPU cores of a `tf.distribute.TPUStrategy`, which then runs the replicas of our steps."""
    try:
        strategy = tf.distribute.TPUStrategy(handle, experimental_device_assignment=device_assignment,
                                             experimental_spmd_xla_partitioning=spmd)
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"{NOT_FOUND} {_first_line(error)}") from None
    devices = [f"tpu:{i}" for i in range(strategy.num_replicas_in_sync)]
    replicas._strategies[tuple(devices)] = strategy
    return devices


def hosts(handle: Any) -> tuple[list, int]:
    """One host as far as this package goes: TensorFlow's TPU runtime drives every host of a TPU
    pod itself, from the one program that holds its `TPUStrategy`."""
    return [], 0
