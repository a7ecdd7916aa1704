"""`ks.ParameterServerStrategy`, `ks.coordinator` and `ks.Server`.

The front end's checks run on every backend without a cluster. On
TensorFlow, real `worker` and `ps` tasks (`ks.Server(...).join()` in their own
processes, on 127.0.0.1) serve a chief program per scenario: the chief is a
process of its own because a process coordinates one cluster.
"""

import contextlib
import glob
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.launcher.tf_config import free_ports
from reference_loops import average_loss, split, squared_error, train

PROGRAMS = os.path.join(os.path.dirname(__file__), "ps_programs")
BACKEND = keras.backend.backend()


def resolver(cluster, task_type="chief", task_id=0):
    return ks.cluster_resolver.SimpleClusterResolver(ks.ClusterSpec(cluster), task_type=task_type, task_id=task_id)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow's engine is TensorFlow itself, always installed")
def test_without_ray_the_error_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without Ray
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(ImportError, match=r'ParameterServerStrategy on the JAX and PyTorch backends runs on Ray, '
                                          r'which is not installed: `pip install "keras-strategies\[ray\]"`'):
        ks.ParameterServerStrategy(resolver(cluster))


@pytest.mark.parametrize("source", ["resolver", "TF_CONFIG"])
def test_a_cluster_without_a_ps_task_is_refused_before_anything_starts(monkeypatch, source):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    if source == "TF_CONFIG":
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ValueError, match="There must be at least one ps."):
        ks.ParameterServerStrategy(resolver(cluster) if source == "resolver" else None)


# --- a real cluster on 127.0.0.1 (TensorFlow's runtime) --------------------------------------

def _env():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_STRATEGIES_CPU_DEVICES": "1"}


