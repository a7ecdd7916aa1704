"""Distributed values: one value per replica, as `tf.distribute.DistributedValues`.

`PerReplica` holds values that may differ between replicas (what `run` returns,
dataset elements); `Mirrored` holds values kept identical on every replica.
`regroup` turns a list of per-replica results back into one structure.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Sequence

import numpy as np


class DistributedValues:
    """Base class for a value that has one component per local replica.

    As `tf.distribute.DistributedValues`: `strategy.run` returns them and
    takes them as arguments, and each replica sees its own component.
    `strategy.experimental_local_results` (or `.values`) gives the components.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> value = strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group)
        >>> isinstance(value, ks.DistributedValues), value.values
        (True, (0, 1))
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple:
        """The per-replica components, in replica order (this worker only).

        Examples:
            >>> ks.PerReplica([1.0, 2.0]).values
            (1.0, 2.0)
        """
        return self._values

    def _get_on_replica(self, replica_id: int) -> Any:
        return self._values[replica_id]

    def __len__(self) -> int:
        return len(self._values)

    # TensorFlow's nest protocol: `tf.function` traces through the components instead of
    # treating a distributed value as an opaque (retrace-every-call) Python object.
    def __tf_flatten__(self):
        return len(self._values), self._values

    @classmethod
    def __tf_unflatten__(cls, metadata, components):
        return cls(components)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {inner}\n}}"


class PerReplica(DistributedValues):
    """Values that may differ between replicas: what `run` returns, elements of distributed datasets.

    As TensorFlow's `PerReplica`. Passed to `strategy.run`, each replica gets
    its own component; build one by hand for tests or with
    `strategy.experimental_distribute_values_from_function`.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> per_replica = ks.PerReplica([1.0, 2.0])
        >>> strategy.run(lambda x: x * 10, args=(per_replica,))
        PerReplica:{
          0: 10.0,
          1: 20.0
        }
    """


class Mirrored(DistributedValues):
    """Values kept identical on every replica, one copy per device, as TensorFlow's `Mirrored`.

    `strategy.extended.broadcast_to` and `CrossDeviceOps.broadcast` return them.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> mirrored = strategy.extended.broadcast_to(keras.ops.ones(()), destinations=["cpu:0", "cpu:1"])
        >>> isinstance(mirrored, ks.Mirrored), len(mirrored.values)
        (True, 2)
    """


def is_distributed(value: Any) -> bool:
    return isinstance(value, DistributedValues)


def _is_leaf(value: Any) -> bool:
    return not isinstance(value, (list, tuple, dict))


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Maps `fn` over matching leaves; lists, tuples (incl. namedtuples) and dicts are nodes.

    Distributed values are leaves, so the structure of a `PerReplica` is preserved.
    """
    first = structures[0]
    if isinstance(first, dict):
        return type(first)((k, map_structure(fn, *(s[k] for s in structures))) for k in first)
    if isinstance(first, (list, tuple)):
        items = [map_structure(fn, *parts) for parts in zip(*structures)]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*items)
        return type(first)(items)
    return fn(*structures)


def flatten(structure: Any) -> list:
    leaves: list = []
    map_structure(leaves.append, structure)
    return leaves


def select_replica(replica_id: int, structure: Any) -> Any:
    """The component of every distributed leaf of `structure` for one replica."""
    return map_structure(
        lambda v: v._get_on_replica(replica_id) if is_distributed(v) else v, structure
    )


def _same_python_value(values: Sequence[Any]) -> bool:
    first = values[0]
    if all(v is first for v in values):
        return True
    if isinstance(first, (int, float, str, bool, type(None))) and not isinstance(first, np.generic):
        return all(type(v) is type(first) and v == first for v in values)
    return False


# A one-device strategy's distributed values are plain arrays (as in TensorFlow), which cannot
# carry their strategy: the arrays of its latest elements are noted here, weakly.
_PLAIN_NOTED = 64
_plain_values: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()


def tag_strategy(structure: Any, strategy: Any) -> Any:
    """`structure`, its distributed values noted as `strategy`'s (a compiled step finds its
    strategy by them: `traced_function.py`); plain values (one device) are noted weakly."""
    for leaf in flatten(structure):
        if isinstance(leaf, DistributedValues):
            leaf._ks_strategy = strategy
        else:
            try:
                _plain_values[id(leaf)] = (weakref.ref(leaf), weakref.ref(strategy))
            except TypeError:  # a Python number: nothing to find it by
                continue
            _plain_values.move_to_end(id(leaf))
            while len(_plain_values) > _PLAIN_NOTED:
                _plain_values.popitem(last=False)
    return structure


def strategy_of(value: Any) -> Any:
    """The strategy whose distributed values `value` is one of (`tag_strategy`), or None."""
    strategy = getattr(value, "_ks_strategy", None)
    if strategy is None and id(value) in _plain_values:
        leaf, owner = _plain_values[id(value)]
        strategy = owner() if leaf() is value else None
    return strategy


def regroup(per_replica: Sequence[Any], wrap_class: type = PerReplica, arrays_stay_distributed: bool = False) -> Any:
    """Inverse of `select_replica`: a list of per-replica structures becomes one structure.

    Leaves that are the same object (or equal Python scalars / `None`) on every
    replica collapse to that value, as in `tf.distribute` (returning `3` gives `3`).
    `arrays_stay_distributed`: arrays do not collapse (in a compiled program, a
    replica sum gives every replica the same array, which eager replicas hold apart).
    """
    if len(per_replica) == 1:
        return per_replica[0]

    def merge(*leaves):
        if arrays_stay_distributed and hasattr(leaves[0], "shape") and hasattr(leaves[0], "dtype"):
            return wrap_class(leaves)
        if _same_python_value(leaves):
            return leaves[0]
        return wrap_class(leaves)

    return map_structure(merge, *per_replica)
