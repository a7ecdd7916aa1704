"""One worker of a multi-worker run: fit / evaluate / predict and the guide's custom loop.

Each worker starts from different random weights (the chief's must win) and
writes its results to `<out>/worker_<task id>.npz`; the chief also writes the
initial weights of each model, from which the test computes the single-process reference.
"""

import functools
import json
import os
import sys
import warnings

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=120))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from keras import ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    GLOBAL_BATCH, LOOPS, build_embedding_model, build_mixed_model, build_model, build_own_steps_model,
    build_penalty_model, build_sync_bn_model, build_two_output_model, data, dropout_counts, embedding_run,
    evaluate_first_run, global_batch_sizes, guide_loop, keras_run, reshuffled_run, seeded_shuffle_run, stopped_run, two_output_run, uneven_run,
)  # noqa: E402

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
keras.utils.set_random_seed(100 + task_id)
x, y = data()
results = {"num_replicas": strategy.num_replicas_in_sync}



def run_keras(name, build, run=keras_run, in_strategy=strategy):
    """Builds a model in scope (the chief saves its initial weights) and runs `run` on it."""
    with in_strategy.scope():
        model = build()
    if strategy.extended.should_checkpoint:
        np.savez(os.path.join(out, f"{name}_initial.npz"), *model.get_weights())
    for key, value in run(model, x, y).items():
        results[f"{name}_{key}"] = value
    return model


# Keras fit / evaluate / predict on NumPy arrays (the last global batch is partial).
model = run_keras("fit", build_model)
run_keras("evaluated_first", build_model, evaluate_first_run)

# Count metrics: every row is a true positive or a false negative of its sign, so their totals are
# the dataset's row count, once, on every worker. (Keras 3.16's PyTorch trainer sums metric
# variables over the processes itself; a second sum would multiply them by the worker count.)
with strategy.scope():
    counted = build_model()
    counted.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.TruePositives(0.0, name="tp"),
                                                          keras.metrics.FalseNegatives(0.0, name="fn")])
counted_history = counted.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0).history
counted_logs = counted.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
counted_result = counted.get_metrics_result()
results["count_metrics"] = np.array([counted_history["tp"][0] + counted_history["fn"][0],
                                     counted_logs["tp"] + counted_logs["fn"],
                                     float(counted_result["tp"]) + float(counted_result["fn"])])


def run_loop(name):
    """The guide's custom loop on a tf.data dataset (new variables: the chief's values are broadcast)."""
    build, make_optimizer, make_data = LOOPS[name]
    with strategy.scope():
        loop_model = build()
        optimizer = make_optimizer()
    if strategy.extended.should_checkpoint:
        np.savez(os.path.join(out, f"{name}_initial.npz"), *loop_model.get_weights())
    dataset = tf.data.Dataset.from_tensor_slices(make_data()).batch(GLOBAL_BATCH)
    results[f"{name}_losses"] = guide_loop(strategy, loop_model, optimizer, dataset, ks)
    results[f"{name}_weights"] = loop_model.get_weights()


run_loop("loop")
# Synchronized BatchNormalization in the custom loop (JAX: sums between eager replica threads).
run_loop("bn_loop")
# An Embedding with Adam: on TensorFlow its gradients are IndexedSlices, gathered across workers
# as TF does; Adam's slots are created inside the compiled step.
run_loop("embedding_loop")

# A model without `keras.Input` builds on its first call, inside `strategy.run` (as in TensorFlow's
# custom-training guide; compiled on TensorFlow): every worker creates its variables there, as in
# `strategy.scope()`, and takes the chief's values at once, before any replica reads them.
keras.utils.set_random_seed(200 + task_id)  # `fit` gave every worker the chief's RNG states: differ again
with strategy.scope():
    lazy_model = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
lazy_batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH))
lazy_outputs = ks.function(lambda features: strategy.run(lazy_model, args=(features,)))(next(iter(lazy_batches)))
results["lazy_outputs"] = ops.convert_to_numpy(strategy.gather(lazy_outputs, axis=0))
results["lazy_weights"] = lazy_model.get_weights()

# A custom loop with metrics and unsynchronized BatchNormalization: the values written in
# strategy.run combine across workers (metric totals add up, moving statistics average).
with strategy.scope():
    unsync_model = build_sync_bn_model(synchronized=False)
    unsync_optimizer = keras.optimizers.SGD(0.05)
    seen, rows = keras.metrics.Mean(), keras.metrics.Sum()


def metrics_step(inputs, global_batch_size):
    features, labels = inputs
    seen.update_state(features[:, 0])
    rows.update_state(ops.ones_like(features[:, 0]))
    loss_fn = lambda: ks.compute_average_loss(  # noqa: E731
        ops.square(unsync_model(features, training=True) - labels)[:, 0], global_batch_size=global_batch_size)
    _, grads = ks.value_and_grad(loss_fn, unsync_model.trainable_variables)
    unsync_optimizer.apply_gradients(zip(grads, unsync_model.trainable_variables))