@pytest.fixture(scope="module")
def cluster():
    """Two workers and two parameter servers serving until the module ends; each scenario's chief
    takes the tasks it needs (the same chief address, one chief at a time)."""
    if BACKEND != "tensorflow":
        pytest.skip("the TensorFlow engine; the Ray engine has its own tests")
    ports = free_ports(5)
    full = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
            "ps": [f"127.0.0.1:{p}" for p in ports[3:]]}
    servers = [
        subprocess.Popen([sys.executable, os.path.join(PROGRAMS, "serve.py"), json.dumps(full), job, str(index)],
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for job, index in (("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1))
    ]
    try:
        yield full, servers
    finally:
        for server in servers:
            server.kill()
        for server in servers:
            server.wait()


def run_chief(scenario, cluster, *args, timeout=240):
    run = subprocess.run([sys.executable, os.path.join(PROGRAMS, "chief.py"), scenario, json.dumps(cluster),
                          *map(str, args)], env=_env(), capture_output=True, text=True, timeout=timeout)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        pytest.fail(f"chief exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}", pytrace=False)
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def one_worker(cluster):
    full, _ = cluster
    return run_chief("one_worker", {**full, "worker": full["worker"][:1]})


@pytest.fixture(scope="module")
def two_workers(cluster, one_worker):  # after the one-worker chief: one chief at a time
    full, _ = cluster
    return run_chief("two_workers", {**full, "ps": full["ps"][:1]})


@pytest.fixture(scope="module")
def worker_failure(cluster, two_workers):  # worker 1 is killed and restarted by the chief, which then stops it
    full, servers = cluster
    command = [sys.executable, os.path.join(PROGRAMS, "serve.py"), json.dumps(full), "worker", "1"]
    return run_chief("worker_failure", {**full, "ps": full["ps"][:1]}, servers[1].pid, json.dumps(command))


@pytest.fixture(scope="module")
def ps_failure(cluster, worker_failure):  # last: it kills parameter server 1
    full, servers = cluster
    return run_chief("ps_failure", {**full, "worker": full["worker"][:1], "ps": full["ps"][1:]}, servers[3].pid)


@pytest.mark.parametrize("name", ["round_robin", "three_shards"])
def test_cluster_custom_loop_with_one_worker_equals_one_device(one_worker, name):
    result = one_worker[f"loop_{name}"]
    assert result["weights"] <= 1e-5 and result["losses"] <= 1e-5 and result["mean_loss"] <= 1e-5, result
    assert result["iterations"] == 7
    assert all(device.startswith("/job:ps/") for device in result["devices"]), result["devices"]
    assert len(result["devices"]) == 2  # both parameter servers hold variables
    assert result["kernel_shards"] == (1 if name == "round_robin" else 3)


@pytest.mark.parametrize("name", ["round_robin", "three_shards"])
def test_cluster_fit_with_one_worker_equals_one_device(one_worker, name):
    result = one_worker[f"fit_{name}"]
    assert result["weights"] <= 1e-5 and result["history"] <= 1e-5, result
    assert result["history_keys"] == ["loss", "mae", "val_loss", "val_mae"]
    assert result["iterations"] == 3 * 5  # 3 epochs of 40 rows in batches of 8
    assert result["evaluate"] <= 1e-5 and result["predict"] <= 1e-5


def test_cluster_clear_errors(one_worker):
    errors = one_worker["errors"]
    assert errors["same_coordinator"] and errors["remote_value_type"]
    assert errors["schedule_not_callable"][0] == "TypeError" and "needs a function" in errors["schedule_not_callable"][1]
    assert errors["schedule_remote_value"][0] == "ValueError"
    assert "does not take a RemoteValue" in errors["schedule_remote_value"][1]
    assert errors["coordinator_of_mirrored"][0] == "ValueError"
    for name in ("fit_endless", "fit_dataset_function"):
        assert errors[name][0] == "ValueError" and "`steps_per_epoch` is required" in errors[name][1], errors[name]
    assert one_worker["inputs_iterations"] == 5 + 2 * 3 + 2  # a dataset, a function, a DatasetCreator
    assert errors["batch_callback"][0] == "ValueError" and "BatchLogger overrides on_train_batch_end" in \
        errors["batch_callback"][1]
    assert errors["run_eagerly"][0] == "ValueError" and "`run_eagerly=True` is not supported" in errors["run_eagerly"][1]
    assert errors["checkpoint_save_freq"] == [
        "ValueError", "Callback ModelCheckpoint with save_freq=2 acts on batches, but under ParameterServerStrategy "
        "`fit` schedules steps on the workers and gives callbacks epoch-level logs only. Pass save_freq='epoch'."]
    assert errors["tensorboard_update_freq"][0] == "ValueError"
    assert "TensorBoard with update_freq=5 acts on batches" in errors["tensorboard_update_freq"][1]


def test_cluster_keras_epoch_level_callbacks_work(one_worker):
    assert one_worker["callbacks"] == {"epochs": 2, "checkpoint": True, "tensorboard": True}


def test_cluster_fit_evaluate_and_predict_inside_the_scope(one_worker):
    keys, rows, evaluation = one_worker["in_scope"]
    assert keys == ["loss", "mae", "val_loss", "val_mae"] and rows == 40
    assert len(evaluation) == 2 and min(evaluation) > 0


def test_cluster_fit_validates_on_the_epochs_validation_freq_selects(one_worker):
    assert one_worker["validation_freq"] == [1, 2]  # validation_freq=2 and [1, 3] over 3 epochs


def test_cluster_two_workers_apply_every_step_once(two_workers):
    result = two_workers["two_workers"]
    assert result["iterations"] == 30
    assert result["last_losses"] < result["first_losses"]
    assert result["fit_iterations"] == 4 * 5
    assert result["fit_losses"][-1] < result["fit_losses"][0]


def test_cluster_a_worker_killed_during_fit_loses_no_step(worker_failure):
    result = worker_failure["worker_failure"]
    assert result["restarted"] == 1 and result["killed_in_epoch"] == [1], result
    # At least once: a step that was running on the killed worker runs again elsewhere.
    assert result["scheduled"] <= result["iterations"] <= result["scheduled"] + 1, result
    assert result["losses"][-1] < result["losses"][0]


def test_cluster_a_dead_parameter_server_is_reported_by_name_in_bounded_time(ps_failure):
    result = ps_failure["ps_failure"]
    assert result["error"] is not None and result["seconds"] < 30, result
    assert "/job:ps/replica:0/task:0" in result["error"][1], result["error"]


# --- the Ray engine (JAX, PyTorch): the public API over the run's shared Ray runtime ----------

RAY_ROWS = np.random.RandomState(0).normal(size=(48, 4)).astype("float32")
RAY_TARGETS = (RAY_ROWS @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.25).astype("float32")
RAY_BATCHES = split((RAY_ROWS, RAY_TARGETS), 8, steps=9)
RAY_LOSS = average_loss(squared_error)


@pytest.fixture
def ray_engine(request):
    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow trains with its own runtime (the cluster tests above)")
    return request.getfixturevalue("shared_ray_runtime")


def _ray_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])


def _tutorial_custom_loop(strategy, weights, steps):
    """TensorFlow's parameter-server custom-loop tutorial, with `ks.value_and_grad` and `ks.function`.

    As there, the optimizer is not built in the scope: its first `apply_gradients`, in a
    scheduled step, builds it on the parameter servers.
    """
    with strategy.scope():
        model = _ray_model()
        model.set_weights(weights)
        optimizer = keras.optimizers.Adam(0.05)
        train_loss = keras.metrics.Mean()

    workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")

    def dataset_fn(input_context):
        assert input_context.num_input_pipelines == workers
        assert input_context.input_pipeline_id == ks.coordinator.experimental_get_current_worker_index()
        return itertools.cycle(RAY_BATCHES)

    @ks.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    coordinator = ks.coordinator.ClusterCoordinator(strategy)
    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    @ks.function
    def step_fn(iterator):
        def replica_fn(batch):
            def compute_loss():
                x, y = (keras.ops.convert_to_tensor(a) for a in batch)
                return RAY_LOSS((x, y), model(x, training=True), model.losses)

            loss, grads = ks.value_and_grad(compute_loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_loss.update_state(loss)
            return loss

        losses = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.reduce("SUM", losses, axis=None)

    remote = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(steps)]
    coordinator.join()
    return model, optimizer, train_loss, coordinator, remote


@pytest.mark.parametrize("num_ps, shards", [(1, None), (2, 3)], ids=["1ps", "2ps-3shards"])
def test_ray_custom_loop_with_one_worker_equals_one_device(ray_engine, num_ps, shards):
    weights = _ray_model().get_weights()
    expected_model = _ray_model()
    expected_model.set_weights(weights)
    expected_optimizer = keras.optimizers.Adam(0.05)
    expected_losses = train(expected_model, expected_optimizer, RAY_LOSS, RAY_BATCHES)

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [f"127.0.0.1:{3 + i}" for i in range(num_ps)]}
    partitioner = ks.experimental.partitioners.FixedShardsPartitioner(shards) if shards else None
    strategy = ks.ParameterServerStrategy(resolver(cluster), variable_partitioner=partitioner)
    assert strategy.num_replicas_in_sync == 1
    model, optimizer, train_loss, coordinator, remote = _tutorial_custom_loop(strategy, weights, len(RAY_BATCHES))
    registry = strategy.extended._runtime.registry
    kernel_pieces = registry.layout[registry.keys[id(model.layers[0].kernel)]]
    assert len(kernel_pieces) == (shards or 1)
    assert len(registry.layout[registry.keys[id(optimizer.iterations)]]) == 1  # a partitioner leaves scalars whole
    assert {piece[0] for layout in registry.layout.values() for piece in layout} == set(range(num_ps))
    # Built by the first scheduled step, each slot beside its variable (its pieces on the same servers).
    assert optimizer.built and len(optimizer.variables) == 2 + 2 * len(model.trainable_variables)
    for variable in model.trainable_variables:
        prefix = variable.path.replace("/", "_") + "_"
        slots = [slot for slot in optimizer.variables if slot.name.startswith(prefix)]
        assert len(slots) == 2, (variable.path, [v.name for v in optimizer.variables])
        for slot in slots:
            placed = [piece[:3] for piece in registry.layout[registry.keys[id(slot)]]]
            assert placed == [piece[:3] for piece in registry.layout[registry.keys[id(variable)]]]
    assert all(isinstance(value, ks.coordinator.RemoteValue) for value in remote)
    np.testing.assert_allclose([float(v.fetch()) for v in remote], expected_losses, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(coordinator.fetch(remote), expected_losses, rtol=1e-5, atol=1e-5)
    for actual, expected in zip(model.get_weights(), expected_model.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    for actual, expected in zip(optimizer.variables, expected_optimizer.variables):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert int(optimizer.iterations.numpy()) == len(RAY_BATCHES)
    np.testing.assert_allclose(float(train_loss.result()), np.mean(expected_losses), rtol=1e-5)
    assert ks.coordinator.ClusterCoordinator(strategy) is coordinator


def test_ray_custom_loop_with_two_workers_applies_every_step_once(ray_engine):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"],
               "ps": ["127.0.0.1:4", "127.0.0.1:5"]}
    strategy = ks.ParameterServerStrategy(resolver(cluster))
    steps = 30
    model, optimizer, train_loss, coordinator, remote = _tutorial_custom_loop(
        strategy, _ray_model().get_weights(), steps)
    assert coordinator.done()
    assert int(optimizer.iterations.numpy()) == steps
    assert float(train_loss.count.numpy()) == steps
    losses = [float(v.fetch()) for v in remote]
    assert np.mean(losses[-6:]) < 0.5 * np.mean(losses[:6])


@pytest.mark.parametrize("data", ["arrays", "dataset", "dataset_function"])
def test_ray_fit_with_one_worker_equals_one_device(ray_engine, data):
    import tensorflow as tf

    weights = _ray_model().get_weights()

    def dataset():
        return tf.data.Dataset.from_tensor_slices((RAY_ROWS, RAY_TARGETS)).batch(8)

    def fit(strategy=None):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = _ray_model()
            model.set_weights(weights)
            model.compile(keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        if data == "arrays":  # two calls: the second continues from the first
            history = model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=1, shuffle=False, verbose=0)
            second = model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=1, shuffle=False, verbose=0)
            for key, values in second.history.items():
                history.history[key] += values
        elif data == "dataset":  # a tf.data.Dataset object: its graph is rebuilt on the worker
            history = model.fit(dataset(), epochs=2, verbose=0)
        else:  # a dataset function (on one device: the dataset it builds)
            x = (lambda context: dataset().repeat()) if strategy is not None else dataset().repeat()
            history = model.fit(x, epochs=2, steps_per_epoch=6, verbose=0)
        return model, history.history, model.evaluate(RAY_ROWS, RAY_TARGETS, verbose=0), model.predict(
            RAY_ROWS, verbose=0)

    expected_model, expected_history, expected_evaluation, expected_predictions = fit()
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    model, history, evaluation, predictions = fit(ks.ParameterServerStrategy(resolver(cluster)))
    assert sorted(history) == sorted(expected_history) == ["loss", "mae"]
    for key in history:
        np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5, atol=1e-5)
    for actual, expected in zip(model.get_weights(), expected_model.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 2 * 6
    np.testing.assert_allclose(evaluation, expected_evaluation, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(predictions, expected_predictions, rtol=1e-5, atol=1e-5)


def _ray_compiled(strategy, **compile_kwargs):
    with strategy.scope():
        model = _ray_model()
        model.compile(keras.optimizers.Adam(0.05), loss="mse", **compile_kwargs)
    return model


def _stalling_dataset_fn(marker, stall_at):
    """Endless batches; on worker 0, element `stall_at` waits (to be killed) once, after writing the
    worker's pid to `marker`. When the worker comes back, its rebuilt dataset does not stall again."""

    def dataset_fn(context):
        import tensorflow as tf

        def batches():
            for index in itertools.count():
                if context.input_pipeline_id == 0 and index == stall_at and not os.path.exists(marker):
                    with open(marker + ".tmp", "w") as file:
                        file.write(str(os.getpid()))
                    os.replace(marker + ".tmp", marker)
                    time.sleep(60)  # the test kills this process meanwhile
                yield RAY_BATCHES[index % len(RAY_BATCHES)]

        spec = (tf.TensorSpec((None, 4), "float32"), tf.TensorSpec((None, 1), "float32"))
        return tf.data.Dataset.from_generator(batches, output_signature=spec)

    return dataset_fn


def _sigkill_when_written(path, limit=60.0):
    """A thread that SIGKILLs the process whose pid appears in `path` (the file is written by another process)."""
    def kill():
        deadline = time.monotonic() + limit
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.path.exists(path):
            with open(path) as file:
                os.kill(int(file.read()), signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_ray_fit_with_two_workers_loses_no_step_when_a_worker_is_sigkilled(ray_engine, tmp_path):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"],
               "ps": ["127.0.0.1:4", "127.0.0.1:5"]}
    strategy = ks.ParameterServerStrategy(resolver(cluster))
    model = _ray_compiled(strategy, steps_per_execution=2)  # 2 steps per closure
    marker = str(tmp_path / "worker-0.pid")
    killer = _sigkill_when_written(marker)
    # Worker 0 is killed in its second closure, after that closure's first step reached the parameter
    # servers; the closure runs again on worker 1 (at least once), and the step already applied is
    # not applied again (each update is applied once), so every scheduled step counts exactly once.
    history = model.fit(_stalling_dataset_fn(marker, stall_at=3), epochs=3, steps_per_epoch=6, verbose=0)
    killer.join()
    with open(marker) as file:
        killed = int(file.read())
    assert int(model.optimizer.iterations.numpy()) == 3 * 6
    losses = history.history["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    import ray

    handle = strategy.extended._runtime.workers()[0]
    handle.wait_until_available()  # Ray restarted the worker: a new process
    assert ray.get(handle.actor.ping.remote()) != killed


def test_ray_a_killed_parameter_server_is_named_within_30_s_and_backup_and_restore_resumes(ray_engine, tmp_path):
    import ray

    # The shared runtime's third parameter server is the one tests may kill; the next strategy starts a new one.
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [f"127.0.0.1:{3 + i}" for i in range(3)]}
    strategy = ks.ParameterServerStrategy(resolver(cluster))
    model = _ray_compiled(strategy)
    pid = ray.get(strategy.extended._runtime.shards[2].ping.remote())
    killed = []

    class KillTheThirdParameterServer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())

    backup = str(tmp_path / "backup")
    name = re.escape("parameter server /job:ps/replica:0/task:2 is unavailable")
    with pytest.raises(RuntimeError, match=name) as raised:
        model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), KillTheThirdParameterServer()])
    assert time.monotonic() - killed[0] < 30
    assert "restart the cluster" in str(raised.value) and "BackupAndRestore" in str(raised.value)

    coordinator = ks.coordinator.ClusterCoordinator(strategy)

    def read_weights():  # reads every variable of the model, some of them on the lost parameter server
        return [keras.ops.convert_to_numpy(v.value) for v in model.weights]

    for raiser in ("join", "done", "schedule"):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=name):
            value = coordinator.schedule(read_weights)
            if raiser == "join":
                coordinator.join()
            elif raiser == "done":
                while not coordinator.done():
                    time.sleep(0.01)
            else:
                with pytest.raises(RuntimeError, match=name):
                    value.fetch()
                coordinator.schedule(read_weights)
        assert time.monotonic() - started < 30, raiser

    # Restarting the cluster (a new strategy) and the same BackupAndRestore resume at epoch 1.
    strategy = ks.ParameterServerStrategy(resolver(cluster))
    model = _ray_compiled(strategy)
    history = model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert len(history.history["loss"]) == 2  # epochs 1 and 2; epoch 0 came from the backup
    assert int(model.optimizer.iterations.numpy()) == 3 * 6
    assert not os.path.exists(backup)  # a finished fit removes its backup


