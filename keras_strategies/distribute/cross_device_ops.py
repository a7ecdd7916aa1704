"""How per-replica values are combined across local devices (as `tf.distribute.CrossDeviceOps`).

A `CrossDeviceOps` turns a `PerReplica` value into one value on the
destination device. Subclasses override the `*_implementation` methods, as in
TensorFlow. Copies between devices go through the backend engine, and so does
`NcclAllReduce` (`engine.nccl`: each backend's own NCCL).

A strategy's `cross_device_ops` sums `fit`'s gradients only when the user
passed it (with the default, the replica program sums them with the engine's
all-reduce); it always averages the replicas' non-trainable values.
`strategy.reduce` and `extended.reduce_to` add copies on the host instead, and
`ReplicaContext.all_reduce` is the engine's in-step all-reduce.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from keras import ops

from keras_strategies.backend.common import partition
from keras_strategies.backend import engine
from keras_strategies.distribute.devices import canonical_device
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.values import Mirrored, is_distributed


def _components(value: Any) -> tuple:
    return value.values if is_distributed(value) else (value,)


def _destination(destinations: Any) -> str:
    """A device name from a device string, a list of them (first), or a value with `.device`."""
    if isinstance(destinations, (list, tuple)):
        destinations = destinations[0]
    if isinstance(destinations, str):
        return canonical_device(destinations)
    return engine.devices.device_of(destinations)


def _add_n(values: Sequence[Any]) -> Any:
    return functools.reduce(engine.gradients.add, values)


class CrossDeviceOps:
    """Base class: reduce and broadcast per-replica values between devices.

    As `tf.distribute.CrossDeviceOps`. Pass one to `ks.MirroredStrategy(cross_device_ops=...)`
    to choose how gradients are summed between the devices of one machine;
    subclasses override the `*_implementation` methods.

    Examples:
        >>> cross_device_ops = ks.ReductionToOneDevice()
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=cross_device_ops)
        >>> per_replica = strategy.run(lambda: keras.ops.ones((2,)))
        >>> total = cross_device_ops.reduce("sum", per_replica, destinations="cpu:0")
        >>> keras.ops.convert_to_numpy(total).tolist()
        [2.0, 2.0]
    """

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces one per-replica value to `destinations` (a device name, or a value on that device).

        Examples:
            >>> per_replica = ks.PerReplica([keras.ops.ones(()), keras.ops.ones(())])
            >>> float(ks.ReductionToOneDevice().reduce("mean", per_replica, destinations="cpu:0"))
            1.0
        """
        return self.reduce_implementation(ReduceOp.parse(reduce_op), per_replica_value, destinations, options)

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple], options: Any = None) -> list:
        """Reduces several `(value, destinations)` pairs; the unit of gradient all-reduce.

        Examples:
            >>> a = ks.PerReplica([keras.ops.ones(()), keras.ops.ones(())])
            >>> b = ks.PerReplica([keras.ops.zeros(()), keras.ops.ones(())])
            >>> [float(v) for v in ks.ReductionToOneDevice().batch_reduce("sum", [(a, "cpu:0"), (b, "cpu:0")])]
            [2.0, 1.0]
        """
        return self.batch_reduce_implementation(ReduceOp.parse(reduce_op), list(value_destination_pairs), options)

    def broadcast(self, tensor: Any, destinations: Sequence[str]) -> Mirrored:
        """One copy of `tensor` on each destination device, as a `ks.Mirrored`.

        Examples:
            >>> mirrored = ks.ReductionToOneDevice().broadcast(keras.ops.ones(()), ["cpu:0", "cpu:1"])
            >>> len(mirrored.values)
            2
        """
        return self.broadcast_implementation(tensor, destinations)

    # Overridable hooks ---------------------------------------------------------
    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any) -> Any:
        """What `reduce` does, with `reduce_op` already a `ReduceOp`; subclasses must implement it."""
        raise NotImplementedError(f"{type(self).__name__} must implement reduce_implementation.")

    def batch_reduce_implementation(self, reduce_op: ReduceOp, value_destination_pairs: list, options: Any) -> list:
        """What `batch_reduce` does; by default `reduce_implementation` for each pair."""
        return [self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def broadcast_implementation(self, tensor: Any, destinations: Sequence[str]) -> Mirrored:
        """What `broadcast` does; by default a copy to each device."""
        devices = destinations if isinstance(destinations, (list, tuple)) else [destinations]
        return Mirrored([engine.devices.copy_to(ops.convert_to_tensor(tensor), canonical_device(d)) for d in devices])


def _finish(reduce_op: ReduceOp, total: Any, count: int) -> Any:
    if reduce_op == ReduceOp.MEAN:
        return ops.divide(total, ops.cast(count, total.dtype))
    return total


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every component to one device and accumulates there, as `tf.distribute.ReductionToOneDevice`.

    The default of `MirroredStrategy` unless its devices are several GPUs.

    Args:
        reduce_to_device: Where to accumulate (default: the destination).
        accumulation_fn: Sums a list of tensors on one device (default: pairwise adds).

    Examples:
        >>> strategy = ks.MirroredStrategy(
        ...     ["cpu:0", "cpu:1"], cross_device_ops=ks.ReductionToOneDevice(reduce_to_device="cpu:0"))
    """

    def __init__(self, reduce_to_device: Optional[str] = None, accumulation_fn: Optional[Callable] = None):
        self.reduce_to_device = None if reduce_to_device is None else canonical_device(reduce_to_device)
        self.accumulation_fn = accumulation_fn or _add_n

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        components = _components(per_replica_value)
        device = self.reduce_to_device or _destination(destinations)
        copies = [engine.devices.copy_to(ops.convert_to_tensor(c), device) for c in components]
        total = self.accumulation_fn(copies)
        result = _finish(reduce_op, total, len(components))
        target = _destination(destinations)
        return result if target == device else engine.devices.copy_to(result, target)


class _PackedAllReduce(CrossDeviceOps):
    """Concatenates a batch of values into `num_packs` flat buffers before reducing them.

    Fewer, larger transfers are what TensorFlow's packing buys on real links.
    """

    def __init__(self, num_packs: int = 1):
        if num_packs < 0:
            raise ValueError(f"num_packs must be >= 0, got {num_packs}.")
        self.num_packs = num_packs

    def _reduce_components(self, components: Sequence[Any], device: str) -> Any:
        raise NotImplementedError

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        components = [ops.convert_to_tensor(c) for c in _components(per_replica_value)]
        device = _destination(destinations)
        total = self._reduce_components(components, device)
        with engine.devices.device_scope(device):
            return _finish(reduce_op, total, len(components))

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if self.num_packs == 0 or len(value_destination_pairs) < 2:
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        sliced = lambda pair: any(engine.gradients.is_sliced(c) for c in _components(pair[0]))  # noqa: E731
        if any(map(sliced, value_destination_pairs)):  # slices (TF's IndexedSlices) alone: a pack would make them dense
            return partition.apply_partitioned(
                value_destination_pairs, sliced,
                lambda pairs: [self.reduce_implementation(reduce_op, v, d, options) for v, d in pairs],
                lambda pairs: self.batch_reduce_implementation(reduce_op, pairs, options),
            )
        device = _destination(value_destination_pairs[0][1])
        per_replica = [[ops.convert_to_tensor(c) for c in _components(v)] for v, _ in value_destination_pairs]
        num_replicas = len(per_replica[0])
        shapes = [c[0].shape for c in per_replica]
        dtypes = {str(c[0].dtype) for c in per_replica}
        if len(dtypes) != 1:  # mixed dtypes cannot share one buffer
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        bounds = _pack_bounds(len(per_replica), self.num_packs)
        results: list = []
        for start, stop in bounds:
            packed = []
            for r in range(num_replicas):
                # Each replica's pack on its device (TensorFlow would put it on its default device).
                with engine.devices.device_scope(engine.devices.device_of(per_replica[start][r])):
                    packed.append(ops.concatenate([ops.reshape(per_replica[i][r], (-1,)) for i in range(start, stop)], axis=0))
            total = self._reduce_components(packed, device)
            with engine.devices.device_scope(device):
                flat = _finish(reduce_op, total, num_replicas)
                offset = 0
                for i in range(start, stop):
                    size = 1
                    for dim in shapes[i]:
                        size *= int(dim)
                    results.append(ops.reshape(flat[offset:offset + size], shapes[i]))
                    offset += size
        return results


def _pack_bounds(count: int, num_packs: int) -> list[tuple[int, int]]:
    num_packs = min(num_packs, count)
    base, extra = divmod(count, num_packs)
    bounds, start = [], 0
    for i in range(num_packs):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class HierarchicalCopyAllReduce(_PackedAllReduce):
    """Reduces pairwise in a tree of devices, then copies the sum to the destination.

    As `tf.distribute.HierarchicalCopyAllReduce`. `num_packs` packs a batch
    of values (the gradients of a step) into that many flat buffers first,
    for fewer and larger transfers (0: no packing).

    Examples:
        >>> strategy = ks.MirroredStrategy(
        ...     ["cpu:0", "cpu:1"], cross_device_ops=ks.HierarchicalCopyAllReduce(num_packs=1))
        >>> per_replica = strategy.run(lambda: keras.ops.ones(()))
        >>> float(ks.HierarchicalCopyAllReduce().reduce("sum", per_replica, destinations="cpu:0"))
        2.0
    """

    def _reduce_components(self, components, device):
        level = list(components)
        while len(level) > 1:
            paired = []
            for i in range(0, len(level) - 1, 2):
                # Sum each pair on the device of its first element.
                target = engine.devices.device_of(level[i])
                paired.append(engine.gradients.add(level[i], engine.devices.copy_to(level[i + 1], target)))
            if len(level) % 2:
                paired.append(level[-1])
            level = paired
        return engine.devices.copy_to(level[0], device)


class NcclAllReduce(_PackedAllReduce):
    """NVIDIA NCCL all-reduce between GPUs, run by the backend's own NCCL; refused for other devices.

    As `tf.distribute.NcclAllReduce`. TensorFlow: `tf.distribute.NcclAllReduce`.
    PyTorch: `torch.cuda.nccl`. JAX: XLA's all-reduce over the GPUs, which XLA
    runs with NCCL. Values are packed first (`num_packs`, as in
    `HierarchicalCopyAllReduce`). Parts that do not sit one per GPU (two on one
    GPU) are added by copies, as TensorFlow's `NcclAllReduce` then reduces to
    one device.

    Examples:
        ```python
        strategy = ks.MirroredStrategy(["gpu:0", "gpu:1"], cross_device_ops=ks.NcclAllReduce())
        ```
    """

    def _reduce_components(self, components, device):
        devices = [engine.devices.device_of(c) for c in components]
        not_gpu = sorted(d for d in set(devices) | {device} if not d.startswith("gpu:"))
        if not_gpu:
            raise ValueError(
                f"NcclAllReduce needs every replica on a GPU, but {not_gpu} are not GPUs. Use "
                "cross_device_ops=ks.ReductionToOneDevice() or ks.HierarchicalCopyAllReduce() "
                "(the default picks one for you)."
            )
        if len(components) == 1 or len(set(devices)) < len(devices):
            return HierarchicalCopyAllReduce._reduce_components(self, components, device)
        (sums,) = engine.nccl.all_reduce_sum([list(components)], devices)
        return sums[devices.index(device)] if device in devices else engine.devices.copy_to(sums[0], device)


def select_cross_device_ops(devices: Sequence[str]) -> CrossDeviceOps:
    """TensorFlow's default: NCCL when every device is a GPU, else reduction to one device."""
    if devices and all(d.startswith("gpu:") for d in devices) and len(devices) > 1:
        return NcclAllReduce()
    return ReductionToOneDevice()


__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "select_cross_device_ops",
]
