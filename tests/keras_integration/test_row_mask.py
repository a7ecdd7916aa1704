"""`spread_rows`: a shard's row mask over per-row tensors of any rank."""

import numpy as np
from keras import backend, ops

from keras_strategies.keras_integration.row_mask import spread_rows


def test_spreads_along_rows_even_when_another_dimension_equals_the_row_count():
    mask = np.array([1.0, 1.0, 0.0], "float32")
    like = ops.zeros((3, 3, 2), "float32")  # Keras' rank rule would align the mask with the last axis
    spread = ops.convert_to_numpy(spread_rows(mask, like))
    assert spread.shape == (3, 3, 2)
    np.testing.assert_array_equal(spread[:2], 1.0)
    np.testing.assert_array_equal(spread[2], 0.0)


def test_takes_the_requested_dtype_and_is_a_new_tensor_that_can_be_scaled_in_place():
    like = ops.ones((2, 4), "float16")
    spread = spread_rows(np.array([True, False]), like, "float32")
    assert backend.standardize_dtype(spread.dtype) == "float32"
    # Keras multiplies sample weights in place (`*=`), which torch refuses on a broadcast view.
    spread *= 2.0
    np.testing.assert_array_equal(ops.convert_to_numpy(spread), [[2.0] * 4, [0.0] * 4])