def test_ray_fit_runs_keras_epoch_level_callbacks(ray_engine, tmp_path):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    model = _ray_compiled(ks.ParameterServerStrategy(resolver(cluster)))
    checkpoint, logs = str(tmp_path / "model.keras"), str(tmp_path / "logs")
    validation = (RAY_ROWS[:16], RAY_TARGETS[:16])
    callbacks = [keras.callbacks.ModelCheckpoint(checkpoint), keras.callbacks.TensorBoard(logs),
                 keras.callbacks.EarlyStopping("loss", patience=1, min_delta=1e9)]  # no epoch improves by 1e9
    history = model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=5, verbose=0, callbacks=callbacks,
                        validation_data=validation)
    assert sorted(history.history) == ["loss", "val_loss"]
    assert len(history.history["loss"]) == 2  # EarlyStopping stopped the run after its second epoch
    # The validation ran on the chief with the values the parameter servers held at the epoch's end.
    np.testing.assert_allclose(history.history["val_loss"][-1], model.evaluate(*validation, verbose=0), rtol=1e-5)
    restored = keras.models.load_model(checkpoint)
    for actual, expected in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-6)
    for run in ("train", "validation"):
        events = glob.glob(os.path.join(logs, run, "events.out.tfevents.*"))
        assert events and any(b"epoch_loss" in open(path, "rb").read() for path in events), (run, events)


