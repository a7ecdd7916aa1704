"""Stage 2's gradients: each replica's own, reduce-scattered into pieces, and clipped in pieces.

The replicas' gradients are not all-reduced: each replica cuts its own into N
pieces (`flat_shards.split`), piece i of every replica goes to device i and is
summed there, in replica order, so no device holds a whole summed gradient.
Clipping reads norms of whole gradients: each device sums the squares of its
pieces, the host adds those scalars, and each device scales its pieces, with
the formulas of Keras' own `clipnorm`, `global_clipnorm` and `clipvalue`
(`BaseOptimizer._clip_gradients`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from keras import ops


@dataclasses.dataclass
class ReplicaGradients:
    """Every replica's own gradients, not summed yet: `per_replica[r][j]` on replica r's device."""

    per_replica: list


def clipping(optimizer: Any) -> Optional[str]:
    """Which of Keras' clippings the optimizer applies, in `_clip_gradients`' order of precedence."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return "norm"
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        return "global"
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        return "value"
    return None


def summed(pieces: Sequence[Any]) -> Any:
    """The pieces added in order (replica 0 first), as one device adds a reduction's parts."""
    total = pieces[0]
    for piece in pieces[1:]:
        total = ops.add(total, piece)
    return total


def clip_factors(optimizer: Any, squared_sums: Sequence[Any]) -> list:
    """From each variable's sum of squared gradient elements: what `clip_piece` takes (per variable
    for `clipnorm`, one for `global_clipnorm`)."""
    if clipping(optimizer) == "norm":
        bounds = []
        for l2sum in squared_sums:
            positive = l2sum > 0
            l2norm = ops.where(positive, ops.sqrt(ops.where(positive, l2sum, ops.ones_like(l2sum))), l2sum)
            bounds.append(ops.maximum(l2norm, optimizer.clipnorm))
        return bounds
    clip_norm = optimizer.global_clipnorm
    use_norm = ops.sqrt(ops.sum(ops.stack(list(squared_sums))))
    return [clip_norm * ops.minimum(1.0 / use_norm, 1.0 / clip_norm) + (use_norm - use_norm)]


def clip_piece(optimizer: Any, piece: Any, k: int, factors: Sequence[Any]) -> Any:
    """Variable k's piece of the summed gradient, clipped as the optimizer clips whole gradients."""
    kind = clipping(optimizer)
    if kind == "norm":
        return ops.convert_to_tensor(ops.multiply(piece, optimizer.clipnorm)) / factors[k]
    if kind == "global":
        return piece * factors[0]
    if kind == "value":
        return ops.clip(piece, -optimizer.clipvalue, optimizer.clipvalue)
    return piece
