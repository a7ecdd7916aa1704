"""One worker of a multi-worker run of `ShardedDataParallelStrategy`: at stage 1, fit / evaluate /
predict, the guide's custom loop, what each replica stores, and whole checkpoints; at stage 2
(the gradients reduce-scattered across the workers), fit / evaluate / predict, the custom loop
and the gradient bytes each replica held, and fit with a LossScaleOptimizer over use_ema's
averages and with an Embedding.

Each worker starts from different random weights (the chief's must win); the chief writes the
initial weights, from which the test computes the single-process reference, and the model saved
under every replica of the cluster (`sharded.keras`, `sharded.weights.h5`), which the test loads
under fewer replicas and under none. Every worker writes its results to `sharded_worker_<task id>.npz`.
"""

import os
import sys

import keras_strategies as ks

strategy = ks.experimental.ShardedDataParallelStrategy(
    communication_options=ks.CommunicationOptions(timeout_seconds=120))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import (GLOBAL_BATCH, adam, build_embedding_model, build_model, build_scaled_averaged_model,  # noqa: E402
                    data, embedding_data, guide_loop, keras_run, scaled_data)

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
keras.utils.set_random_seed(200 + task_id)
results = {"num_replicas": strategy.num_replicas_in_sync, "stage": strategy.extended.stage}

with strategy.scope():
    model = build_model()
if strategy.extended.should_checkpoint:
    np.savez(os.path.join(out, "sharded_initial.npz"), *model.get_weights())
for key, value in keras_run(model, *data()).items():
    if key == "weights":
        results.update({f"fit_weights_{i}": w for i, w in enumerate(value)})
    else:
        results[f"fit_{key}"] = np.asarray(value)

# What this worker's replicas hold: one piece of every variable each, and the optimizer's slots
# (Adam's two moments) for those pieces only.
state = strategy.extended.optimizer_state(model.optimizer)
results["first_piece"] = state.layout.first
results["num_pieces"] = state.layout.num_pieces
results["piece_lengths"] = np.array([[int(p.shape[0]) for p in pieces] for pieces in state.pieces])
results["slot_bytes"] = np.array(state.slot_bytes_per_replica())
results["optimizer_built_whole"] = len(model.optimizer.variables) > 2

# Every worker saves, as under tf.distribute; the chief's files are the ones written there.
model.save(os.path.join(out, "sharded.keras"))
model.save_weights(os.path.join(out, "sharded.weights.h5"))


# The guide's custom loop with Adam: `apply_gradients` inside `run` updates the pieces.
with strategy.scope():
    loop_model = build_model()
    optimizer = adam()
if strategy.extended.should_checkpoint:
    np.savez(os.path.join(out, "sharded_loop_initial.npz"), *loop_model.get_weights())
dataset = tf.data.Dataset.from_tensor_slices(data()).batch(GLOBAL_BATCH)
results["loop_losses"] = np.asarray(guide_loop(strategy, loop_model, optimizer, dataset, ks))
results.update({f"loop_weights_{i}": w for i, w in enumerate(loop_model.get_weights())})

# Stage 2: each replica's gradients cut into the pieces of every replica of every worker, each
# worker summing its replicas' and the workers reduce-scattering the sums.
stage_2 = ks.experimental.ShardedDataParallelStrategy(stage=2, communication_options=ks.CommunicationOptions(timeout_seconds=120))
keras.utils.set_random_seed(300 + task_id)
with stage_2.scope():
    model_2 = build_model()
    loop_model_2 = build_model()
    optimizer_2 = adam()
if stage_2.extended.should_checkpoint:
    np.savez(os.path.join(out, "sharded_initial_2.npz"), *model_2.get_weights())
    np.savez(os.path.join(out, "sharded_loop_initial_2.npz"), *loop_model_2.get_weights())
results["stage_2"] = stage_2.extended.stage
for key, value in keras_run(model_2, *data()).items():
    if key == "weights":
        results.update({f"fit2_weights_{i}": w for i, w in enumerate(value)})
    else:
        results[f"fit2_{key}"] = np.asarray(value)
results["gradient_bytes_2"] = np.array(stage_2.extended.optimizer_state(model_2.optimizer).gradient_bytes)
results["loop2_losses"] = np.asarray(guide_loop(stage_2, loop_model_2, optimizer_2, dataset, ks))
results.update({f"loop2_weights_{i}": w for i, w in enumerate(loop_model_2.get_weights())})

# Stage 2 with a LossScaleOptimizer over an Adam keeping use_ema's averages, and with an Embedding
# (whose gradient is sliced on TensorFlow).
keras.utils.set_random_seed(400 + task_id)
with stage_2.scope():
    more = {"scaled": (build_scaled_averaged_model(), scaled_data()),
            "embedding": (build_embedding_model(), embedding_data())}
for name, (fitted, fit_data) in more.items():
    if stage_2.extended.should_checkpoint:
        np.savez(os.path.join(out, f"sharded_{name}_initial.npz"), *fitted.get_weights())
    for key, value in keras_run(fitted, *fit_data).items():
        if key == "weights":
            results.update({f"{name}_weights_{i}": w for i, w in enumerate(value)})
        else:
            results[f"{name}_{key}"] = np.asarray(value)
    results[f"{name}_iterations"] = int(keras.ops.convert_to_numpy(fitted.optimizer.iterations))

np.savez(os.path.join(out, f"sharded_worker_{task_id}.npz"), **results)
print("SHARDED DONE", flush=True)
