"""JAX replicas: one SPMD program over a device mesh (`jax.shard_map`).

Every replica runs the same traced function on its shard; `all_reduce` is
`jax.lax.psum` over the replica axis, JAX's own collective, differentiable.
SPMD needs equal shard shapes, so callers pad shards to the same size and
pass a mask (see `EQUAL_SHARDS`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from keras.src import tree

from keras_strategies.backend.jax.devices import jax_device

EQUAL_SHARDS = True
NATIVE_SYNC_BATCH_NORM = False
AXIS = "replica"

_in_replica_program = {"active": False}


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas of the current program (inside a replica function)."""
    if not _in_replica_program["active"]:
        return value
    return jax.lax.psum(value, AXIS)


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (equal shapes under SPMD)."""
    if not _in_replica_program["active"]:
        return jnp.asarray(value)
    return jax.lax.all_gather(value, AXIS, axis=axis, tiled=True)


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica.

    `shared` is replicated on the mesh; `per_replica` entries must have equal
    shapes. Results come back as one list entry per replica, each on its device.
    """
    mesh = Mesh(np.array([jax_device(d) for d in devices]), (AXIS,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    def body(shared, stacked):
        own = tree.map_structure(lambda leaf: None if leaf is None else leaf[0], stacked)
        _in_replica_program["active"] = True
        try:
            outputs = fn(jax.lax.axis_index(AXIS), *shared, *own)
        finally:
            _in_replica_program["active"] = False
        return tree.map_structure(lambda leaf: None if leaf is None else jnp.expand_dims(leaf, 0), outputs)

    program = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS), check_vma=False)
    program = jax.jit(program) if compiled else program

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        stacked = tree.map_structure(
            lambda *leaves: None if leaves[0] is None else jax.device_put(np.stack([np.asarray(l) for l in leaves]), split),
            *per_replica,
        )
        shared = jax.device_put(shared, replicated)
        outputs = program(tuple(shared), tuple(stacked))
        by_device = {device: i for i, device in enumerate(mesh.devices.flat)}

        def component(leaf, replica_id):
            if leaf is None:
                return None
            shard = next(s for s in leaf.addressable_shards if by_device[s.device] == replica_id)
            return shard.data[0]

        return [tree.map_structure(lambda leaf: component(leaf, i), outputs) for i in range(len(devices))]

    return run
