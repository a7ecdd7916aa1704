"""The replicas' shared state (the model's variables) sent to the mesh in one buffer per dtype.

A compiled step hands every replica the same variables. `jax.device_put` of a
list of arrays to a replicated sharding makes one transfer per array (about 0.7
ms for a small model's 16 arrays on 2 CPU devices), while one jitted
concatenation and one transfer of its result take about 0.16 ms. The program
cuts the buffers back into arrays, which XLA does without copies.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# A leaf's place in the buffers: (dtype name, shape, offset into its dtype's buffer).
Layout = tuple


def layout_of(leaves: Sequence[Any]) -> Layout:
    """Where each leaf goes, grouped by dtype in order of first appearance (hashable: a trace key)."""
    ends: dict = {}
    entries = []
    for leaf in leaves:
        dtype, shape = np.dtype(leaf.dtype).name, tuple(leaf.shape)
        offset = ends.get(dtype, 0)
        ends[dtype] = offset + int(np.prod(shape, dtype=np.int64))
        entries.append((dtype, shape, offset))
    return tuple(entries)


def _dtypes(layout: Layout) -> list:
    return list(dict.fromkeys(dtype for dtype, _, _ in layout))


def _pack(leaves: Sequence[Any], layout: Layout) -> tuple:
    return tuple(
        jnp.concatenate([jnp.reshape(leaf, (-1,)) for leaf, entry in zip(leaves, layout) if entry[0] == dtype])
        for dtype in _dtypes(layout)
    )


_pack_jitted = jax.jit(_pack, static_argnums=1)


def pack(leaves: Sequence[Any], layout: Layout, device: "jax.Device") -> tuple:
    """`leaves` as one flat buffer per dtype on `device` (one dispatch)."""
    leaves = [leaf if _only_on(leaf, device) else jax.device_put(leaf, device) for leaf in leaves]
    return _pack_jitted(leaves, layout)


def unpack(buffers: Sequence[Any], layout: Layout) -> list:
    """The leaves again, inside a traced program (slices and reshapes, no copies)."""
    by_dtype = dict(zip(_dtypes(layout), buffers))
    return [
        jnp.reshape(by_dtype[dtype][offset:offset + int(np.prod(shape, dtype=np.int64))], shape)
        for dtype, shape, offset in layout
    ]


def _only_on(leaf: Any, device: "jax.Device") -> bool:
    """Whether `leaf` is an array on `device` alone (a jitted pack would refuse arrays elsewhere)."""
    return isinstance(leaf, jax.Array) and leaf.sharding.device_set == {device}
