"""Packing a list of tensors into one flat buffer per dtype for a cross-worker all-reduce.

Engines whose collective takes one buffer (gloo on JAX and PyTorch) share
this: one all-reduce per dtype instead of one per tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def group_by_dtype(values: Sequence[Any]) -> list[list[int]]:
    """Indices of `values`, grouped by dtype in order of first appearance."""
    groups: dict = {}
    for i, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(i)
    return list(groups.values())


def packed_sum(values: Sequence[Any], concat_flat: Callable[[list], Any], all_reduce_flat: Callable[[Any], Any],
               restore: Callable[[Any, Any], Any]) -> list:
    """Sums `values` across workers, one flat all-reduce per dtype.

    `concat_flat(tensors)` packs tensors of one dtype into a 1-D buffer,
    `all_reduce_flat(buffer)` returns the summed buffer, and
    `restore(piece, like)` turns a slice of it back into a tensor shaped like `like`.
    """
    outputs: list = [None] * len(values)
    for indices in group_by_dtype(values):
        total = all_reduce_flat(concat_flat([values[i] for i in indices]))
        offset = 0
        for i in indices:
            size = int(values[i].size) if not callable(getattr(values[i], "numel", None)) else values[i].numel()
            outputs[i] = restore(total[offset:offset + size], values[i])
            offset += size
    return outputs
