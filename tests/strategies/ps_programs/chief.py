"""The chief of a parameter-server cluster: each scenario's numbers, printed as one JSON line.

`one_worker`: TensorFlow's custom loop and `fit` against a single device on
the same batches (with and without a 3-shard partitioner) and the clear
errors; `two_workers`: every scheduled step is applied once and the loss falls;
`worker_failure`: `fit` goes on when a worker is killed and restarted;
`ps_failure`: how soon a parameter server killed with SIGKILL is reported, and how.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_strategies as ks

scenario, cluster = sys.argv[1], json.loads(sys.argv[2])
results = {}

x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
BATCH, EPOCHS = 8, 3


def strategy_for(partitioner=None):
    resolver = ks.cluster_resolver.SimpleClusterResolver(
        ks.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    return ks.ParameterServerStrategy(resolver, variable_partitioner=partitioner)


def build(compiled=True):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
    if compiled:
        model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"], steps_per_execution=2)
    return model


def max_difference(a, b):
    return float(max(np.abs(np.asarray(u) - np.asarray(v)).max() for u, v in zip(a, b)))


def dataset_fn(_):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


def custom_loop(strategy, steps):
    """TensorFlow's parameter-server tutorial's custom loop, with `s/tf.distribute/ks/`."""
    with strategy.scope():
        model = build(compiled=False)
        optimizer = keras.optimizers.RMSprop(learning_rate=0.05)
        mean_loss = keras.metrics.Mean()
    initial = [v.numpy() for v in model.weights]

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = keras.losses.MeanSquaredError(reduction=None)(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            mean_loss.update_state(loss)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(ks.ReduceOp.SUM, losses, axis=None)

    coordinator = ks.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)
    losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(steps)]
    coordinator.join()
    return model, optimizer, mean_loss, initial, [float(loss.fetch()) for loss in losses], coordinator, step_fn, \
        per_worker_iterator


def reference_loop(initial, steps):
    model = build(compiled=False)
    for variable, value in zip(model.weights, initial):
        variable.assign(value)
    optimizer = keras.optimizers.RMSprop(learning_rate=0.05)
    losses = []
    for step, (bx, by) in enumerate(dataset_fn(None).take(steps)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.MeanSquaredError(reduction=None)(by, model(bx, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return model, losses


def error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return [type(e).__name__, str(e)]
    return None


if scenario == "one_worker":
    for name, shards in (("round_robin", None), ("three_shards", 3)):
        partitioner = None if shards is None else tf.distribute.experimental.partitioners.FixedShardsPartitioner(shards)
        strategy = strategy_for(partitioner)
        model, optimizer, mean_loss, initial, losses, coordinator, step_fn, iterator = custom_loop(strategy, 7)
        reference, reference_losses = reference_loop(initial, 7)
        results[f"loop_{name}"] = {
            "weights": max_difference([v.numpy() for v in model.weights], [v.numpy() for v in reference.weights]),
            "losses": max_difference([losses], [reference_losses]),
            "mean_loss": abs(float(mean_loss.result()) - float(np.mean(reference_losses))),
            "iterations": int(optimizer.iterations.numpy()),
            "kernel_shards": len(getattr(model.weights[0].value, "variables", [model.weights[0].value])),
            "devices": sorted({v.device for w in model.weights for v in getattr(w.value, "variables", [w.value])}),
        }

        with strategy.scope():
            fitted = build()
        history = fitted.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                             validation_data=(x[:16], y[:16]))
        single = build()
        single_history = single.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                                    validation_data=(x[:16], y[:16]))
        results[f"fit_{name}"] = {
            "weights": max_difference([v.numpy() for v in fitted.weights], [v.numpy() for v in single.weights]),
            "history": max_difference([history.history[k] for k in sorted(single_history.history)],
                                      [single_history.history[k] for k in sorted(single_history.history)]),
            "history_keys": sorted(history.history),
            "iterations": int(fitted.optimizer.iterations.numpy()),
            "evaluate": max_difference([fitted.evaluate(x, y, verbose=0)], [single.evaluate(x, y, verbose=0)]),
            "predict": max_difference([fitted.predict(x, verbose=0)], [single.predict(x, verbose=0)]),
        }

    # The coordinator and fit: clear errors for bad input.
    remote = coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    results["errors"] = {
        "same_coordinator": ks.coordinator.ClusterCoordinator(strategy) is coordinator,
        "remote_value_type": isinstance(remote, ks.coordinator.RemoteValue),
        "schedule_not_callable": error(lambda: coordinator.schedule(5)),
        "schedule_remote_value": error(lambda: coordinator.schedule(step_fn, args=(remote,))),
        "coordinator_of_mirrored": error(lambda: ks.coordinator.ClusterCoordinator(ks.MirroredStrategy(["cpu:0"]))),
        "fit_endless": error(lambda: fitted.fit(endless, epochs=1, verbose=0)),
        "fit_dataset_function": error(lambda: fitted.fit(dataset_fn, epochs=1, verbose=0)),
    }
    # A finite tf.data.Dataset and a dataset function with steps_per_epoch train.
    before = int(fitted.optimizer.iterations.numpy())
    fitted.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0)
    fitted.fit(dataset_fn, epochs=2, steps_per_epoch=3, verbose=0)
    fitted.fit(ks.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=2, verbose=0)
    results["inputs_iterations"] = int(fitted.optimizer.iterations.numpy()) - before

    # Keras' epoch-level callbacks work; one of the user's own with a batch hook is refused.
    import tempfile

    class BatchLogger(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = os.path.join(directory, "model.keras")
        logs = os.path.join(directory, "logs")
        callbacks = [keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
                     keras.callbacks.ModelCheckpoint(checkpoint), keras.callbacks.EarlyStopping("loss", patience=3),
                     keras.callbacks.TensorBoard(logs)]
        history = fitted.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
        events = [os.path.join(logs, "train", name) for name in os.listdir(os.path.join(logs, "train"))]
        results["callbacks"] = {"epochs": len(history.history["loss"]), "checkpoint": os.path.exists(checkpoint),
                                "tensorboard": any(b"epoch_loss" in open(path, "rb").read() for path in events)}
    with strategy.scope():  # fit, evaluate and predict also run when called inside the scope
        in_scope = fitted.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x[:16], y[:16]))
        results["in_scope"] = [sorted(in_scope.history), len(fitted.predict(x, verbose=0)), fitted.evaluate(x, y, verbose=0)]
    # Validation on the epochs `validation_freq` selects: every n-th, or a list of epochs.
    results["validation_freq"] = [
        len(fitted.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, validation_data=(x[:16], y[:16]),
                       validation_freq=freq).history.get("val_loss", []))
        for freq in (2, [1, 3])
    ]
    results["errors"]["batch_callback"] = error(lambda: fitted.fit(x, y, verbose=0, callbacks=[BatchLogger()]))
    results["errors"]["checkpoint_save_freq"] = error(lambda: fitted.fit(
        x, y, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint("unused.keras", save_freq=2)]))
    results["errors"]["tensorboard_update_freq"] = error(lambda: fitted.fit(
        x, y, verbose=0, callbacks=[keras.callbacks.TensorBoard("unused", update_freq=5)]))
    with strategy.scope():
        eager = build()
        eager.compile("sgd", "mse", run_eagerly=True)
    results["errors"]["run_eagerly"] = error(lambda: eager.fit(x, y, verbose=0))

if scenario == "two_workers":
    strategy = strategy_for()
    model, optimizer, mean_loss, initial, losses, coordinator, step_fn, iterator = custom_loop(strategy, 30)
    with strategy.scope():
        fitted = build()
    history = fitted.fit(x, y, batch_size=BATCH, epochs=4, verbose=0)
    results["two_workers"] = {
        "iterations": int(optimizer.iterations.numpy()),
        "first_losses": float(np.mean(losses[:5])),
        "last_losses": float(np.mean(losses[-5:])),
        "fit_iterations": int(fitted.optimizer.iterations.numpy()),
        "fit_losses": history.history["loss"],
    }

if scenario == "worker_failure":  # worker 1 is killed during an epoch of `fit` and restarted
    import signal
    import subprocess
    import threading

    worker_pid, serve_command = int(sys.argv[3]), json.loads(sys.argv[4])
    restarted, killed_in_epoch, in_epoch = [], [], [None]

    def kill_and_restart():
        killed_in_epoch.append(in_epoch[0])  # None: between epochs
        os.kill(worker_pid, signal.SIGKILL)
        restarted.append(subprocess.Popen(serve_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    class KillWorkerDuringEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            in_epoch[0] = epoch
            if epoch == 1:
                threading.Timer(0.05, kill_and_restart).start()

        def on_epoch_end(self, epoch, logs=None):
            in_epoch[0] = None

    strategy = strategy_for()
    with strategy.scope():
        fitted = build()
        fitted.compile(keras.optimizers.SGD(0.01), "mse")
    history = fitted.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0, callbacks=[KillWorkerDuringEpoch()])
    results["worker_failure"] = {
        "iterations": int(fitted.optimizer.iterations.numpy()),
        "scheduled": 3 * 20,
        "restarted": len(restarted),
        "killed_in_epoch": killed_in_epoch,
        "losses": history.history["loss"],
    }
    for process in restarted:
        process.kill()

if scenario == "ps_failure":  # the last scenario: it stops the cluster's parameter server
    import signal
    import time

    strategy = strategy_for()
    model, optimizer, mean_loss, initial, losses, coordinator, step_fn, iterator = custom_loop(strategy, 3)
    os.kill(int(sys.argv[3]), signal.SIGKILL)
    started, failure = time.monotonic(), None
    while failure is None and time.monotonic() - started < 120:
        try:
            coordinator.schedule(step_fn, args=(iterator,))
            coordinator.join()
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            failure = [type(e).__name__, str(e)[:2000]]
    results["ps_failure"] = {"seconds": time.monotonic() - started, "error": failure}

print("RESULT " + json.dumps(results), flush=True)
sys.stdout.flush()
os._exit(0)  # TensorFlow's exit handlers would wait on the cluster the test stops
