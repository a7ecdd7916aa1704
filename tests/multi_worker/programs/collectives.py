"""One worker: cross-worker sums of mixed tensors (kept or donated) and `fit` of a wide model.

Writes `<out>/worker_<task id>.npz`; the chief also writes the wide model's
initial weights, from which the test computes the single-process reference.
`collectives.py OUT wide-only` runs the wide model's `fit` alone.
"""

import gc
import json
import os
import sys

import keras_strategies as ks
from keras_strategies.backend import engine
from keras_strategies.trainer.exchange_in_program import ExchangeInProgram

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=120))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    GLOBAL_BATCH, build_model, build_own_steps_model, build_wide_model, collective_values, data, keras_run,
    scatter_values, wide_data,
)

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
results = {}


def _in_backward_pass() -> bool:
    """Whether a PyTorch backward pass is running (the other engines never report one)."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch._C._current_graph_task_id() >= 0


def wide_fit() -> None:
    """`fit` of a model with two 1 MiB gradients, recording what its exchanges send.

    With `bytes_per_pack=1`, where gradients go in buckets during the backward
    pass (PyTorch, one replica per worker), each gradient is a bucket of its own.
    """
    keras.utils.set_random_seed(100 + task_id)
    strategy = ks.MultiWorkerMirroredStrategy(
        communication_options=ks.CommunicationOptions(timeout_seconds=120, bytes_per_pack=1))
    with strategy.scope():
        model = build_wide_model()
    if strategy.extended.should_checkpoint:
        np.savez(os.path.join(out, "wide_initial.npz"), *model.get_weights())
    x, y = wide_data()
    # What the train step's exchanges send: the sizes of the values of 1 MiB or more (every
    # cross-worker sum starts with `_start_cross_worker_sum`).
    # Also what each sum was and whether it started inside a backward pass.
    start_sum, large_sizes, started = strategy.extended._start_cross_worker_sum, [], []

    def recording_sum(values, what="all-reduce", donated=False):
        if what == "gradient all-reduce":
            sizes = [int(np.prod(tuple(v.shape))) for v in values]
            large_sizes.append(sorted(size for size in sizes if size * 4 >= 1 << 20))
        started.append([what, _in_backward_pass()])
        return start_sum(values, what, donated)

    strategy.extended._start_cross_worker_sum = recording_sum
    # Steps whose exchange ran inside the compiled step instead (TensorFlow, after the first).
    in_program_steps = []
    in_program_run = ExchangeInProgram.run
    ExchangeInProgram.run = lambda self, kind, *args: (
        in_program_steps.append(kind == "train") or in_program_run(self, kind, *args))
    # With the garbage collector off: a train step's own objects must be freed as soon as the
    # step ends, not left in reference cycles (which kept its autograd graph alive).
    gc.collect()
    gc.disable()
    try:
        wide_run = keras_run(model, x, y)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kinds = ("OverlappedExchange", "GradientBuckets", "Exchange")
        results["step_objects_in_cycles"] = json.dumps(sorted(type(o).__name__ for o in gc.garbage if type(o).__name__ in kinds))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    del strategy.extended._start_cross_worker_sum
    ExchangeInProgram.run = in_program_run
    results["steps_exchanging_in_program"] = sum(in_program_steps)
    results["large_sent"] = json.dumps(large_sizes)  # per sum (the first step sends its rows again)
    results["sums_started"] = json.dumps(started)
    for key, value in wide_run.items():
        if key == "weights":
            for i, weight in enumerate(value):
                results[f"weights_{i}"] = weight
        else:
            results[key] = np.asarray(value)


if sys.argv[2:] == ["wide-only"]:  # 2 x 2 devices: the wide model alone
    wide_fit()
    np.savez(os.path.join(out, f"worker_{task_id}.npz"), **results)
    sys.exit(0)

# Kept: the inputs must be unchanged afterwards.
inputs = [ops.convert_to_tensor(v) for v in collective_values(task_id)]
before = [ops.convert_to_numpy(t).copy() for t in inputs]
kept = strategy.extended._cross_worker_sum(inputs, "kept values")
results["inputs_unchanged"] = all(np.array_equal(ops.convert_to_numpy(t), b) for t, b in zip(inputs, before))
for i, value in enumerate(kept):
    results[f"kept_{i}"] = ops.convert_to_numpy(value)

# All-gathered: every worker's values (0-d and empty too), stacked in worker order.
gathered = engine.collectives.all_gather([ops.convert_to_tensor(v) for v in collective_values(task_id)])
for i, value in enumerate(gathered):
    results[f"gathered_{i}"] = ops.convert_to_numpy(value)

# Reduce-scattered: this worker's row of every worker's values, summed (twice: a signature seen
# before takes its compiled program again).
for k in range(2):
    scattered = engine.collectives.reduce_scatter_sum([ops.convert_to_tensor(v) for v in scatter_values(task_id)])
    for i, value in enumerate(scattered):
        results[f"scattered_{k}_{i}"] = ops.convert_to_numpy(value)

# Results held while more sums of the same shapes run (the engines may reuse their
# buffers, but never under a live result): the first results must not change.
held = strategy.extended._cross_worker_sum([ops.convert_to_tensor(v) for v in collective_values(task_id)], "held")
for _ in range(3):
    strategy.extended._cross_worker_sum([ops.convert_to_tensor(v * 3) for v in collective_values(task_id)], "later")
for i, value in enumerate(held):
    results[f"held_{i}"] = ops.convert_to_numpy(value)

# The same signatures again and again, with another one in between: every call gets its own
# sums (TensorFlow's eager programs reuse their instance keys from call to call).
for k in range(4):
    scaled = [ops.convert_to_tensor(v * (k + 1)) for v in collective_values(task_id)]
    for i, value in enumerate(strategy.extended._cross_worker_sum(scaled, "repeated")):
        results[f"repeated_{k}_{i}"] = ops.convert_to_numpy(value)
    between = strategy.extended._cross_worker_sum([np.full((3,), float(k + task_id), "float32")], "between")
    results[f"between_{k}"] = ops.convert_to_numpy(between[0])
# TensorFlow: signatures past the cap of keyed programs take the launcher's program (fresh keys).
if hasattr(engine.collectives, "MAX_KEYED_SIGNATURES"):
    engine.collectives.MAX_KEYED_SIGNATURES = len(engine.collectives._state["keyed"])
    for k in range(2):
        for n in (2, 9):
            (total,) = strategy.extended._cross_worker_sum([np.full((n,), float(k + task_id), "float32")], "past the cap")
            results[f"past_cap_{k}_{n}"] = ops.convert_to_numpy(total)

# Donated, with the first (large) tensor given twice: shared memory must not be summed twice.
donated_inputs = [ops.convert_to_tensor(v) for v in collective_values(task_id)]
donated_inputs.append(donated_inputs[0])
for i, value in enumerate(strategy.extended._cross_worker_sum(donated_inputs, "donated values", donated=True)):
    results[f"donated_{i}"] = ops.convert_to_numpy(value)

# Training where two gradients are large enough to be reduced on their own.
wide_fit()

# Batches shuffled after `batch()` without a seed: the partial batch moves to different steps on
# different workers. Every worker gets the same clear error at the same step (not a collective
# that fails inside the backend), and the workers stay in step: the next `fit` trains.
import tensorflow as tf  # noqa: E402

for name, build in (("keras_steps", build_model), ("own_steps", build_own_steps_model)):
    with strategy.scope():
        small = build()
    moved = tf.data.Dataset.from_tensor_slices(data()).batch(GLOBAL_BATCH).shuffle(4, seed=task_id)
    try:
        small.fit(moved, epochs=2, verbose=0)
        results[f"{name}_different_sizes_error"] = ""
    except RuntimeError as error:
        results[f"{name}_different_sizes_error"] = str(error)
    results[f"{name}_iterations_after_error"] = int(ops.convert_to_numpy(small.optimizer.iterations))
    history = small.fit(*data(), batch_size=GLOBAL_BATCH, epochs=1, verbose=0).history
    results[f"{name}_fit_after_error"] = history["loss"]

# A model dropped before its variables were synced, freed by one worker's garbage collector and
# not by the other's: both still send the same variables, and the next model trains in step.
gc.disable()
with strategy.scope():
    dropped = build_model()
object.__setattr__(dropped, "_cycle", [dropped])  # freed only by a collection
del dropped
if task_id == 1:
    gc.collect()
with strategy.scope():
    after_dropped = build_model()
results["after_dropped_loss"] = after_dropped.fit(*data(), batch_size=GLOBAL_BATCH, epochs=1, verbose=0).history["loss"]
results["after_dropped_weights"] = np.concatenate([w.ravel() for w in after_dropped.get_weights()])
gc.enable()

# A callback that changes the model on the chief alone when training begins (as BackupAndRestore
# restores a backup): every worker trains from the chief's state.
class ChiefSetsWeights(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        if task_id == 0:
            self.model.set_weights([np.full(w.shape, 0.05, w.dtype) for w in self.model.get_weights()])


with strategy.scope():
    restored = build_model()
history = restored.fit(*data(), batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=[ChiefSetsWeights()]).history
results["chief_set_loss"] = history["loss"]
results["chief_set_weights"] = np.concatenate([w.ravel() for w in restored.get_weights()])

# Last: workers that create different variables get a clear error on every worker, not a
# collective mismatch inside the backend.
with strategy.scope():
    extra = [keras.Variable(np.zeros((3,), "float32")) for _ in range(1 + task_id)]
try:
    strategy.run(lambda: 0)
    results["different_variables_error"] = ""
except RuntimeError as error:
    results["different_variables_error"] = str(error)

np.savez(os.path.join(out, f"worker_{task_id}.npz"), **results)
