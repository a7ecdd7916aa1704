"""`steps_per_execution`: a group of steps whose batches have the same shards runs as one call.

On TensorFlow and JAX the group is one program (`engine.compiler.step_group`: a
`tf.while_loop` in one `tf.function`, a `jax.lax.scan` over the mesh); a group
that holds the padded partial last batch runs step by step. The results are
those of one device. Keras' PyTorch trainer refuses `steps_per_execution` > 1.
"""

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.trainer import replica_step

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
pytestmark = pytest.mark.skipif(
    keras.backend.backend() == "torch", reason="Keras' PyTorch trainer refuses steps_per_execution > 1"
)


def _data(rows):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _steps_model(steps_per_execution, extra_layers=tuple):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, activation="relu"), *extra_layers(), keras.layers.Dense(1)]
    )
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of whole compiled steps ("steps") and of groups of steps ("groups")."""
    counts = {"steps": 0, "groups": 0}
    compiled_step = replica_step.ReplicaStep._compiled_step

    def counting(self, kind):
        step = compiled_step(self, kind)

        def one(*args):
            counts["steps"] += 1
            return step(*args)

        group = engine.compiler.step_group(step)
        if group is not None:
            def grouped(steps):
                counts["groups"] += 1
                return group(steps)

            one.group = grouped
        return one

    monkeypatch.setattr(replica_step.ReplicaStep, "_compiled_step", counting)
    return counts


def test_fit_runs_each_group_of_full_batches_in_one_call_and_trains_like_one_device(calls):
    x, y = _data(70)  # 9 batches of 8 an epoch, the last of 6: groups of 3, 3 and 3 (uneven)
    reference = _steps_model(3)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with ks.MirroredStrategy(DEVICES).scope():
        model = _steps_model(3)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    # Per epoch: two groups of three full batches, then the group with the partial batch step by step
    assert calls == {"groups": 2 * 2, "steps": 2 * 3}
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 18
    for name in ("loss", "mae"):
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_evaluate_runs_each_group_of_full_batches_in_one_call_and_measures_like_one_device(calls):
    x, y = _data(70)
    reference = _steps_model(3)
    with ks.MirroredStrategy(DEVICES).scope():
        model = _steps_model(3)
    model.set_weights(reference.get_weights())
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert calls == {"groups": 2, "steps": 3}
    expected = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert logs.keys() == expected.keys()
    for name in logs:
        np.testing.assert_allclose(logs[name], expected[name], rtol=1e-5)


def test_a_group_of_steps_carries_batch_normalization_and_dropout_state_from_step_to_step(calls):
    # Per-replica BatchNormalization statistics averaged after each step, and the dropout seed
    # advanced at each step: a group of four steps equals four single steps.
    x, y = _data(64)
    layers = lambda: (keras.layers.BatchNormalization(), keras.layers.Dropout(0.2))  # noqa: E731
    with ks.MirroredStrategy(DEVICES).scope():
        single, grouped = _steps_model(1, layers), _steps_model(4, layers)
    expected = single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    before = dict(calls)
    history = grouped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert calls["groups"] - before["groups"] == 2 * 2 and calls["steps"] == before["steps"]
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    for got, want in zip(grouped.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_tpu_strategy_runs_a_group_of_steps_per_execution_on_the_devices(calls):
    # TPUStrategy's static shapes on virtual CPU devices (its test-only `_test_devices`): the two full
    # batches of each epoch run as one program; the partial last one, padded to their shape, alone.
    x, y = _data(19)
    reference = _steps_model(2)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with ks.TPUStrategy(_test_devices=DEVICES).scope():
        model = _steps_model(2)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert calls == {"groups": 2, "steps": 2}
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
