"""Padding rows of replica shards: copies of real rows, not zeros.

Shards get padding rows where the engine needs equal shapes (JAX's SPMD
program) and where a replica has no rows but must still take part in the step.
Their loss, gradient and statistics are weighted 0, but `0 * NaN` is NaN: a
model that is undefined on a row of zeros (it normalises its input, takes a
logarithm of a feature, or its loss normalises unnormalised outputs, as
`categorical_crossentropy` does) would turn the whole step into NaN, where one
device, which never sees such a row, trains normally. Copies of real rows give
the model nothing it has not been given already. Sample weights are padded
with zeros: they are multipliers, not model inputs, and a zero weight is what
keeps a padding row out of a weighted loss.

A process whose batch has no rows at all (a worker whose own input ran out)
copies the last real row it padded with, and uses zeros only before it has
seen any.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import keras
from keras.src import tree

_last_source: Optional[tuple] = None  # (signature, one-row structure) of the last batch with rows


def _as_array(leaf: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(leaf))


def _signature(structure: Any) -> tuple:
    return tuple(
        None if leaf is None else (tuple(np.shape(leaf)[1:]), str(_as_array(leaf).dtype))
        for leaf in tree.flatten(structure)
    )


def source_rows(structure: Any) -> Any:
    """One real row of each leaf of `structure` (a batch), for padding.

    From the batch itself when it has rows, else the last batch of the same
    shapes that had some, else zeros.
    """
    global _last_source
    arrays = tree.map_structure(lambda leaf: None if leaf is None else _as_array(leaf), structure)
    signature = _signature(arrays)
    leaves = [leaf for leaf in tree.flatten(arrays) if leaf is not None and leaf.ndim > 0]
    if leaves and all(leaf.shape[0] > 0 for leaf in leaves):
        rows = tree.map_structure(lambda leaf: None if leaf is None else leaf[:1].copy(), arrays)
        _last_source = (signature, rows)
        return rows
    if _last_source is not None and _last_source[0] == signature:
        return _last_source[1]
    return tree.map_structure(
        lambda leaf: None if leaf is None else np.zeros((1,) + leaf.shape[1:], leaf.dtype), arrays
    )


def pad_with_copies(structure: Any, rows: int, source: Any) -> Any:
    """Each leaf of `structure` grown to `rows` rows with copies of its own rows, in order.

    A leaf without rows is filled with its row of `source` (`source_rows`).
    """

    def pad(leaf: Any, source_leaf: Any) -> Any:
        if leaf is None:
            return None
        array = _as_array(leaf)
        if array.shape[0] == rows:
            return array
        copies_of = array if array.shape[0] > 0 else _as_array(source_leaf)
        extra = np.take(copies_of, np.arange(rows - array.shape[0]) % copies_of.shape[0], axis=0)
        return np.concatenate([array, extra], axis=0)

    return tree.map_structure(pad, structure, source)


def pad_with_zeros(structure: Any, rows: int) -> Any:
    """Each leaf of `structure` grown to `rows` rows with zeros (sample weights)."""

    def pad(leaf: Any) -> Any:
        if leaf is None:
            return None
        array = _as_array(leaf)
        if array.shape[0] == rows:
            return array
        padding = np.zeros((rows - array.shape[0],) + array.shape[1:], dtype=array.dtype)
        return np.concatenate([array, padding], axis=0)

    return tree.map_structure(pad, structure)
