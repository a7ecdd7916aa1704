"""Summed gradients kept in pieces, one per device (ZeRO stage 2), and their clipping.

The replicas' gradients are reduce-scattered: piece i of every replica's
gradient (`flat_shards.split`) is summed onto device i, so no device holds a
whole summed gradient. Clipping reads norms of whole gradients: each device
sums the squares of its pieces, the host adds those scalars, and each device
scales its pieces, with the formulas of Keras' own `clipnorm`,
`global_clipnorm` and `clipvalue`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from keras import ops

from keras_strategies.backend import engine


@dataclasses.dataclass
class GradientPieces:
    """`pieces[i][j]`: device `devices[i]`'s piece of the summed gradient of variable j (None: no gradient)."""

    pieces: list
    devices: tuple

    @property
    def present(self) -> list:
        """The variables that have a gradient."""
        return [j for j, piece in enumerate(self.pieces[0]) if piece is not None]

    def map(self, fn: Any) -> "GradientPieces":
        """`fn(piece, i, j)` of every piece, on its device."""
        mapped = []
        for i, (device, row) in enumerate(zip(self.devices, self.pieces)):
            with engine.devices.device_scope(device):
                mapped.append([None if g is None else fn(g, i, j) for j, g in enumerate(row)])
        return GradientPieces(mapped, self.devices)

    def squared_sums(self, host: str) -> dict:
        """The sum of squares of each variable's whole gradient, on `host`: {j: scalar}."""
        partial = self.map(lambda g, i, j: ops.sum(ops.square(g)))
        with engine.devices.device_scope(host):
            return {j: sum_in_order([engine.devices.copy_to(row[j], host) for row in partial.pieces])
                    for j in self.present}


def sum_in_order(values: Sequence[Any]) -> Any:
    total = values[0]
    for value in values[1:]:
        total = ops.add(total, value)
    return total


def unscale_and_clip(optimizer: Any, gradients: GradientPieces, host: str) -> GradientPieces:
    """`gradients` unscaled by the optimizer's `loss_scale_factor` and clipped as its `_clip_gradients`
    clips whole gradients."""
    scale = optimizer.loss_scale_factor
    if scale is not None:
        gradients = gradients.map(lambda g, i, j: g / scale)
    devices = gradients.devices
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        clipnorm = optimizer.clipnorm
        with engine.devices.device_scope(host):
            bounds = {}
            for j, l2sum in gradients.squared_sums(host).items():
                positive = l2sum > 0
                l2norm = ops.where(positive, ops.sqrt(ops.where(positive, l2sum, ops.ones_like(l2sum))), l2sum)
                bounds[j] = ops.maximum(l2norm, clipnorm)
        bounds_on = [{j: engine.devices.copy_to(b, device) for j, b in bounds.items()} for device in devices]
        return gradients.map(lambda g, i, j: ops.convert_to_tensor(ops.multiply(g, clipnorm)) / bounds_on[i][j])
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        clip_norm = optimizer.global_clipnorm
        with engine.devices.device_scope(host):
            sums = gradients.squared_sums(host)
            use_norm = ops.sqrt(ops.sum(ops.stack([sums[j] for j in gradients.present])))
            factor = clip_norm * ops.minimum(1.0 / use_norm, 1.0 / clip_norm) + (use_norm - use_norm)
        factors = [engine.devices.copy_to(factor, device) for device in devices]
        return gradients.map(lambda g, i, j: g * factors[i])
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        v = optimizer.clipvalue
        return gradients.map(lambda g, i, j: ops.clip(g, -v, v))
    return gradients
