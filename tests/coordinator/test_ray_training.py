"""Asynchronous parameter-server training on the Ray engine (JAX and PyTorch) against one device.

With one worker, closures run one after another, so the training must equal
single-device training on the same batches; with a partitioner the
variables and their optimizer slots are split over the parameter servers.
With two workers, every scheduled step is applied exactly once, even when a
worker is killed in the middle, and the loss falls.
"""

import itertools
import os
import signal
import time

import keras
import numpy as np
import pytest
import ray

import keras_strategies as ks
from ray_cluster import cluster
from reference_loops import average_loss, split, squared_error, train

pytestmark = [
    pytest.mark.usefixtures("ray_runtime"),
    pytest.mark.skipif(keras.backend.backend() == "tensorflow",
                       reason="TensorFlow trains with its own parameter-server runtime, not the Ray engine"),
]

ROWS = np.random.RandomState(0).normal(size=(48, 4)).astype("float32")
TARGETS = (ROWS @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.25).astype("float32")
BATCHES = split((ROWS, TARGETS), 8, steps=9)
LOSS = average_loss(squared_error)


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])


def _rows_partitioner(shape, dtype, axis=0):
    return [3] + [1] * (len(shape) - 1)


def _train_on_cluster(strategy, queue, weights, steps, batches=BATCHES):
    with strategy.scope():
        model = _model()
        model.set_weights(weights)
        optimizer = keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
        loss_metric = keras.metrics.Mean()

    def replica_step(batch):
        def compute():
            tensors = tuple(keras.ops.convert_to_tensor(a) for a in batch)
            return LOSS(tensors, model(tensors[0], training=True), model.losses)

        loss, grads = ks.value_and_grad(compute, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        loss_metric.update_state(loss)
        return loss

    def step(iterator):
        return strategy.run(replica_step, args=(next(iterator),))

    iterator = iter(queue.create_per_worker_dataset(lambda: itertools.cycle(batches)))
    losses = [queue.schedule(step, args=(iterator,)) for _ in range(steps)]
    return model, optimizer, loss_metric, losses


def _one_device(weights, batches=BATCHES):
    model = _model()
    model.set_weights(weights)
    optimizer = keras.optimizers.Adam(0.05)
    losses = train(model, optimizer, LOSS, batches)
    return model, optimizer, losses


@pytest.mark.parametrize("num_ps, partitioner", [(1, None), (2, _rows_partitioner)], ids=["1ps", "2ps-3shards"])
def test_one_worker_equals_one_device(num_ps, partitioner):
    weights = _model().get_weights()
    expected_model, expected_optimizer, expected_losses = _one_device(weights)
    with cluster(num_ps=num_ps, num_workers=1, partitioner=partitioner) as (strategy, queue):
        model, optimizer, loss_metric, losses = _train_on_cluster(strategy, queue, weights, len(BATCHES))
        queue.join()
        if partitioner is not None:
            kernel = strategy.runtime.registry.keys[id(model.layers[0].kernel)]
            assert [(s, a, b) for s, a, b, _ in strategy.runtime.registry.layout[kernel]] == [
                (0, 0, 2), (1, 2, 3), (0, 3, 4)]
        np.testing.assert_allclose([float(v.fetch()) for v in losses], expected_losses, rtol=1e-5, atol=1e-5)
        for actual, expected in zip(model.get_weights(), expected_model.get_weights()):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
        for actual, expected in zip(optimizer.variables, expected_optimizer.variables):
            np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        assert int(optimizer.iterations.numpy()) == len(BATCHES)
        np.testing.assert_allclose(float(loss_metric.result()), np.mean(expected_losses), rtol=1e-5)


def test_two_workers_two_ps_apply_every_step_once_through_a_killed_worker():
    weights = _model().get_weights()
    steps = 40
    with cluster(num_ps=2, num_workers=2) as (strategy, queue):
        model, optimizer, loss_metric, losses = _train_on_cluster(strategy, queue, weights, steps)
        handle = queue._workers[0]
        pid = ray.get(handle.actor.ping.remote())
        while sum(v._done.is_set() for v in losses) < 8:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        queue.join()
        assert int(optimizer.iterations.numpy()) == steps
        assert float(loss_metric.count.numpy()) == steps
        values = [float(v.fetch()) for v in losses]
        assert np.mean(values[-8:]) < 0.5 * np.mean(values[:8])
        handle.wait_until_available()
        assert ray.get(handle.actor.ping.remote()) != pid
