"""On TensorFlow, a train or test step on one worker is one compiled program.

The replicas, the optimizer update, the global predictions and the metric
update run in one `tf.function` (`compiler.compile_replicated_step`): once it
is traced, a step makes no Python call to the update or the metric update,
which as separate dispatches had cost about 3 ms a train step. The results
stay those of one device (checked throughout `tests/trainer/`). With
`steps_per_execution`, a group of steps whose batches have the same shards is
one call of one `tf.function` too (a `tf.while_loop` over the steps).
"""

import keras
import numpy as np

import keras_strategies as ks
from keras_strategies.backend.tensorflow import compiler as tf_compiler
from keras_strategies.backend.tensorflow import optimizer as tf_optimizer
from keras_strategies.trainer import replica_step


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data(rows=22):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _counted(monkeypatch, calls):
    """Counts the Python calls of the optimizer update and of the metric update."""
    apply = tf_optimizer.apply_gradients
    update_metrics = replica_step.ReplicaStep._update_metrics

    def counted_apply(*args, **kwargs):
        calls["update"] += 1
        return apply(*args, **kwargs)

    def counted_metrics(self, *args, **kwargs):
        calls["metrics"] += 1
        return update_metrics(self, *args, **kwargs)

    monkeypatch.setattr(tf_optimizer, "apply_gradients", counted_apply)
    monkeypatch.setattr(replica_step.ReplicaStep, "_update_metrics", counted_metrics)


def test_once_traced_a_train_step_calls_neither_the_update_nor_the_metrics_from_python(monkeypatch):
    x, y = _data()
    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # traces full and partial batches
    calls = {"update": 0, "metrics": 0}
    _counted(monkeypatch, calls)
    before = int(model.optimizer.iterations.numpy())
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert int(model.optimizer.iterations.numpy()) == before + 6  # 3 steps an epoch did run
    assert calls == {"update": 0, "metrics": 0}
    assert len(history["loss"]) == 2 and history["loss"][1] < history["loss"][0]


def test_once_traced_a_test_step_calls_no_metric_update_from_python(monkeypatch):
    x, y = _data()
    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)  # traces full and partial batches
    calls = {"update": 0, "metrics": 0}
    _counted(monkeypatch, calls)
    again = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
    assert calls == {"update": 0, "metrics": 0}
    assert again == first and first["loss"] > 0 and first["mae"] > 0


DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _steps_model(steps_per_execution, extra_layers=tuple):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, activation="relu"), *extra_layers(), keras.layers.Dense(1)]
    )
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _count_calls(monkeypatch):
    """A dict counting the calls of whole compiled steps ("steps") and of groups of steps ("groups")."""
    calls = {"steps": 0, "groups": 0}
    step_call, step_group = tf_compiler._Step.__call__, tf_compiler.step_group

    def counted_step(self, *args):
        calls["steps"] += 1
        return step_call(self, *args)

    def counted_group(compiled_step):
        group = step_group(compiled_step)

        def counted(steps):
            calls["groups"] += 1
            return group(steps)

        return counted

    monkeypatch.setattr(tf_compiler._Step, "__call__", counted_step)
    monkeypatch.setattr(tf_compiler, "step_group", counted_group)
    return calls


def test_steps_per_execution_runs_each_group_of_full_batches_in_one_call_and_trains_like_one_device(monkeypatch):
    x, y = _data(70)  # 9 batches of 8 an epoch, the last of 6: groups of 3, 3 and 3 (uneven)
    reference = _steps_model(3)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with ks.MirroredStrategy(DEVICES).scope():
        model = _steps_model(3)
    calls = _count_calls(monkeypatch)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    # Per epoch: two groups of three full batches, then the group with the partial batch step by step.
    assert calls == {"groups": 2 * 2, "steps": 2 * 3}
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 18
    for name in ("loss", "mae"):
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_evaluate_runs_each_group_of_full_batches_in_one_call_and_measures_like_one_device(monkeypatch):
    x, y = _data(70)
    reference = _steps_model(3)
    with ks.MirroredStrategy(DEVICES).scope():
        model = _steps_model(3)
    model.set_weights(reference.get_weights())
    calls = _count_calls(monkeypatch)
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert calls == {"groups": 2, "steps": 3}
    expected = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert logs.keys() == expected.keys()
    for name in logs:
        np.testing.assert_allclose(logs[name], expected[name], rtol=1e-5)


def test_a_group_of_steps_carries_batch_normalization_and_dropout_state_from_step_to_step(monkeypatch):
    # Per-replica BatchNormalization statistics averaged after each step, and the dropout seed
    # advanced at each step: a group of four steps equals four single steps.
    x, y = _data(64)
    layers = lambda: (keras.layers.BatchNormalization(), keras.layers.Dropout(0.2))  # noqa: E731
    with ks.MirroredStrategy(DEVICES).scope():
        single, grouped = _steps_model(1, layers), _steps_model(4, layers)
    expected = single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    calls = _count_calls(monkeypatch)
    history = grouped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert calls == {"groups": 2 * 2, "steps": 0}
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    for got, want in zip(grouped.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
