"""One worker of a two-worker run of keras-hub's task models (`hub_models.TWO_WORKER_MODELS`): fit, evaluate,
predict, save (the chief's file) and load under `MultiWorkerMirroredStrategy`.

Each worker starts from different random weights (the chief's must win); the chief writes each
model's initial weights (`hub_<name>_initial.npz`), from which the test computes the
single-process reference, and every worker writes its results to `hub_worker_<task id>.npz`.
"""

import os
import sys

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=120))

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import hub_models  # noqa: E402

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
results = {}
for name in hub_models.TWO_WORKER_MODELS:
    build, make_data, _ = hub_models.MODELS[name]
    keras.utils.set_random_seed(100 + task_id)
    data = make_data()
    with strategy.scope():
        model = build()
    if strategy.extended.should_checkpoint:
        np.savez(os.path.join(out, f"hub_{name}_initial.npz"), *model.get_weights())
    history = hub_models.fit(model, data)
    for key, values in history.items():
        results[f"{name}/history/{key}"] = np.asarray(values)
    for i, weight in enumerate(model.get_weights()):
        results[f"{name}/weight/{i}"] = weight
    for key, value in hub_models.evaluate(model, data).items():
        results[f"{name}/evaluate/{key}"] = np.asarray(value)
    predictions = hub_models.predict(model, data)
    results[f"{name}/predict"] = predictions
    # Every worker saves, as under tf.distribute; the chief's file is the one written there.
    path = os.path.join(out, f"hub_{name}.keras")
    model.save(path)
    if strategy.extended.should_checkpoint:
        loaded = keras.models.load_model(path)
        results[f"{name}/loaded_difference"] = np.max(np.abs(hub_models.predict(loaded, data) - predictions))
np.savez(os.path.join(out, f"hub_worker_{task_id}.npz"), **results)
print("KERAS HUB DONE", flush=True)
