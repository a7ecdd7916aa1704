"""`ks.experimental.partitioners`: how ParameterServerStrategy splits large variables into shards.

The same classes, arguments, results and errors as
`tf.distribute.experimental.partitioners`, on every backend. A partitioner is
called as `partitioner(shape, dtype, axis=0)` and returns the number of shards
per axis, e.g. `[4, 1]`. ParameterServerStrategy calls it with `axis=0` for
each variable of rank >= 1 created in its scope and splits the variable along
its first axis with TensorFlow's "div" rule: the first shards get one row more
(13 rows over 5 shards: 3, 3, 3, 2, 2), and the shards go to the parameter
servers in turn. Size-based partitioners (`MinSizePartitioner`,
`MaxSizePartitioner`) leave small variables whole, which is usually what you
want.

`shape` may be a tuple or list of ints, a `tf.TensorShape` or a `torch.Size`;
`dtype` a name such as `"float32"` or a NumPy, TensorFlow, JAX or PyTorch dtype.

Examples:
    >>> partitioners = ks.experimental.partitioners
    >>> partitioners.FixedShardsPartitioner(num_shards=5)((13, 1024), "float32")
    [5, 1]
    >>> partitioners.MaxSizePartitioner(max_shard_bytes=1 << 20)((1024, 1024), "float32")
    [4, 1]
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Sequence

import numpy as np

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]

# Bytes per element, by dtype name (TensorFlow's `DType.size`); strings use `bytes_per_string`.
_ELEMENT_BYTES = {
    "bool": 1, "int8": 1, "uint8": 1, "qint8": 1, "quint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "qint16": 2, "quint16": 2, "float16": 2, "half": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "qint32": 4, "float32": 4, "float": 4,
    "int64": 8, "uint64": 8, "float64": 8, "double": 8, "complex64": 8,
    "complex128": 16,
}
_STRING_NAMES = {"string", "str", "bytes", "object"}
_PYTHON_TYPES = {bool: "bool", int: "int32", float: "float32", complex: "complex128", str: "string", bytes: "string"}


class Partitioner:
    """The base class of partitioners: `partitioner(shape, dtype, axis=0) -> list[int]`.

    Subclass it and define `__call__` to choose your own number of shards;
    return 1 for every axis but the first, which ParameterServerStrategy
    splits (any callable with this signature works as well).

    Examples:
        >>> class TwoShards(ks.experimental.partitioners.Partitioner):
        ...     def __call__(self, shape, dtype, axis=0):
        ...         return [2] + [1] * (len(shape) - 1)
        >>> TwoShards()((10, 3), "float32")
        [2, 1]
    """

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        """The number of shards per axis for a variable of `shape` and `dtype`, split along `axis`.

        Args:
            shape: The variable's shape: a tuple or list of ints, a `tf.TensorShape`
                or a `torch.Size`.
            dtype: The variable's dtype (a name such as `"float32"` or a dtype object).
            axis: The axis to split (ParameterServerStrategy passes 0).

        Returns:
            One int per axis of `shape`: the shards along `axis`, 1 elsewhere.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must define __call__(self, shape, dtype, axis=0) -> list[int]."
        )


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into `num_shards` shards (fewer when it has fewer rows).

    Examples:
        >>> partitioner = ks.experimental.partitioners.FixedShardsPartitioner(num_shards=2)
        >>> partitioner((10, 3), "float32")
        [2, 1]
        >>> partitioner((1, 3), "float32")
        [1, 1]
    """

    def __init__(self, num_shards: int) -> None:
        """Creates a partitioner that always asks for `num_shards` shards (an int >= 1)."""
        self._num_shards = _count("num_shards", num_shards)

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        """`min(num_shards, shape[axis])` shards along `axis`, 1 elsewhere; `dtype` is not used."""
        dims, axis = _dims_and_axis(shape, axis)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least `min_shard_bytes`, and at most `max_shards`.

    Small variables stay whole: one shard whenever the variable is below
    `2 * min_shard_bytes`.

    Examples:
        >>> partitioners = ks.experimental.partitioners
        >>> partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
        [2, 1]
        >>> partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32")
        [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16) -> None:
        """Creates the partitioner.

        Args:
            min_shard_bytes: The least bytes in each shard (default 256 KiB).
            max_shards: The most shards (default 1, i.e. no split: raise it to split).
            bytes_per_string: The estimated size of one element of a string variable.
        """
        if _number("min_shard_bytes", min_shard_bytes) < 1:
            raise ValueError(f"Argument `min_shard_bytes` must be positive. Received: {min_shard_bytes}")
        if _number("max_shards", max_shards) < 1:
            raise ValueError(f"Argument `max_shards` must be positive. Received: {max_shards}")
        if _number("bytes_per_string", bytes_per_string) < 1:
            raise ValueError(f"Argument `bytes_per_string` must be positive. Received: {bytes_per_string}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = _count("max_shards", max_shards)
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        """`ceil(total bytes / min_shard_bytes)` shards along `axis`, within `[1, min(max_shards, shape[axis])]`."""
        dims, axis = _dims_and_axis(shape, axis)
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total_bytes / self._min_shard_bytes
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, int(math.ceil(partitions))))
        return result

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """The fewest shards that keep each at most `max_shard_bytes` (but at most `max_shards`).

    A shard holds at least one row, so a variable whose rows are larger than
    `max_shard_bytes` gets one shard per row; hitting `max_shards` makes the
    shards larger than `max_shard_bytes`.

    Examples:
        >>> partitioners = ks.experimental.partitioners
        >>> partitioners.MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
        [6, 1]
        >>> partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32")
        [2, 1]
        >>> partitioners.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32")
        [1, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16) -> None:
        """Creates the partitioner.

        Args:
            max_shard_bytes: The most bytes in each shard.
            max_shards: The most shards, which wins over `max_shard_bytes`
                (`None`, the default, or 0: no limit, as in TensorFlow).
            bytes_per_string: The estimated size of one element of a string variable.
        """
        if _number("max_shard_bytes", max_shard_bytes) < 1:
            raise ValueError(f"Argument `max_shard_bytes` must be positive. Received {max_shard_bytes}")
        if max_shards is not None and _number("max_shards", max_shards) and max_shards < 1:
            raise ValueError(f"Argument `max_shards` must be positive. Received {max_shards}")
        if _number("bytes_per_string", bytes_per_string) < 1:
            raise ValueError(f"Argument `bytes_per_string` must be positive. Received: {bytes_per_string}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = None if not max_shards else _count("max_shards", max_shards)
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        """`ceil(rows / rows per shard)` shards along `axis`, capped at `max_shards`.

        A variable with no elements has nothing to split: one shard.
        """
        dims, axis = _dims_and_axis(shape, axis)
        element_bytes = _element_bytes(dtype, self._bytes_per_string)
        result = [1] * len(dims)
        if math.prod(dims) == 0:
            return result
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element_bytes
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        axis_shards = int(math.ceil(1.0 * dims[axis] / slices_per_shard))
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result[axis] = axis_shards
        return result

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


def _number(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Argument `{name}` must be a positive number. Received: {value!r}")
    return value


def _count(name: str, value: Any) -> int:
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None:
        raise ValueError(f"Argument `{name}` must be a positive integer. Received: {value!r}")
    if count < 1:
        raise ValueError(f"Argument `{name}` must be positive. Received: {value}")
    return count


def _dims_and_axis(shape: Any, axis: Any) -> tuple[list[int], int]:
    """The shape as a list of ints and `axis` as an index into it, or a clear error."""
    if hasattr(shape, "as_list"):  # tf.TensorShape
        if getattr(shape, "rank", 0) is None:
            raise ValueError(f"shape is not fully defined: {shape}")
        raw: Sequence[Any] = shape.as_list()
    elif isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ValueError(f"`shape` must be a sequence of ints (e.g. (1024, 64)), got {shape!r}.")
    else:
        raw = list(shape)
    dims = []
    for dim in raw:
        if dim is None:
            raise ValueError(f"shape is not fully defined: {shape}")
        try:
            dims.append(operator.index(dim) if not isinstance(dim, bool) else None)
        except TypeError:
            dims.append(None)
        if dims[-1] is None or dims[-1] < 0:
            raise ValueError(f"`shape` must be a sequence of ints >= 0, got {shape!r}.")
    try:
        index = None if isinstance(axis, bool) else operator.index(axis)
    except TypeError:
        index = None
    if index is None:
        raise ValueError(f"`axis` must be an int, got {axis!r}.")
    if not -len(dims) <= index < len(dims):
        hint = " (a scalar has no axis to split; ParameterServerStrategy leaves scalars whole)" if not dims else ""
        raise ValueError(f"Cannot partition variable along axis {axis} when shape is only {tuple(dims)}{hint}")
    return dims, index % len(dims)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, type) and dtype in _PYTHON_TYPES:
        return _PYTHON_TYPES[dtype]
    name = getattr(dtype, "name", None)  # tf.DType, np.dtype
    if isinstance(name, str):
        return name
    name = getattr(dtype, "__name__", None)  # np.float32, jnp.float32
    if isinstance(name, str):
        return name
    return str(dtype).rpartition(".")[2]  # torch.float32


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    """TensorFlow's `DType.size` of `dtype`, or `bytes_per_string` for strings."""
    name = _dtype_name(dtype)
    if name in _STRING_NAMES:
        return bytes_per_string
    if name in _ELEMENT_BYTES:
        return _ELEMENT_BYTES[name]
    try:
        return int(np.dtype(name).itemsize)
    except TypeError:
        pass
    raise ValueError(f"Unknown dtype {dtype!r}: give a dtype such as 'float32' or a NumPy/framework dtype.")