dist_dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
for inputs, size in zip(dist_dataset, global_batch_sizes()):
    strategy.run(metrics_step, args=(inputs, size))
results["loop_metrics"] = np.array([float(seen.result()), float(rows.result())])
results["unsync_loop_weights"] = unsync_model.get_weights()

# A model with its own train_step / test_step / predict_step (run per replica).
run_keras("own", build_own_steps_model)

# Synchronized BatchNormalization: statistics of the global batch, across workers.
run_keras("bn", build_sync_bn_model)

# Synchronized BatchNormalization and a data-dependent add_loss term on uneven shards at every step
# (on 2 x 2 only: with one device per worker, no worker pads its shards).
if strategy.num_replicas_in_sync == 4:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*do not split evenly")  # on JAX these steps run eagerly
        run_keras("penalty", build_penalty_model, uneven_run)

# An Embedding with Adam (IndexedSlices gradients on TensorFlow).
run_keras("embedding", build_embedding_model, embedding_run)

# Dict outputs and targets, sample weights, and a "sum" and a "mean_with_sample_weight" loss
# (on 2 x 1 devices only: the same code path, at a quarter of the JAX compile time of both).
if strategy.num_replicas_in_sync == 2:
    # Mixed precision: half-float predictions cross workers (TF's CPU collectives crash on them,
    # torch cannot read NumPy's bfloat16).
    for policy in ("mixed_float16", "mixed_bfloat16"):
        run_keras(policy, functools.partial(build_mixed_model, policy))
    run_keras("outputs", build_two_output_model, two_output_run)
    # A seeded tf.data dataset that reshuffles on every pass: each worker reads each epoch in the
    # order one process reads it (the same number of passes as Keras' own fit).
    run_keras("reshuffled", build_model, reshuffled_run)

# Collectives from strategy.run: all_reduce and gather over every replica of every worker.
def replica_fn():
    ctx = ks.get_replica_context()
    return ctx.all_reduce("SUM", ops.ones((2,)) * (ctx.replica_id_in_sync_group + 1))

results["all_reduce"] = ops.convert_to_numpy(strategy.experimental_local_results(strategy.run(replica_fn))[0])

# all_reduce is differentiable across workers too: L_i = (S w)^2 with S = sum of the replicas'
# scales; its backward pass sums every replica's cotangent 2 S w, times replica i's scale.
with strategy.scope():
    w = keras.Variable(1.0)


def gradient_fn():
    scale = float(ks.get_replica_context().replica_id_in_sync_group + 1)
    loss = lambda: ops.square(ks.get_replica_context().all_reduce("sum", scale * w.value))  # noqa: E731
    return ks.value_and_grad(loss, [w])[1][0]


results["all_reduce_grads"] = np.array(
    [float(ops.convert_to_numpy(g)) for g in strategy.experimental_local_results(strategy.run(gradient_fn))])
ids = strategy.run(lambda: ops.reshape(ops.cast(ks.get_replica_context().replica_id_in_sync_group, "float32"), (1,)))
results["gather"] = ops.convert_to_numpy(strategy.gather(ids, axis=0))
results["reduce_to"] = ops.convert_to_numpy(strategy.extended.reduce_to("sum", ids, "cpu:0"))
values = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.array([ctx.replica_id_in_sync_group], "float32"))
results["value_ids"] = ops.convert_to_numpy(strategy.gather(values, axis=0))

# Random draws differ on every replica of every worker; the generator state stays the same
# (on 2 x 2 only, where each worker has two replicas; 2 x 1 adds nothing to this check).
if strategy.num_replicas_in_sync == 4:
    with strategy.scope():
        generator = keras.random.SeedGenerator(seed=3)
    draws = strategy.run(lambda: keras.random.uniform((1,), seed=generator))
    results["replica_draws"] = ops.convert_to_numpy(strategy.gather(draws, axis=0))
    results["seed_state"] = ops.convert_to_numpy(generator.state.value)
    results["dropout_counts"], results["dropout_weights"] = dropout_counts(strategy)


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return -(-len(x) // GLOBAL_BATCH)

    def __getitem__(self, index):
        rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
        return x[rows], y[rows]


results["evaluate_py_dataset"] = model.evaluate(Batches(), verbose=0)

# fit with shuffle=True: every worker draws from the chief's RNG states, so all slice the same batches.
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=True, verbose=0)
results["shuffled_weights"] = model.get_weights()


# fit(shuffle=True) on a PyDataset (batch order from Python's `random`) and a torch DataLoader
# (sampler from torch's default generator): each worker's RNGs were seeded differently above,
# so only the chief's RNG states, which every worker takes over, make them read the same order.
class RecordedBatches(Batches):
    def __init__(self, read):
        super().__init__()
        self.read = read

    def __getitem__(self, index):
        self.read.append(index)
        return super().__getitem__(index)


