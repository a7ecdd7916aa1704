"""On TensorFlow, a train or test step on one worker is one compiled program.

The replicas, the optimizer update, the global predictions and the metric
update run in one `tf.function` (`compiler.compile_replicated_step`): once it
is traced, a step makes no Python call to the update or the metric update,
which as separate dispatches had cost about 3 ms a train step. The results
stay those of one device (checked throughout `tests/trainer/`; groups of
`steps_per_execution` steps in `tests/trainer/test_step_groups.py`).
"""

import keras
import numpy as np

import keras_strategies as ks
from keras_strategies.backend.tensorflow import optimizer as tf_optimizer
from keras_strategies.trainer import global_update


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(22, 4)).astype("float32"), rng.normal(size=(22, 1)).astype("float32")


def _counted(monkeypatch, calls):
    """Counts the Python calls of the optimizer update and of the metric update."""
    apply = tf_optimizer.apply_gradients
    update_metrics = global_update.GlobalUpdate.update_metrics

    def counted_apply(*args, **kwargs):
        calls["update"] += 1
        return apply(*args, **kwargs)

    def counted_metrics(self, *args, **kwargs):
        calls["metrics"] += 1
        return update_metrics(self, *args, **kwargs)

    monkeypatch.setattr(tf_optimizer, "apply_gradients", counted_apply)
    monkeypatch.setattr(global_update.GlobalUpdate, "update_metrics", counted_metrics)


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



def test_predict_on_batches_of_many_sizes_stops_tracing_its_step_and_warns_of_no_retracing(caplog):
    # As Keras' own predict function (`reduce_retracing`): after a few batch shapes, one trace
    # serves every batch size; TensorFlow warned of frequent retracing when each size had its own.
    import logging

    with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model()
    reference = _model()
    rng = np.random.default_rng(1)
    traces = {}
    with caplog.at_level(logging.WARNING):
        for rows in range(1, 14):
            x = rng.normal(size=(rows, 4)).astype("float32")
            np.testing.assert_allclose(model.predict(x, batch_size=rows, verbose=0),
                                       reference.predict(x, batch_size=rows, verbose=0), rtol=1e-6, atol=1e-6)
            step = model._ks_replica_step.train_step.__self__._compiled_steps["predict"]
            traces[rows] = step._step.experimental_get_tracing_count()
    assert not [record for record in caplog.records if "retracing" in record.getMessage()]
    assert traces[13] == traces[4] <= 4, traces  # none after the fourth size
