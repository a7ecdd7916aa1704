"""`CentralStorageStrategy`: where variables live, its defaults and refusals, its input.

Its training equals one device in the exactness tests of `fit` and of custom
loops (tests/trainer/test_loops.py, tests/distribute/test_custom_training_loop.py),
which run under both Mirrored and CentralStorage.
"""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.backend import engine

TORCH = keras.backend.backend() == "torch"  # torch's CPU replicas share the one "cpu" device


def placed(device):
    return "cpu:0" if TORCH else device


def test_defaults_follow_tensorflow():
    several = ks.CentralStorageStrategy()
    assert several.extended.worker_devices == tuple(ks.list_devices())
    assert several.extended.parameter_devices == ("cpu:0",)
    one = ks.CentralStorageStrategy(["cpu:2"])
    assert one.extended.parameter_devices == ("cpu:2",) and one.num_replicas_in_sync == 1
    assert ks.experimental.CentralStorageStrategy is ks.CentralStorageStrategy


def fit_like_one_device(strategy, optimizer, rows=7, batch_size=3):
    """`fit` of a small model under `strategy` equals one device (logs and weights); returns the model."""
    x = np.linspace(-1, 1, 2 * rows, dtype="float32").reshape(rows, 2)
    y = x @ np.array([[1.0], [-1.0]], "float32")

    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer=optimizer(), metrics=["mae"])
        return model

    with strategy.scope():
        model = build()
    reference = build()
    model.set_weights(reference.get_weights())
    kwargs = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)
    for got_w, expected_w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_w, expected_w, rtol=1e-5, atol=1e-6)
    return model


def test_variables_and_their_updates_stay_on_the_parameter_device():
    """Compute on cpu:1 and cpu:2, variables on cpu:0; training equals one device."""
    strategy = ks.CentralStorageStrategy(compute_devices=["cpu:1", "cpu:2"], parameter_device="/device:CPU:0")
    assert strategy.extended.worker_devices == ("cpu:1", "cpu:2")
    model = fit_like_one_device(strategy, lambda: keras.optimizers.Adam(0.05))
    for variable in model.variables + model.optimizer.variables:
        assert engine.devices.device_of(variable) == placed("cpu:0"), variable.path
    total = strategy.reduce("sum", strategy.run(lambda: ops.ones(())), axis=None)
    assert engine.devices.device_of(total) == placed("cpu:0")


@pytest.mark.parametrize(
    "options",
    [None, ks.InputOptions(), ks.InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=2)],
    ids=["no options", "default options", "options"],
)
def test_distributed_datasets_take_input_options(options):
    strategy = ks.CentralStorageStrategy(["cpu:0", "cpu:1"])
    dataset = strategy.make_experimental_numpy_dataset(np.arange(6, dtype="float32")).batch(4)
    got = [
        [ops.convert_to_numpy(v).tolist() for v in strategy.experimental_local_results(batch)]
        for batch in strategy.experimental_distribute_dataset(dataset, options)
    ]
    assert got == [[[0, 1], [2, 3]], [[4], [5]]]
    batches = strategy.distribute_datasets_from_function(
        lambda context: strategy.make_experimental_numpy_dataset(np.arange(4)).batch(1), options
    )
    assert [sorted(ops.convert_to_numpy(v).item() for v in strategy.experimental_local_results(b)) for b in batches] \
        == [[0, 1], [2, 3]]


def test_a_multi_worker_tf_config_is_refused(monkeypatch):
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="CentralStorageStrategy trains on one machine.*2 tasks.*MultiWorkerMirrored"):
        ks.CentralStorageStrategy()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}))
    assert ks.CentralStorageStrategy(["cpu:0"]).num_replicas_in_sync == 1


@pytest.mark.gpu
def test_on_two_gpus_replicas_compute_there_and_the_variables_stay_on_the_cpu(gpus):
    """`make test-gpu`: the defaults over 2 GPUs keep the variables on the CPU; fit equals one device."""
    strategy = ks.CentralStorageStrategy(gpus)
    assert strategy.extended.worker_devices == tuple(gpus)
    assert strategy.extended.parameter_devices == ("cpu:0",)
    model = fit_like_one_device(strategy, lambda: keras.optimizers.SGD(0.1), rows=11, batch_size=4)
    assert {engine.devices.device_of(v) for v in model.variables} == {"cpu:0"}
    per_replica = strategy.run(lambda: ops.ones((1,)))
    seen = [engine.devices.device_of(v) for v in strategy.experimental_local_results(per_replica)]
    assert seen == list(gpus)
