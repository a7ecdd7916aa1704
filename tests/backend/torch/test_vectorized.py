"""Replicas that share one device run as one vectorised program, with the results of separate replicas.

`fit` on several CPU replicas takes `backend/torch/vectorized.py` where it can
and replica threads where it cannot; both must equal one device, and the
vectorised path must really be taken where it is meant to.
"""

import gc
import os
import sys

import keras
import numpy as np
import pytest
import torch

import keras_strategies as ks
from keras_strategies.backend.torch import vectorized

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer"))
from test_loops import TOL, assert_same_training, regression_data  # noqa: E402


def _train_runner(model):
    """The train step's replica runner of a model that `fit` ran under a strategy."""
    return model._ks_replica_step.train_step.__self__._train


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"])
    return model


def _batch_norm():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(1),
    ])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05))
    return model


def _dropout():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05))
    return model


def test_the_sum_over_replicas_and_its_gradient_are_those_of_separate_replicas():
    w = torch.tensor([1.0, 2.0])
    xs = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    def replica(w, x):
        total, squares = vectorized.ReplicaSum.apply(w * x, (w * x) ** 2)  # the same sums on every replica
        return (total * total).sum() * x[0] + squares.sum()

    grads = torch.func.vmap(torch.func.grad(replica), in_dims=(None, 0))(w, xs)
    leaf = w.clone().requires_grad_()
    total, squares = (leaf * xs).sum(0), ((leaf * xs) ** 2).sum(0)
    objective = sum((total * total).sum() * xs[i, 0] + squares.sum() for i in range(3))
    np.testing.assert_allclose(grads.sum(0).numpy(), torch.autograd.grad(objective, leaf)[0].numpy(), rtol=1e-6)


def test_even_batches_train_vectorised_and_equal_one_device():
    model = assert_same_training(_mlp, *regression_data(16), batch_size=8, replicas=4)
    assert _train_runner(model).fallback_reason is None


def test_uneven_and_partial_batches_take_replica_threads_and_equal_one_device():
    # 16 rows in batches of 6: shards of 2 rows, then 1 and 0 rows (threads for that batch only).
    model = assert_same_training(_mlp, *regression_data(16), batch_size=6, replicas=4)
    assert _train_runner(model).fallback_reason is None


def _cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(4, 3, padding="same"), keras.layers.Flatten(), keras.layers.Dense(1),
    ])
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01))
    return model


def test_convolutions_after_pooling_train_vectorised_and_equal_one_device():
    # Keras asks for a channels-last memory layout before a convolution, which vmap cannot make.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8, 8, 1)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    model = assert_same_training(_cnn, x, y, batch_size=8, replicas=4)
    assert _train_runner(model).fallback_reason is None


def test_batch_normalization_keeps_per_replica_statistics_as_replica_threads_do():
    x, y = regression_data(16)
    results = {}
    for run_eagerly in (False, True):  # vectorised, and replica threads
        strategy = ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
        with strategy.scope():
            model = _batch_norm()
        model.run_eagerly = run_eagerly
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        results[run_eagerly] = (history["loss"], model.get_weights())
        if not run_eagerly:
            assert _train_runner(model).fallback_reason is None
    (loss, weights), (threads_loss, threads_weights) = results[False], results[True]
    np.testing.assert_allclose(loss, threads_loss, **TOL)
    for got, expected in zip(weights, threads_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def test_a_step_that_cannot_be_vectorised_runs_in_replica_threads_leaving_no_trace_of_the_attempt():
    x, y = regression_data(16)
    results = {}
    for run_eagerly in (False, True):  # the attempt then threads, and threads only
        strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = _dropout()
        model.run_eagerly = run_eagerly
        results[run_eagerly] = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
        if not run_eagerly:
            assert _train_runner(model).fallback_reason, "a random op inside vmap should have sent the step to threads"
    np.testing.assert_allclose(results[False], results[True], **TOL)


@pytest.mark.parametrize("replicas", [2, 4])
def test_evaluate_and_predict_run_vectorised(replicas):
    x, y = regression_data(16)
    strategy = ks.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = _mlp()
    reference = _mlp()
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), reference.predict(x, batch_size=8, verbose=0), **TOL)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0), reference.evaluate(x, y, batch_size=8, verbose=0), **TOL)
    steps = model._ks_replica_step
    for runner in (steps.test_step.__self__._test, steps.predict_step.__self__._predict):
        assert runner.fallback_reason is None


def test_a_vectorised_step_leaves_no_garbage_that_holds_its_memory():
    # Without the cycle collector, a step's leftovers stay until the end: the replicas' outputs
    # once stayed referenced from reference cycles (Keras' tree functions on PyTorch make them),
    # and with them about 11 MiB a step of this CNN, which the collector only freed now and then.
    x, y = np.random.default_rng(0).normal(size=(64, 28, 28, 1)).astype("float32"), np.arange(64) % 10
    with ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(10),
        ])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    assert _train_runner(model).fallback_reason is None  # vectorised

    def resident_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    gc.collect()
    gc.disable()
    try:
        before = resident_mib()
        model.fit(x, y, batch_size=64, epochs=30, verbose=0)
        grown = resident_mib() - before
    finally:
        gc.enable()
    assert grown < 100, f"{grown:.0f} MiB more after 30 steps"
