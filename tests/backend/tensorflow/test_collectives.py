"""The TensorFlow engine's cross-worker packing plan, which needs no second process."""

import numpy as np
import pytest
import tensorflow as tf

from keras_strategies.backend.tensorflow import collectives

TENSORS = [
    np.zeros((600, 600), "float32"),  # 1.4 MB
    np.zeros((5,), "float32"),
    np.zeros((7,), "int32"),
    np.zeros((), "float32"),
    np.zeros((300, 1000), "float32"),  # 1.2 MB
    np.zeros((3,), "int32"),
]


@pytest.mark.parametrize(
    "bytes_per_pack, expected",
    [
        (0, [[0, 1, 3, 4], [2, 5]]),  # one pack per dtype, as TF's MultiWorkerMirroredStrategy packs
        (1 << 20, [[0], [1, 3, 4], [2, 5]]),  # TF's size grouping closes a pack once it is past the limit
        (16, [[0], [1], [3, 4], [2], [5]]),
    ],
)
def test_one_pack_per_dtype_split_by_bytes_per_pack(monkeypatch, bytes_per_pack, expected):
    monkeypatch.setitem(collectives._state, "bytes_per_pack", bytes_per_pack)
    assert collectives._pack_plan([tf.constant(t) for t in TENSORS]) == expected