class RecordedRows(torch.utils.data.Dataset):
    def __init__(self, read):
        self.read = read

    def __len__(self):
        return len(x)

    def __getitem__(self, index):
        self.read.append(index)
        return x[index], y[index]


torch.manual_seed(100 + task_id)
for name, make in (("py_dataset", RecordedBatches),
                   ("data_loader", lambda read: torch.utils.data.DataLoader(RecordedRows(read), batch_size=GLOBAL_BATCH,
                                                                           shuffle=True))):
    read = []
    model.fit(make(read), epochs=2, verbose=0)
    results[f"{name}_order"] = np.array(read)


# fit(shuffle=True) with validation, each worker seeded differently: every worker takes over the
# chief's RNG states, so all draw the order one process seeded like the chief draws.
run_keras("seeded_shuffle", build_model, functools.partial(seeded_shuffle_run, seed=300 + task_id))


class StopsOnTheChiefOnly(keras.callbacks.Callback):
    """Sets `stop_training` on one worker (as a time limit would): every worker must stop with it."""

    def on_epoch_end(self, epoch, logs=None):
        if task_id == 0 and epoch == 1:
            self.model.stop_training = True


history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, verbose=0, callbacks=[StopsOnTheChiefOnly()])
results["chief_stop_epochs"] = len(history.history["loss"])

# Again a stop asked on the chief only, now within the first epoch: every worker stops at that
# step (Keras steps on 2 x 2, the model's own steps on 2 x 1: the stop does not depend on the devices).
if strategy.num_replicas_in_sync == 4:
    run_keras("stopped", build_model, functools.partial(stopped_run, active=task_id == 0))
else:
    run_keras("own_stopped", build_own_steps_model, functools.partial(stopped_run, active=task_id == 0))

# Chief-only writes when the workers share no file system: each worker is given its own
# directory, and only the chief's may keep files (2 x 1 only: the devices play no part).
if strategy.num_replicas_in_sync == 2:
    own_dir = os.path.join(out, f"files_{task_id}")
    os.makedirs(own_dir)  # CSVLogger, as in Keras, opens its file in an existing directory
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, callbacks=[
        keras.callbacks.CSVLogger(os.path.join(own_dir, "log.csv")),
        keras.callbacks.ModelCheckpoint(os.path.join(own_dir, "ckpt", "epoch_{epoch}.weights.h5"), save_weights_only=True),
        keras.callbacks.TensorBoard(os.path.join(own_dir, "tb")),
    ])
    model.save(os.path.join(own_dir, "method.keras"))
    model.save_weights(os.path.join(own_dir, "method.weights.h5"))
    keras.saving.save_model(model, os.path.join(own_dir, "saving_function.keras"))
    keras.models.save_model(model, os.path.join(own_dir, "models_function.keras"))
    keras.saving.save_weights(model, os.path.join(own_dir, "saving_function.weights.h5"))

# PyTorch: a wrapped torch module's buffers (BatchNorm1d's running statistics; Keras does not track
# them) are updated on each replica's own copies and averaged over every replica of every worker.
if keras.backend.backend() == "torch":
    with strategy.scope():
        torch.manual_seed(0)
        batch_norm = torch.nn.BatchNorm1d(5)
        torch_bn_model = keras.Sequential([keras.Input((5,)), keras.layers.TorchModuleWrapper(batch_norm), keras.layers.Dense(1)])
        torch_bn_model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.0))
    # 46 rows: the last global batch of 14 splits 7, 7 (2 x 1) or 4, 4, 3, 3 (2 x 2), none below 2 rows.
    torch_bn_model.fit(x[:46], y[:46], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    results["torch_buffers"] = [b.detach().numpy().astype("float64") for b in batch_norm.buffers()]

# A second strategy for the same cluster (a notebook cell run again) shares the cluster this
# process joined; one for another cluster is refused before it touches the engine (2 x 1 only).
if strategy.num_replicas_in_sync == 2:
    again = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=120))
    run_keras("again", build_model, in_strategy=again)
    other = ks.cluster_resolver.SimpleClusterResolver(
        ks.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}), task_type="worker", task_id=task_id)
    try:
        ks.MultiWorkerMirroredStrategy(cluster_resolver=other)
        results["other_cluster_error"] = "none"
    except RuntimeError as error:
        results["other_cluster_error"] = str(error)

# What this worker listens on, after training: every server of a cluster on 127.0.0.1 keeps to it.
import psutil  # noqa: E402  (installed with the test requirements)

results["own_port"] = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][task_id].rsplit(":", 1)[1]
results["listening"] = sorted({f"{c.laddr.ip} {c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                               if c.status == psutil.CONN_LISTEN})

flat = {}
for key, value in results.items():
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
        for i, v in enumerate(value):
            flat[f"{key}_{i}"] = v
    else:
        flat[key] = np.asarray(value)
np.savez(os.path.join(out, f"worker_{task_id}.npz"), **flat)
print(json.dumps({"task": task_id, "fit_loss": results["fit_loss"]}))
