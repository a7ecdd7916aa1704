"""`compute_average_loss` and `scale_regularization_loss` golden values.

In the TensorFlow run, TensorFlow's own `tf.nn.compute_average_loss` and
`tf.nn.scale_regularization_loss` give the same values: without a strategy, and in
the replicas of TF's own `MirroredStrategy` where they depend on the replica count.
"""

import functools

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks

TENSORFLOW = keras.backend.backend() == "tensorflow"


def as_float(value):
    return float(ops.convert_to_numpy(value))


@functools.lru_cache(maxsize=None)
def tf_mirrored_strategy():
    """TensorFlow's own `MirroredStrategy` on two of the test process's virtual CPUs."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def tf_in_replicas(fn, per_replica):
    """`fn(value)` in each replica of `tf_mirrored_strategy()`, replica i given `per_replica[i]`."""
    import tensorflow as tf

    strategy = tf_mirrored_strategy()
    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(per_replica[context.replica_id_in_sync_group]))
    return [float(v) for v in strategy.experimental_local_results(strategy.run(fn, args=(values,)))]


class TwoReplicaStrategy(ks.Strategy):
    """Two replicas on two virtual CPU devices, from the public base classes."""

    def __init__(self):
        super().__init__(ks.StrategyExtended(self, ["cpu:0", "cpu:1"]))


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, 2.5),
        ({"global_batch_size": 8}, 1.25),
        ({"sample_weight": [1.0, 0.0, 1.0, 0.0]}, 1.0),  # divisor is not sum(sample_weight)
        ({"global_batch_size": 0}, 0.0),
        ({"global_batch_size": np.int64(8)}, 1.25),
    ],
)
def test_golden_values_without_strategy(kwargs, expected):
    assert as_float(ks.compute_average_loss([1.0, 2.0, 3.0, 4.0], **kwargs)) == pytest.approx(expected)
    if TENSORFLOW:
        import tensorflow as tf

        assert float(tf.nn.compute_average_loss([1.0, 2.0, 3.0, 4.0], **kwargs)) == pytest.approx(expected)


def test_non_batch_axes_are_summed_too():
    assert as_float(ks.compute_average_loss(np.ones((2, 3), "float32"))) == pytest.approx(3.0)
    if TENSORFLOW:
        import tensorflow as tf

        assert float(tf.nn.compute_average_loss(np.ones((2, 3), "float32"))) == pytest.approx(3.0)


def test_sample_weight_of_shape_batch_by_one_applies_per_example():
    losses = np.array([1.0, 2.0, 3.0, 4.0], "float32")
    weights = np.array([[1.0], [0.0], [1.0], [0.0]], "float32")
    implementations = [ks.compute_average_loss]
    if TENSORFLOW:
        import tensorflow as tf

        implementations.append(tf.nn.compute_average_loss)
    for compute_average_loss in implementations:
        assert as_float(compute_average_loss(losses, sample_weight=weights)) == pytest.approx(1.0)
        assert as_float(compute_average_loss(losses[:, None], sample_weight=weights[:, 0])) == pytest.approx(1.0)


def test_sample_weights_that_do_not_fit_the_losses_are_refused_with_both_shapes():
    with pytest.raises(ValueError, match=r"sample_weight of shape \(3,\) does not match per_example_loss of shape \(4,\)"):
        ks.compute_average_loss(np.ones((4,), "float32"), sample_weight=np.ones((3,), "float32"), global_batch_size=4)
    scalar = ks.compute_average_loss(np.ones((4, 2), "float32"), sample_weight=2.0, global_batch_size=4)
    assert as_float(scalar) == pytest.approx(4.0)
    if TENSORFLOW:
        import tensorflow as tf

        scalar = tf.nn.compute_average_loss(np.ones((4, 2), "float32"), sample_weight=2.0, global_batch_size=4)
        assert float(scalar) == pytest.approx(4.0)


def test_backend_tensors_are_accepted_and_dtype_is_kept():
    losses = ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))
    result = ks.compute_average_loss(losses, global_batch_size=ops.convert_to_tensor(4))
    assert "float32" in str(result.dtype)
    assert as_float(result) == pytest.approx(0.75)


def test_bad_losses_and_global_batch_sizes_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="at least rank 1"):
        ks.compute_average_loss(3.0)
    with pytest.raises(TypeError, match="global_batch_size must be an integer"):
        ks.compute_average_loss([1.0, 2.0], global_batch_size=2.0)
    with pytest.raises(ValueError, match="global_batch_size must be non-negative"):
        ks.compute_average_loss([1.0, 2.0], global_batch_size=-1)
    with pytest.raises(ValueError, match="global_batch_size must be scalar"):
        ks.compute_average_loss([1.0, 2.0], global_batch_size=ops.convert_to_tensor([2, 2]))


def test_cross_replica_context_needs_global_batch_size():
    strategies = [(ks.OneDeviceStrategy("cpu:0"), ks.compute_average_loss, ks.scale_regularization_loss)]
    if TENSORFLOW:
        import tensorflow as tf

        strategies.append((tf.distribute.OneDeviceStrategy("/cpu:0"), tf.nn.compute_average_loss, tf.nn.scale_regularization_loss))
    for strategy, compute_average_loss, scale_regularization_loss in strategies:
        with strategy.scope():
            with pytest.raises(RuntimeError, match="compute_average_loss` in cross replica context"):
                compute_average_loss([1.0, 2.0])
            assert as_float(compute_average_loss([1.0, 2.0], global_batch_size=4)) == pytest.approx(0.75)
            with pytest.raises(RuntimeError, match="scale_regularization_loss` in cross replica context"):
                scale_regularization_loss([1.0])


def test_uneven_replicas_default_divisor_is_local_batch_times_replicas():
    strategy = TwoReplicaStrategy()
    losses = ks.PerReplica([np.array([1.0, 2.0, 3.0], "float32"), np.array([4.0], "float32")])
    per_replica = strategy.run(ks.compute_average_loss, args=(losses,))
    assert [as_float(v) for v in per_replica.values] == pytest.approx([1.0, 2.0])
    assert as_float(strategy.reduce("sum", per_replica, axis=None)) == pytest.approx(3.0)

    exact = strategy.run(lambda l: ks.compute_average_loss(l, global_batch_size=10), args=(losses,))
    assert [as_float(v) for v in exact.values] == pytest.approx([0.6, 0.4])
    assert as_float(strategy.reduce("sum", exact, axis=None)) == pytest.approx(1.0)
    if TENSORFLOW:
        import tensorflow as tf

        assert tf_in_replicas(tf.nn.compute_average_loss, losses.values) == pytest.approx([1.0, 2.0])
        exact = tf_in_replicas(lambda l: tf.nn.compute_average_loss(l, global_batch_size=10), losses.values)
        assert exact == pytest.approx([0.6, 0.4])


def test_scale_regularization_loss_divides_by_replicas():
    assert as_float(ks.scale_regularization_loss([1.0, 3.0])) == pytest.approx(4.0)
    strategy = TwoReplicaStrategy()
    scaled = strategy.run(ks.scale_regularization_loss, args=([1.0, 3.0],))
    assert [as_float(v) for v in scaled.values] == pytest.approx([2.0, 2.0])
    # A list of tensors such as `model.losses`.
    parts = [ops.convert_to_tensor(1.0), ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))]
    assert as_float(strategy.run(ks.scale_regularization_loss, args=(parts,)).values[0]) == pytest.approx(2.0)
    if TENSORFLOW:  # (TensorFlow's own takes a tensor, or a list of equal shapes)
        import tensorflow as tf

        assert float(tf.nn.scale_regularization_loss([1.0, 3.0])) == pytest.approx(4.0)
        scaled = tf_in_replicas(tf.nn.scale_regularization_loss, [np.array([1.0, 3.0], "float32")] * 2)
        assert scaled == pytest.approx([2.0, 2.0])


def test_empty_replica_gives_zero_not_nan():
    strategy = TwoReplicaStrategy()
    losses = ks.PerReplica([np.array([1.0, 2.0], "float32"), np.zeros((0,), "float32")])
    per_replica = strategy.run(ks.compute_average_loss, args=(losses,))
    assert [as_float(v) for v in per_replica.values] == pytest.approx([0.75, 0.0])
    if TENSORFLOW:
        import tensorflow as tf

        assert tf_in_replicas(tf.nn.compute_average_loss, losses.values) == pytest.approx([0.75, 0.0])
