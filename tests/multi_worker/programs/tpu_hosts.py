"""`TPUStrategy` over the hosts of a TPU slice, on 127.0.0.1: `tpu_hosts.py OUT`.

Cloud TPU's environment (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`) names this
cluster's workers as the slice's hosts, and each host's TPU cores are its
virtual CPU devices (the test-only `_test_devices`). Each worker writes its
initial weights, the shard rows of every step, `fit`'s history and weights, and
`evaluate` and `predict`, for the test to compare with one device.
"""

import json
import os
import sys

import keras
import numpy as np

import keras_strategies as ks
from keras_strategies.trainer import replica_step

out = sys.argv[1]
config = json.loads(os.environ["TF_CONFIG"])
os.environ["TPU_WORKER_HOSTNAMES"] = ",".join(config["cluster"]["worker"])
os.environ["TPU_WORKER_ID"] = str(config["task"]["index"])

strategy = ks.TPUStrategy(_test_devices=["cpu:0", "cpu:1"])
worker = strategy.extended._worker_index

rows = []
original = replica_step.make_shards


def recording(*args, **kwargs):
    shards = original(*args, **kwargs)
    rows.append([int(np.shape(x)[0]) for x, *_ in shards.per_replica])
    return shards


replica_step.make_shards = recording
rng = np.random.default_rng(0)
x = rng.uniform(size=(19, 3)).astype("float32")  # global batches of 8: 8, 8 and a partial 3
y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"], steps_per_execution=2)
initial = model.get_weights()
history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
evaluated = model.evaluate(x, y, batch_size=8, verbose=0)
predicted = model.predict(x, batch_size=8, verbose=0)
np.savez(
    os.path.join(out, f"worker_{worker}.npz"),
    replicas=strategy.num_replicas_in_sync, static=strategy.extended.experimental_require_static_shapes,
    rows=np.array(rows), loss=history["loss"], mae=history["mae"], evaluated=np.array(evaluated),
    predicted=predicted, x=x, y=y,
    **{f"initial_{i}": w for i, w in enumerate(initial)},
    **{f"weights_{i}": w for i, w in enumerate(model.get_weights())},
)
