"""Clipping in pieces equals Keras' clipping of the whole gradients (`clipnorm`, `global_clipnorm`,
`clipvalue`): the norms' squares added across pieces, the same formulas."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_strategies.sharding import flat_shards, gradient_pieces


@pytest.mark.parametrize("clip", [dict(clipnorm=0.7), dict(global_clipnorm=0.9), dict(clipvalue=0.2), {}])
@pytest.mark.parametrize("n", [2, 3])
def test_clipped_pieces_join_to_keras_clipped_gradients(clip, n):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=shape).astype("float32") for shape in ((5, 7), (7,), ())]
    grads.append(np.zeros((3,), "float32"))  # a zero gradient: its norm is 0
    optimizer = keras.optimizers.SGD(**clip)
    expected = optimizer._clip_gradients([ops.convert_to_tensor(g) for g in grads])
    cut = [flat_shards.split(ops.convert_to_tensor(g), n) for g in grads]
    squares = [gradient_pieces.summed([ops.sum(ops.square(piece)) for piece in pieces]) for pieces in cut]
    factors = gradient_pieces.clip_factors(optimizer, squares) if gradient_pieces.clipping(optimizer) in (
        "norm", "global") else []
    for k, (g, pieces) in enumerate(zip(expected, cut)):
        clipped = [gradient_pieces.clip_piece(optimizer, piece, k, factors) for piece in pieces]
        np.testing.assert_allclose(ops.convert_to_numpy(flat_shards.join(clipped, g.shape)),
                                   ops.convert_to_numpy(g), rtol=1e-6, atol=1e-7)


def test_clipping_follows_keras_precedence():
    assert gradient_pieces.clipping(keras.optimizers.SGD(clipnorm=1.0)) == "norm"
    assert gradient_pieces.clipping(keras.optimizers.SGD(global_clipnorm=1.0)) == "global"
    assert gradient_pieces.clipping(keras.optimizers.SGD(clipvalue=1.0)) == "value"
    assert gradient_pieces.clipping(keras.optimizers.SGD()) is None
