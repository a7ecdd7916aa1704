"""The row mask of a replica's shard, spread over a per-row tensor.

A replica step marks which rows of a (padded) shard are real with a `(rows,)`
mask. Losses and BatchNormalization weigh per-row tensors of any rank with it,
so it is spread over their full shape first: Keras' own rank rule
(`squeeze_or_expand_to_same_rank`) would broadcast it along the wrong axis.
"""

from __future__ import annotations

from typing import Any, Optional

from keras import ops


def spread_rows(mask: Any, like: Any, dtype: Optional[str] = None) -> Any:
    """`mask` (rows,) over `like`'s full shape, in `dtype` (default `like`'s).

    A new tensor, not a broadcast view: Keras multiplies sample weights in
    place, which torch refuses on a view.
    """
    dtype = dtype or like.dtype
    mask = ops.reshape(ops.cast(mask, dtype), (-1,) + (1,) * (len(like.shape) - 1))
    return mask * ops.ones_like(like, dtype=dtype)
