"""Per-worker input (the opt-out): each worker reads its own, unequal shard.

Worker 0 holds 30 samples, worker 1 holds 14; batches of 8 per worker, so
worker 1 runs out after 2 of 4 steps per epoch and takes part with empty
batches. `fit` / `evaluate` / `predict` on tf.data datasets with
AutoShardPolicy.OFF, then a custom loop over `distribute_datasets_from_function`.
"""

import os
import sys

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=120))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import build_model, data  # noqa: E402

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
SPLIT, PER_WORKER_BATCH = 30, 8
x, y = data(44)
mine = slice(0, SPLIT) if task_id == 0 else slice(SPLIT, None)


def own_dataset(batch_size):
    dataset = tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(batch_size)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


keras.utils.set_random_seed(100 + task_id)
with strategy.scope():
    model = build_model()
if strategy.extended.should_checkpoint:
    np.savez(os.path.join(out, "initial.npz"), *model.get_weights())
history = model.fit(own_dataset(PER_WORKER_BATCH), epochs=2, verbose=0)
results = {
    "loss": history.history["loss"],
    "evaluate": model.evaluate(own_dataset(PER_WORKER_BATCH), verbose=0),
    "predict": model.predict(tf.data.Dataset.from_tensor_slices(x[mine]).batch(PER_WORKER_BATCH).with_options(
        own_dataset(1).options()), verbose=0),
}
for i, w in enumerate(model.get_weights()):
    results[f"weights_{i}"] = w


# A custom loop over per-pipeline datasets of unequal length: every worker takes the same steps.
def dataset_fn(context):
    assert (context.num_input_pipelines, context.input_pipeline_id) == (2, task_id), context
    return tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(context.get_per_replica_batch_size(4 * context.num_replicas_in_sync))


with strategy.scope():
    optimizer = keras.optimizers.SGD(0.01)
steps = 0
for inputs in strategy.distribute_datasets_from_function(dataset_fn):
    def step_fn(batch):
        features, labels = batch
        loss, grads = ks.value_and_grad(lambda: ops.sum(ops.square(model(features) - labels)) / 100.0, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    strategy.run(step_fn, args=(inputs,))
    steps += 1
results["loop_steps"] = steps
for i, w in enumerate(model.get_weights()):
    results[f"loop_weights_{i}"] = w
np.savez(os.path.join(out, f"worker_{task_id}.npz"), **{k: np.asarray(v) for k, v in results.items()})
