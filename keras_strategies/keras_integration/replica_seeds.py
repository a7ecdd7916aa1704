"""Random draws in a replica differ from replica to replica, as rows do on one device.

Keras layers draw their randomness (Dropout, GaussianNoise, random
augmentation) from a `SeedGenerator`, whose state is a variable: mirrored
like every other, so the same on every replica. Each replica would then draw
the same numbers for its shard, and a global batch split over N replicas would
repeat one dropout mask N times: N times less independent noise than one
device draws for the same batch. (Keras' own tf.distribute path does this.)

Inside a replica context of several replicas, each seed drawn is offset by
the replica's id in the sync group (all workers included). The state itself
advances as in Keras, the same on every replica, so it stays mirrored. One
replica, and code outside strategies, draw exactly what Keras draws.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from keras_strategies.backend.common import patches
from keras_strategies.distribute import context

# Odd and large: replica r's seeds are (seed + r * STRIDE, counter), modulo 2**32.
STRIDE = 0x3C6EF373


def replica_offset(seed: Any, replica_id: Any) -> Any:
    """`seed` (Keras' `[seed, counter]`) for replica `replica_id`, in `seed`'s dtype."""
    dtype = standardize_dtype(seed.dtype)
    if isinstance(replica_id, (int, np.integer)):
        offset = (int(replica_id) * STRIDE) % 2**32
        if dtype == "int32":  # two's complement: int32 sums wrap like uint32 ones
            offset -= 2**32 * (offset >= 2**31)
        return ops.add(seed, ops.convert_to_tensor(np.array([offset, 0], dtype)))
    # A traced id (JAX's compiled replicas, seeds in uint32): the product wraps modulo 2**32.
    offset = ops.multiply(ops.cast(replica_id, dtype), ops.convert_to_tensor(np.array(STRIDE, dtype)))
    return ops.add(seed, ops.stack([offset, ops.zeros((), dtype)]))


def _wrap_next(original: Callable) -> Callable:
    @functools.wraps(original)
    def next(self, ordered=True):
        seed = original(self, ordered)
        replica = context.get_replica_context() if context.has_strategy() else None
        if replica is None or replica.num_replicas_in_sync == 1:
            return seed
        replica._leaves_rows_out([self.state])  # a counter: no rows in it
        return replica_offset(seed, replica.replica_id_in_sync_group)

    return next


_NEXT = patches.declare("keras.src.random.seed_generator.SeedGenerator.next",
                        "replicas draw different random numbers, as rows do on one device")


def install() -> None:
    """Installs the hook on `SeedGenerator.next` (idempotent)."""
    _NEXT.apply(_wrap_next)
