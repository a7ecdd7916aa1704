"""The layout of a cross-worker all-reduce: small tensors packed per dtype, large ones alone."""

import numpy as np
import pytest

from keras_strategies.backend.common import packing


def test_large_values_that_may_go_alone_do_and_the_rest_is_packed_by_dtype():
    values = [np.zeros(3, "float32"), np.zeros(4, "int32"), np.zeros(5, "float32"), np.zeros(6, "float32")]
    nbytes = [12, 16, packing.SEPARATE_BYTES, packing.SEPARATE_BYTES + 1]
    alone, groups = packing.plan([v.dtype for v in values], nbytes, [True, True, False, True])
    assert alone == [3]
    assert groups == [[0, 2], [1]]  # index 2 is large but may not go alone (kept by its caller)


def test_donation_flags_are_one_per_value():
    assert packing.per_value(True, 3) == [True, True, True]
    assert packing.per_value([1, 0], 2) == [True, False]
    with pytest.raises(ValueError, match="Expected 3 donation flags"):
        packing.per_value([True], 3)
