"""A wrapped `torch.nn.Module` trains under a strategy exactly as on one device.

Replicas run the model statelessly; the module's own forward would read its
`nn.Parameter`s instead of the replica's values and never train them.
"""

import os
import sys

import keras
import numpy as np
import pytest
import torch

import keras_strategies as ks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer"))
from test_loops import assert_same_training, regression_data  # noqa: E402


def torch_module_model():
    torch.manual_seed(0)
    model = keras.Sequential([
        keras.Input((3,)), keras.layers.TorchModuleWrapper(torch.nn.Linear(3, 4)), keras.layers.Activation("relu"),
        keras.layers.Dense(1),
    ])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
    model(np.zeros((1, 3), "float32"))  # builds the Dense layer too, for set_weights
    return model


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_torch_module_trains_like_one_device(replicas):
    model = assert_same_training(torch_module_model, *regression_data(11), batch_size=4, replicas=replicas)
    initial = torch_module_model().get_weights()[0]
    assert np.abs(model.get_weights()[0] - initial).max() > 1e-3  # the module's own weights moved


def test_outside_a_strategy_the_module_runs_unchanged():
    model = torch_module_model()
    module = model.layers[0].module
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model.layers[0](x)), module(torch.ones(2, 3)).detach().numpy())


def _expected_statistics(batches, replicas, momentum=0.1):
    """A `BatchNorm1d`'s running statistics under TF's rule: each replica updates its own copy on
    its shard (sizes differ by at most one), then the copies are averaged."""
    mean, var = np.zeros(3), np.ones(3)
    for batch in batches:
        sizes = [len(batch) // replicas + (i < len(batch) % replicas) for i in range(replicas)]
        shards = np.split(batch, np.cumsum(sizes)[:-1])
        mean = np.mean([(1 - momentum) * mean + momentum * shard.mean(0) for shard in shards], 0)
        var = np.mean([(1 - momentum) * var + momentum * shard.var(0, ddof=1) for shard in shards], 0)
    return mean, var


def _batch_norm_model():
    torch.manual_seed(0)
    batch_norm = torch.nn.BatchNorm1d(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.TorchModuleWrapper(batch_norm), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.0))  # fixed weights: statistics only
    model(np.zeros((2, 3), "float32"), training=False)  # builds the Dense layer (a custom loop does not)
    return model, batch_norm


@pytest.mark.parametrize("loop", ["fit", "custom_loop"])
def test_each_replica_updates_its_own_module_buffers_and_they_are_averaged(loop):
    # They were updated in place by one replica after another, following each shard in turn.
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(14, 3)) * 3 + 1).astype("float32")
    y = rng.normal(size=(14, 1)).astype("float32")
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model, batch_norm = _batch_norm_model()
    if loop == "fit":
        model.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)  # shards of 3, 2, 2
    else:
        import tensorflow as tf

        def step(features):
            _, grads = ks.value_and_grad(lambda: keras.ops.mean(model(features, training=True)), model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(7)):
            strategy.run(step, args=(batch,))
    mean, var = _expected_statistics([x[:7], x[7:]], replicas=3)
    np.testing.assert_allclose(batch_norm.running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch_norm.running_var.numpy(), var, rtol=1e-5, atol=1e-6)
    assert int(batch_norm.num_batches_tracked) == 2
    before = [b.clone() for b in batch_norm.buffers()]
    model.evaluate(x, y, batch_size=7, verbose=0)
    model.predict(x, batch_size=7, verbose=0)
    for old, new in zip(before, batch_norm.buffers()):
        torch.testing.assert_close(old, new)  # inference leaves them alone
