"""`ks.experimental.partitioners`: TensorFlow's results and errors, on every backend.

Golden values come from TensorFlow's documentation and runs; under the
TensorFlow backend every result is also compared with
`tf.distribute.experimental.partitioners` itself.
"""

from __future__ import annotations

import itertools
import re

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.experimental import partitioners
from keras_strategies.experimental.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

MIB = 1 << 20


def test_the_module_is_ks_experimental_partitioners_and_importable_by_its_path():
    import keras_strategies.experimental.partitioners as imported

    assert imported is partitioners is ks.experimental.partitioners
    assert sorted(partitioners.__all__) == [
        "FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
    for name in partitioners.__all__[:3]:
        assert issubclass(getattr(partitioners, name), Partitioner)


@pytest.mark.parametrize(
    "partitioner, shape, dtype, expected",
    [
        (FixedShardsPartitioner(5), (13, 1024), "float32", [5, 1]),
        (FixedShardsPartitioner(20), (13, 1024), "float32", [13, 1]),
        (FixedShardsPartitioner(num_shards=2), (10, 3), "float32", [2, 1]),
        (MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=4), (1024, 1024), "float32", [4, 1]),
        (MinSizePartitioner(), (1024, 1024), "float32", [1, 1]),
        (MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=100), (1024, 1024), "float32", [16, 1]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), "float32", [2, 1]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), "float32", [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=MIB), (1024, 1024), "float32", [4, 1]),
        (MaxSizePartitioner(max_shard_bytes=MIB, max_shards=2), (1024, 1024), "float32", [2, 1]),
        (MaxSizePartitioner(max_shard_bytes=100), (13, 10), "float32", [7, 1]),
        (MaxSizePartitioner(max_shard_bytes=4), (6, 1), "float32", [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), "float32", [2, 1]),
        (MaxSizePartitioner(max_shard_bytes=1024), (6, 1), "float32", [1, 1]),
    ],
    ids=lambda v: repr(v) if isinstance(v, Partitioner) else None,
)
def test_tensorflow_s_documented_results(partitioner, shape, dtype, expected):
    assert partitioner(shape, dtype) == expected
    assert partitioner(shape=list(shape), dtype=dtype, axis=0) == expected


def test_the_element_size_comes_from_the_dtype_and_strings_use_bytes_per_string():
    shape = (1024, 256)  # 256 Ki elements
    for dtype, shards in [("float64", 8), ("float32", 4), ("bfloat16", 2), ("int8", 1), ("bool", 1),
                          ("complex128", 16), (np.float16, 2), (np.dtype("int64"), 8), (float, 4)]:
        assert MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=100)(shape, dtype) == [shards, 1], dtype
    assert MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=100)(shape, "string") == [16, 1]
    assert MinSizePartitioner(256 << 10, 100, bytes_per_string=4)(shape, "string") == [4, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024, bytes_per_string=8)((100, 16), "string") == [13, 1]


def test_shapes_and_dtypes_of_the_backend_s_own_tensors_and_of_keras_variables():
    tensor = keras.ops.convert_to_tensor(np.zeros((13, 10), "float32"))
    variable = keras.Variable(np.zeros((13, 10)), dtype="float16")
    assert MaxSizePartitioner(max_shard_bytes=100)(tensor.shape, tensor.dtype) == [7, 1]
    assert MaxSizePartitioner(max_shard_bytes=100)(variable.shape, variable.dtype) == [3, 1]
    assert MaxSizePartitioner(max_shard_bytes=100)(variable.value.shape, variable.value.dtype) == [3, 1]
    assert MinSizePartitioner(40, 100)(tensor.shape, tensor.dtype) == [13, 1]


def test_other_axes_are_split_as_in_tensorflow():
    # ParameterServerStrategy splits the first axis only, but the partitioners answer for any axis.
    assert FixedShardsPartitioner(2)((10, 3), "float32", axis=1) == [1, 2]
    assert FixedShardsPartitioner(2)((10, 3), "float32", axis=-1) == [1, 2]
    assert MinSizePartitioner(4, 10)((6, 3), "float32", axis=1) == [1, 3]
    assert MaxSizePartitioner(24)((6, 3, 2), "float32", axis=1) == [1, 3, 1]


def test_variables_without_elements_are_one_shard_for_size_based_partitioners():
    assert MinSizePartitioner(4, 10)((0, 3), "float32") == [1, 1]
    assert MaxSizePartitioner(4)((0, 3), "float32") == [1, 1]
    assert MaxSizePartitioner(4)((5, 0), "float32") == [1, 1]
    assert FixedShardsPartitioner(3)((0, 3), "float32") == [0, 1]  # as in TensorFlow


@pytest.mark.parametrize("partitioner", [FixedShardsPartitioner(2), MinSizePartitioner(4, 4), MaxSizePartitioner(4)],
                         ids=repr)
