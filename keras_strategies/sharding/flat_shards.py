"""Equal pieces of a tensor for N devices: flattened, zero-padded to a multiple of N, cut in N.

Flat pieces take any shape, a first dimension that does not divide by N and
scalars alike (as DeepSpeed's and FSDP's flat parameters do); every device's
piece has the same length, so each device's programs see one shape.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import keras
import numpy as np
from keras import ops


def piece_length(shape: Sequence[int], num_pieces: int) -> int:
    """Elements in each of the `num_pieces` pieces of a tensor of `shape` (the last ones padded)."""
    return max(1, math.ceil(math.prod(shape) / num_pieces))


def split(value: Any, num_pieces: int) -> list:
    """`value` flattened, zero-padded and cut into `num_pieces` pieces of `piece_length` elements."""
    shape = tuple(value.shape)
    length = piece_length(shape, num_pieces)
    flat = ops.reshape(value, (-1,))
    padding = length * num_pieces - math.prod(shape)
    if padding:
        flat = ops.concatenate([flat, ops.zeros((padding,), dtype=flat.dtype)])
    return [flat[i * length:(i + 1) * length] for i in range(num_pieces)]


def join(pieces: Sequence[Any], shape: Sequence[int]) -> Any:
    """The tensor of `shape` that `split` cut into `pieces` (their padding dropped)."""
    flat = pieces[0] if len(pieces) == 1 else ops.concatenate(list(pieces))
    return ops.reshape(flat[:math.prod(shape)], tuple(shape))


def itemsize(value: Any) -> int:
    """The bytes of one element of an array (or variable), also inside a trace."""
    return np.dtype(keras.backend.standardize_dtype(value.dtype)).itemsize