@pytest.mark.parametrize("validation_freq, validated", [(2, [2]), ([1, 3], [1, 3])], ids=["every-2nd", "list"])
def test_ray_fit_validates_on_the_epochs_validation_freq_selects(ray_engine, validation_freq, validated):
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    model = _ray_compiled(ks.ParameterServerStrategy(resolver(cluster)))
    seen = []

    class Validated(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if "val_loss" in logs:
                seen.append(epoch + 1)

    history = model.fit(RAY_ROWS, RAY_TARGETS, batch_size=8, epochs=3, verbose=0, callbacks=[Validated()],
                        validation_data=(RAY_ROWS[:16], RAY_TARGETS[:16]), validation_freq=validation_freq)
    assert seen == validated and len(history.history["val_loss"]) == len(validated)
    assert len(history.history["loss"]) == 3


def test_ray_clear_errors(ray_engine):
    import tensorflow as tf

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    strategy = ks.ParameterServerStrategy(resolver(cluster))
    model = _ray_compiled(strategy)
    coordinator = ks.coordinator.ClusterCoordinator(strategy)
    with pytest.raises(TypeError, match="`schedule` needs a function to run on a worker, got int: 5"):
        coordinator.schedule(5)
    remote = coordinator.schedule(lambda: 2.0)
    coordinator.join()
    assert isinstance(remote, ks.coordinator.RemoteValue) and remote.fetch() == 2.0
    for args in ((remote,), ([remote],), ({"value": remote},)):
        with pytest.raises(ValueError, match=r"`schedule` does not take a RemoteValue as an argument: call `\.fetch\(\)`"):
            coordinator.schedule(lambda value: value, args=args)
    with pytest.raises(ValueError, match="Only `ks.ParameterServerStrategy` is supported"):
        ks.coordinator.ClusterCoordinator(ks.MirroredStrategy(["cpu:0"]))

    def endless(context=None):
        return tf.data.Dataset.from_tensor_slices((RAY_ROWS, RAY_TARGETS)).batch(8).repeat()

    for x in (endless(), endless, ks.experimental.DatasetCreator(endless)):
        with pytest.raises(ValueError, match=r"`steps_per_epoch` is required .*pass `steps_per_epoch=N`"):
            model.fit(x, epochs=1, verbose=0)

    class BatchLogger(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    refused = [(BatchLogger(), "Callback BatchLogger overrides on_train_batch_end"),
               (keras.callbacks.ModelCheckpoint("unused.keras", save_freq=2),
                "Callback ModelCheckpoint with save_freq=2 acts on batches.*Pass save_freq='epoch'"),
               (keras.callbacks.BackupAndRestore("unused", save_freq=3), "BackupAndRestore with save_freq=3"),
               (keras.callbacks.TensorBoard("unused", update_freq="batch"),
                "TensorBoard with update_freq=1 acts on batches.*Pass update_freq='epoch'")]
    for callback, message in refused:
        with pytest.raises(ValueError, match=message):
            model.fit(RAY_ROWS, RAY_TARGETS, epochs=1, verbose=0, callbacks=[callback])
    with strategy.scope():
        eager = _ray_model()
        eager.compile("sgd", "mse", run_eagerly=True)
    with pytest.raises(ValueError, match=r"`run_eagerly=True` is not supported with ParameterServerStrategy"):
        eager.fit(RAY_ROWS, RAY_TARGETS, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0  # nothing refused ran a step