def test_a_scalar_or_an_axis_outside_the_shape_is_refused_with_tensorflow_s_text(partitioner):
    with pytest.raises(ValueError, match=re.escape("Cannot partition variable along axis 0 when shape is only ()")
                       + ".*scalar"):
        partitioner((), "float32")
    with pytest.raises(ValueError, match=re.escape("Cannot partition variable along axis 2 when shape is only (3, 4)")):
        partitioner((3, 4), "float32", axis=2)
    with pytest.raises(ValueError, match=re.escape("axis -3")):
        partitioner((3, 4), "float32", axis=-3)
    with pytest.raises(ValueError, match="`axis` must be an int, got 0.5"):
        partitioner((3, 4), "float32", axis=0.5)


@pytest.mark.parametrize("shape, message", [
    ((3, None), "shape is not fully defined: (3, None)"),
    ((3, -1), "`shape` must be a sequence of ints >= 0, got (3, -1)"),
    ((3, 2.5), "`shape` must be a sequence of ints >= 0, got (3, 2.5)"),
    (7, "`shape` must be a sequence of ints (e.g. (1024, 64)), got 7"),
    ("13", "`shape` must be a sequence of ints (e.g. (1024, 64)), got '13'"),
])
def test_bad_shapes_are_named(shape, message):
    for partitioner in (FixedShardsPartitioner(2), MinSizePartitioner(4, 4), MaxSizePartitioner(4)):
        with pytest.raises(ValueError, match=re.escape(message)):
            partitioner(shape, "float32")


def test_an_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="Unknown dtype 'floaty'"):
        MaxSizePartitioner(4)((3, 4), "floaty")
    assert FixedShardsPartitioner(2)((3, 4), "floaty") == [2, 1]  # the dtype does not matter here


@pytest.mark.parametrize("make, message", [
    (lambda: FixedShardsPartitioner(0), "Argument `num_shards` must be positive. Received: 0"),
    (lambda: FixedShardsPartitioner(-2), "Argument `num_shards` must be positive. Received: -2"),
    (lambda: FixedShardsPartitioner(2.5), "Argument `num_shards` must be a positive integer. Received: 2.5"),
    (lambda: FixedShardsPartitioner("2"), "Argument `num_shards` must be a positive integer. Received: '2'"),
    (lambda: MinSizePartitioner(min_shard_bytes=0), "Argument `min_shard_bytes` must be positive. Received: 0"),
    (lambda: MinSizePartitioner(max_shards=0), "Argument `max_shards` must be positive. Received: 0"),
    (lambda: MinSizePartitioner(max_shards=1.5), "Argument `max_shards` must be a positive integer. Received: 1.5"),
    (lambda: MinSizePartitioner(bytes_per_string=0), "Argument `bytes_per_string` must be positive. Received: 0"),
    (lambda: MinSizePartitioner(min_shard_bytes="1k"), "Argument `min_shard_bytes` must be a positive number"),
    (lambda: MaxSizePartitioner(0), "Argument `max_shard_bytes` must be positive. Received 0"),
    (lambda: MaxSizePartitioner(4, max_shards=-1), "Argument `max_shards` must be positive. Received -1"),
    (lambda: MaxSizePartitioner(4, bytes_per_string=0), "Argument `bytes_per_string` must be positive. Received: 0"),
    (lambda: MaxSizePartitioner(None), "Argument `max_shard_bytes` must be a positive number. Received: None"),
])
def test_bad_arguments_are_refused_with_tensorflow_s_texts(make, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()


def test_max_shards_zero_means_no_limit_for_max_size_as_in_tensorflow():
    assert MaxSizePartitioner(4, max_shards=0)((6, 1), "float32") == [6, 1]
    assert MaxSizePartitioner(4, max_shards=np.int64(2))((6, 1), "float32") == [2, 1]


def test_the_base_class_asks_for_call_and_a_subclass_works():
    with pytest.raises(NotImplementedError, match=r"Partitioner must define __call__\(self, shape, dtype, axis=0\)"):
        Partitioner()((3, 4), "float32")

    class Halves(Partitioner):
        def __call__(self, shape, dtype, axis=0):
            return [2] + [1] * (len(shape) - 1)

    assert Halves()((6, 2), "float32") == [2, 1]


def test_repr_shows_the_arguments():
    assert repr(FixedShardsPartitioner(3)) == "FixedShardsPartitioner(num_shards=3)"
    assert repr(MinSizePartitioner()) == "MinSizePartitioner(min_shard_bytes=262144, max_shards=1, bytes_per_string=16)"
    assert repr(MaxSizePartitioner(100)) == "MaxSizePartitioner(max_shard_bytes=100, max_shards=None, bytes_per_string=16)"


# --- against TensorFlow's own partitioners --------------------------------------------------------

SHAPES = [(1,), (7,), (13, 1024), (1024, 1024), (6, 1), (13, 10), (100, 3, 4), (3, 1000), (2, 5, 7), (10000, 64),
          (1, 1, 1), (513, 17), (0, 3), (4, 0)]
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
          "complex64", "complex128", "string"]
