"""A script with `ks.MultiWorkerMirroredStrategy()` and nothing else, as a launcher starts it.

Whatever launcher started it (torchrun, srun, ours), each worker fits the
model of `common.py` on the global batches and writes `<out>/worker_<task id>.json`:
which resolver the strategy found, the replicas, and on the chief the largest
difference to the same fit on one device in this process (outside the strategy).
"""

import json
import os
import sys

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import GLOBAL_BATCH, build_model, data  # noqa: E402

out = sys.argv[1]
x, y = data()
keras.utils.set_random_seed(1)
reference = build_model()
initial = reference.get_weights()
with strategy.scope():
    model = build_model()
model.set_weights(initial)
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
resolver = strategy.cluster_resolver
result = {
    "resolver": type(resolver).__name__,
    "task": [resolver.task_type, resolver.task_id],
    "num_replicas": strategy.num_replicas_in_sync,
    "is_chief": strategy.extended.should_checkpoint,
}
if strategy.extended.should_checkpoint:
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    result["max_difference"] = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights()))
with open(os.path.join(out, f"worker_{resolver.task_id}.json"), "w") as file:
    json.dump(result, file)
