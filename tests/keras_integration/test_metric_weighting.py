"""A `Mean` metric's scalar update counts with the replica's share inside a model's own step, only there."""

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.distribute import context


def _update(metric, *args, **kwargs):
    metric.update_state(*args, **kwargs)
    total, count = (float(keras.ops.convert_to_numpy(v)) for v in metric.variables)
    return total, count


@pytest.fixture
def replica_with_share():
    """Runs its block as replica 0 of two, holding a quarter of the batch."""
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])

    def enter(share):
        return context.enter_frame(strategy, context.ReplicaContext(strategy, 0, gradient_weight=share))

    return enter


def test_a_scalar_without_weight_counts_the_share(replica_with_share):
    with replica_with_share(0.25):
        assert _update(keras.metrics.Mean(), 2.0) == (0.5, 0.25)


def test_per_sample_values_and_given_weights_are_the_users(replica_with_share):
    with replica_with_share(0.25):
        assert _update(keras.metrics.Mean(), np.array([1.0, 3.0], "float32")) == (4.0, 2.0)
        assert _update(keras.metrics.Mean(), 2.0, sample_weight=3.0) == (6.0, 3.0)
        assert _update(keras.metrics.MeanAbsoluteError(), np.ones((2, 1), "float32"), np.zeros((2, 1), "float32")) == (2.0, 2.0)


def test_outside_a_replica_step_keras_counts_one():
    assert _update(keras.metrics.Mean(), 2.0) == (2.0, 1.0)
    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():  # a scope alone does not weigh
        assert _update(keras.metrics.Mean(), 2.0) == (2.0, 1.0)