ARGUMENTS = [
    ("FixedShardsPartitioner", dict(num_shards=1)), ("FixedShardsPartitioner", dict(num_shards=2)),
    ("FixedShardsPartitioner", dict(num_shards=5)), ("FixedShardsPartitioner", dict(num_shards=20)),
    ("MinSizePartitioner", dict()), ("MinSizePartitioner", dict(min_shard_bytes=4, max_shards=4)),
    ("MinSizePartitioner", dict(min_shard_bytes=256 << 10, max_shards=4)),
    ("MinSizePartitioner", dict(min_shard_bytes=1, max_shards=100)),
    ("MinSizePartitioner", dict(min_shard_bytes=100, max_shards=3, bytes_per_string=8)),
    ("MinSizePartitioner", dict(min_shard_bytes=1000.5, max_shards=7)),
    ("MaxSizePartitioner", dict(max_shard_bytes=4)), ("MaxSizePartitioner", dict(max_shard_bytes=4, max_shards=2)),
    ("MaxSizePartitioner", dict(max_shard_bytes=1024)), ("MaxSizePartitioner", dict(max_shard_bytes=MIB)),
    ("MaxSizePartitioner", dict(max_shard_bytes=100)), ("MaxSizePartitioner", dict(max_shard_bytes=7, max_shards=3)),
    ("MaxSizePartitioner", dict(max_shard_bytes=100, bytes_per_string=3)),
    ("MaxSizePartitioner", dict(max_shard_bytes=(64 << 20) - 1)),
    ("MaxSizePartitioner", dict(max_shard_bytes=1000, max_shards=0)),
]


@pytest.fixture(scope="module")
def tf():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("compares with tf.distribute.experimental.partitioners (TensorFlow backend)")
    import tensorflow

    return tensorflow


@pytest.mark.parametrize("name, kwargs", ARGUMENTS, ids=[f"{n}-{k}" for n, k in ARGUMENTS])
def test_every_result_equals_tensorflow_s(tf, name, kwargs):
    ours, theirs = getattr(partitioners, name)(**kwargs), getattr(tf.distribute.experimental.partitioners, name)(**kwargs)
    compared = 0
    for shape, dtype in itertools.product(SHAPES, DTYPES):
        for axis in range(-len(shape), len(shape)):
            tf_shape, tf_dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
            if name == "MaxSizePartitioner" and 0 in shape:
                # TensorFlow divides by zero here; an empty variable is one shard for us.
                with pytest.raises(ZeroDivisionError):
                    theirs(tf_shape, tf_dtype, axis=axis)
                assert ours(shape, dtype, axis=axis) == [1] * len(shape)
                continue
            expected = list(theirs(tf_shape, tf_dtype, axis=axis))
            assert ours(shape, dtype, axis=axis) == expected, (shape, dtype, axis)
            assert ours(tf_shape, tf_dtype, axis=axis) == expected, (shape, dtype, axis)
            assert ours(shape=tf_shape, dtype=tf_dtype) == list(theirs(shape=tf_shape, dtype=tf_dtype))
            compared += 1
    assert compared > 400


@pytest.mark.parametrize("kwargs", [dict(min_shard_bytes=0), dict(max_shards=0), dict(bytes_per_string=-1)])
def test_min_size_argument_errors_equal_tensorflow_s(tf, kwargs):
    with pytest.raises(ValueError) as theirs:
        tf.distribute.experimental.partitioners.MinSizePartitioner(**kwargs)
    with pytest.raises(ValueError, match=f"^{re.escape(str(theirs.value))}$"):
        MinSizePartitioner(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_shard_bytes=0), dict(max_shard_bytes=4, max_shards=-1),
                                    dict(max_shard_bytes=4, bytes_per_string=0)])
def test_max_size_argument_errors_equal_tensorflow_s(tf, kwargs):
    with pytest.raises(ValueError) as theirs:
        tf.distribute.experimental.partitioners.MaxSizePartitioner(**kwargs)
    with pytest.raises(ValueError, match=f"^{re.escape(str(theirs.value))}$"):
        MaxSizePartitioner(**kwargs)


def test_an_axis_outside_the_shape_gets_tensorflow_s_text(tf):
    with pytest.raises(ValueError) as theirs:
        tf.distribute.experimental.partitioners.MinSizePartitioner()(tf.TensorShape([3, 4]), tf.float32, axis=2)
    with pytest.raises(ValueError, match=f"^{re.escape(str(theirs.value))}$"):
        MinSizePartitioner()((3, 4), "float32", axis=2)
