"""NCCL between this process's GPUs on JAX: XLA's all-reduce over the devices (`psum`).

`ks.NcclAllReduce` hands each pack here. The values become one array split
over the devices (no copy) and one compiled `psum` sums them; XLA runs that
all-reduce with NCCL on GPUs (on CPU devices, with its own CPU collectives).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.backend.jax.devices import jax_device

AXIS = "devices"
_programs: dict = {}


def program(devices: Sequence[str]) -> tuple[Callable, NamedSharding]:
    """The compiled sum over `devices` (one `psum` of all its operands) and the split it takes."""
    key = tuple(devices)
    if key not in _programs:
        mesh = Mesh(np.array([jax_device(d) for d in devices]), (AXIS,))
        summed = jax.shard_map(lambda *blocks: jax.lax.psum(list(blocks), AXIS), mesh=mesh,
                               in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)
        _programs[key] = jax.jit(summed), NamedSharding(mesh, P(AXIS))
    return _programs[key]


def split_arrays(per_value: Sequence[Sequence[Any]], devices: Sequence[str]) -> list:
    """Each value's parts as one array with a leading axis split over `devices`."""
    _, split = program(devices)
    targets = [jax_device(d) for d in devices]
    arrays = []
    for components in per_value:
        blocks = [jnp.expand_dims(jax.device_put(c, device), 0) for c, device in zip(components, targets)]
        arrays.append(jax.make_array_from_single_device_arrays((len(blocks),) + blocks[0].shape[1:], split, blocks))
    return arrays


def all_reduce_sum(per_value: Sequence[Sequence[Any]], devices: Sequence[str]) -> list:
    """`per_value[k][i]` is value k's part on device `devices[i]`; returns value k's sum on each of them."""
    compiled, _ = program(devices)
    outputs = compiled(*split_arrays(per_value, devices))
    targets = [jax_device(d) for d in devices]
    results = []
    for output in outputs:
        blocks = {shard.device: shard.data for shard in output.addressable_shards}
        results.append([blocks[device][0] for device in targets])
    return results
