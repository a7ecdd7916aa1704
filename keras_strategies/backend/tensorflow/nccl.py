"""NCCL between this process's GPUs on TensorFlow: `tf.distribute.NcclAllReduce`, TensorFlow's own.

`ks.NcclAllReduce` hands each pack here; TensorFlow's cross-device ops run its
`NcclAllReduce` ops, one per GPU. Eagerly, one compiled program per
signature (TensorFlow would otherwise trace its NCCL ops again at every call).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.python.distribute import values as tf_values

# The caller packs the values already.
CROSS_DEVICE_OPS = tf.distribute.NcclAllReduce(num_packs=0)


def _tf_name(device: str) -> str:
    kind, index = device.split(":")
    return f"/device:{kind.upper()}:{index}"


def _sums(per_value: list, devices: tuple) -> list:
    pairs = []
    for components in per_value:
        placed = []
        for component, device in zip(components, devices):
            with tf.device(device):  # NCCL ops need tensors with a device, also inside a graph
                placed.append(tf.identity(component))
        value = tf_values.PerReplica(tuple(placed))
        pairs.append((value, value))  # destinations = the value's own devices: an all-reduce
    results = CROSS_DEVICE_OPS.batch_reduce(tf.distribute.ReduceOp.SUM, pairs)
    return [list(result.values) for result in results]


_program = tf.function(_sums)


def all_reduce_sum(per_value: Sequence[Sequence[tf.Tensor]], devices: Sequence[str]) -> list:
    """`per_value[k][i]` is value k's part on GPU `devices[i]`; returns value k's sum on each of them."""
    names = tuple(_tf_name(d) for d in devices)
    per_value = [[tf.convert_to_tensor(c) for c in components] for components in per_value]
    if tf.executing_eagerly():
        return _program(per_value, names)
    return _sums(per_value, names)
