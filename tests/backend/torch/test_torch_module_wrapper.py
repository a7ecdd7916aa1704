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
