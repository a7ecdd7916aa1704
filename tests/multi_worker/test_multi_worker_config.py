"""MultiWorkerMirroredStrategy set-up in one process: options, TF_CONFIG validation, local mode.

Everything here is decided before a worker joins a cluster, so it runs in the
test process; real multi-process runs are in the other `test_multi_worker_*` modules.
"""

import contextlib
import json
import os
import socket
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.cluster_resolver import SimpleClusterResolver
from keras_strategies.keras_integration import chief_only
from keras_strategies.multi_worker.worker_cluster import resolve
from keras_strategies.multi_worker.health import HealthMonitor, LostWorkerError


def test_communication_options_defaults_and_validation():
    options = ks.CommunicationOptions()
    assert (options.bytes_per_pack, options.timeout_seconds, options.implementation) == (
        0, None, ks.CommunicationImplementation.AUTO)
    assert options.effective_timeout == 300.0
    assert ks.CommunicationOptions(implementation="ring").implementation == ks.CommunicationImplementation.RING
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative"):
        ks.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds must be a positive number"):
        ks.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="AUTO, RING or NCCL\\), got 'mpi'"):  # the value given, not None
        ks.CommunicationOptions(implementation="mpi")
    with pytest.raises(ValueError, match="communication_options must be a ks.CommunicationOptions"):
        ks.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 5})


def test_nccl_is_refused_without_gpus():
    options = ks.CommunicationOptions(implementation=ks.CommunicationImplementation.NCCL)
    with pytest.raises(ValueError, match="NCCL needs GPUs"):
        ks.MultiWorkerMirroredStrategy(communication_options=options)


def _fit(strategy, x, y):
    """Keras' `fit` of a small model, built in `strategy`'s scope or (None) outside every scope."""
    keras.utils.set_random_seed(3)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    return history.history, model.get_weights()


@pytest.mark.parametrize("tf_config", [
    None,
    {"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 0}},
    # An evaluator is a side-car outside the training cluster (its entry is optional): as in
    # TensorFlow, its strategy runs alone, as chief, without joining the workers.
    {"cluster": {"worker": ["a:1", "b:2"], "evaluator": ["c:3"]}, "task": {"type": "evaluator", "index": 0}},
    {"cluster": {"chief": ["a:1"], "worker": ["b:2"]}, "task": {"type": "evaluator", "index": 0}},
], ids=["no TF_CONFIG", "one-worker cluster", "evaluator", "evaluator not in the cluster"])
def test_a_single_worker_trains_on_local_devices_like_one_device(monkeypatch, tf_config):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    strategy = ks.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == len(ks.list_devices()) == 4
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    assert isinstance(strategy.cluster_resolver, ks.cluster_resolver.TFConfigClusterResolver)
    assert "MultiWorkerMirroredStrategy(worker=0/1" in repr(strategy)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(25, 3)).astype("float32"), rng.normal(size=(25, 1)).astype("float32")
    (history, weights), (expected_history, expected_weights) = _fit(strategy, x, y), _fit(None, x, y)
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=1e-5, atol=1e-6)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tf_config, message", [
    ({"cluster": {"worker": ["a:1", "b:2"]}}, "you must also specify `task_type` and `task_id`"),
    ({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}, "exceeds the maximum id of worker"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}, "`task_type` 'chief' not found in cluster_spec"),
    ({"cluster": {"chief": ["a:1", "c:3"], "worker": ["b:2"]}, "task": {"type": "worker", "index": 0}}, "at most one 'chief' job"),
    ({"cluster": {"worker": ["a:1"], "trainer": ["b:2"]}, "task": {"type": "worker", "index": 0}}, "Disallowed task type"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}}, "Unrecognized task_type: master"),
    ({"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "ps", "index": 0}}, "runs on `chief` and `worker` tasks"),
    ({"cluster": {"worker": ["a:1"], "evaluator": ["b:2"]}, "task": {"type": "evaluator", "index": 1}}, "exceeds the maximum id of evaluator"),
    ("{not json", "TF_CONFIG is not valid JSON"),
], ids=["no task", "index too large", "unknown task type in cluster", "two chiefs", "unknown job", "bad type", "ps task",
     "evaluator index too large", "bad json"])
def test_invalid_tf_config_is_a_value_error_naming_the_problem(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", ".")):
        ks.MultiWorkerMirroredStrategy()


def test_workers_are_ordered_chief_first_and_worker_0_is_chief_without_one():
    spec = {"chief": ["c:1"], "worker": ["w0:2", "w1:3"]}
    cluster = resolve(SimpleClusterResolver(ks.ClusterSpec(spec), task_type="worker", task_id=1))
    assert (cluster.num_workers, cluster.worker_index, cluster.is_chief) == (3, 2, False)
    assert cluster.describe(0) == "chief 0 (c:1)" and cluster.describe(2) == "worker 1 (w1:3)"
    no_chief = resolve(SimpleClusterResolver(ks.ClusterSpec({"worker": ["w0:2", "w1:3"]}), task_type="worker", task_id=0))
    assert (no_chief.worker_index, no_chief.is_chief, no_chief.chief_address) == (0, True, "w0:2")


def test_non_chief_callbacks_write_to_worker_temp_dirs(tmp_path):
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt" / "model_{epoch}.keras"))
    board = keras.callbacks.TensorBoard(str(tmp_path / "logs"))
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    csv = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    for _ in range(2):  # the same callbacks passed to a second fit are not redirected again
        adapted = chief_only.adapt_callbacks([checkpoint, board, backup, csv], task_id=3)
        assert checkpoint.filepath == str(tmp_path / "ckpt" / "workertemp_3" / "model_{epoch}.keras")
        assert board.log_dir == str(tmp_path / "logs" / "workertemp_3")
        assert backup.backup_dir == str(tmp_path / "workertemp_3" / "backup")
        assert backup._weights_path == str(tmp_path / "workertemp_3" / "backup" / "latest.weights.h5")
        assert csv.filename == str(tmp_path / "workertemp_3" / "log.csv")
        assert len(adapted) == 6  # plus one callback that makes the CSV's directory, one that cleans up
    make_dirs, remove_dirs = adapted[0], adapted[-1]
    for callback in (make_dirs, csv):  # the CSV logger alone (the others need a model)
        callback.on_train_begin()
    csv.on_epoch_end(0, {"loss": 1.0})
    csv.on_train_end()
    assert (tmp_path / "workertemp_3" / "log.csv").read_text().splitlines()[1] == "0,1.0,NA"
    (tmp_path / "ckpt" / "workertemp_3").mkdir(parents=True)
    remove_dirs.on_train_end()
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(tmp_path / "ckpt") == []


def test_quiet_drops_keras_messages_only_while_enabled(capsys):
    from keras.src.utils import io_utils

    with chief_only.quiet(True):
        io_utils.print_msg("from a callback")
        print("the program's own")
    with chief_only.quiet(False):
        io_utils.print_msg("on the chief")
    io_utils.print_msg("afterwards")
    assert capsys.readouterr().out.splitlines() == ["the program's own", "on the chief", "afterwards"]


def test_public_save_functions_are_the_chief_only_ones():
    # `keras.saving.save_model` etc. were bound at Keras' import; the hook rebinds them (the
    # multi-worker training tests check what they write on each worker).
    from keras.src.saving import saving_api

    for public, name in ((keras.saving, "save_model"), (keras.models, "save_model"), (keras.saving, "save_weights")):
        assert getattr(public, name) is getattr(saving_api, name)
        assert hasattr(getattr(public, name), "_ks_original")


class _Store:
    """A key-value store shared by the simulated workers of one process."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value

    def try_get(self, key):
        with self.lock:
            return self.data.get(key)


def _two_workers():
    spec = ks.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    return resolve(SimpleClusterResolver(spec, task_type="worker", task_id=0))


def _live_peer(store):
    """Worker 1 beating in a thread until the returned event is set."""
    beating = threading.Event()

    def peer():
        seq = 0
        while not beating.is_set():
            seq += 1
            store.set("keras_strategies/heartbeat/1", f"{seq} 0")
            time.sleep(0.05)

    threading.Thread(target=peer, daemon=True).start()
    return beating


def _wait_for_error(monitor, seconds):
    deadline = time.monotonic() + seconds
    while monitor.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return monitor.error


def test_watchdog_names_a_peer_whose_heartbeat_stops():
    store = _Store()
    monitor = HealthMonitor(_two_workers(), store.set, store.try_get, timeout=60, dead_after=1.0, interval=0.1)
    try:
        store.set("keras_strategies/heartbeat/1", "1 0")  # one heartbeat, then silence
        monitor.begin("gradient all-reduce")
        error = _wait_for_error(monitor, 5)
        assert isinstance(error, LostWorkerError)
        assert "worker 1 (127.0.0.1:2) sent no heartbeat" in str(error) and "gradient all-reduce" in str(error)
        assert monitor.failed(RuntimeError("connection reset")) is error
        with pytest.raises(LostWorkerError):
            monitor.begin("next collective")
    finally:
        monitor.stop()


def test_watchdog_does_not_call_a_live_peer_dead_while_this_worker_cannot_read_the_store():
    """A stall on this side (slow store, starved process) is time without reads, not a peer's silence."""
    store = _Store()
    slow_reads = threading.Event()
    slow_reads.set()

    def try_get(key):
        if slow_reads.is_set():
            time.sleep(1.5)  # longer than dead_after: each read sees a new value, but late
        return store.try_get(key)

    beating = _live_peer(store)
    monitor = HealthMonitor(_two_workers(), store.set, try_get, timeout=60, dead_after=1.0, interval=0.1)
    try:
        monitor.begin("gradient all-reduce")
        time.sleep(4.0)
        assert monitor.error is None, monitor.error
        beating.set()  # the peer dies; reads are fast again: its silence is noticed
        slow_reads.clear()
        error = _wait_for_error(monitor, 5)
        assert error is not None and "worker 1 (127.0.0.1:2) sent no heartbeat" in str(error)
        monitor.end()
    finally:
        beating.set()
        monitor.stop()


def test_watchdog_counts_failing_store_calls_as_lost_contact_but_not_slow_ones():
    spec = ks.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    second = resolve(SimpleClusterResolver(spec, task_type="worker", task_id=1))
    store, mode = _Store(), {"now": "slow"}

    def try_get(key):
        if mode["now"] == "slow":
            time.sleep(1.5)  # a busy chief: answers, late
            return store.try_get(key)
        raise ConnectionError("connection refused")  # the chief is gone

    store.set("keras_strategies/heartbeat/0", "1 0")
    monitor = HealthMonitor(second, store.set, try_get, timeout=60, dead_after=1.0, interval=0.1)
    try:
        monitor.begin("gradient all-reduce")
        time.sleep(3.5)  # two slow reads: too few to call the chief silent, and none failed
        assert monitor.error is None, monitor.error
        monitor.end()
    finally:
        monitor.stop()
    monitor = HealthMonitor(second, store.set, try_get, timeout=60, dead_after=1.0, interval=0.1)
    try:
        mode["now"] = "failing"
        monitor.begin("gradient all-reduce")
        error = _wait_for_error(monitor, 5)
        assert error is not None and "lost contact with worker 0 (127.0.0.1:1)" in str(error), error
        monitor.end()
    finally:
        monitor.stop()


def test_lost_contact_with_a_chief_that_still_takes_connections_names_what_the_store_calls_raised():
    # The chief's address accepts connections (its process lives) but the store's calls fail: the
    # error says what they raised, which tells a stalled or overloaded chief from a broken network.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        spec = ks.ClusterSpec({"worker": [f"127.0.0.1:{listening.getsockname()[1]}", "127.0.0.1:2"]})
        second = resolve(SimpleClusterResolver(spec, task_type="worker", task_id=1))
        store = _Store()

        def try_get(key):
            raise RuntimeError("UNAVAILABLE: the service did not answer")

        monitor = HealthMonitor(second, store.set, try_get, timeout=60, dead_after=1.0, interval=0.1)
        try:
            monitor.begin("gradient all-reduce")
            error = _wait_for_error(monitor, 5)
            assert error is not None and "lost contact with worker 0" in str(error), error
            assert "its store's calls raised RuntimeError: UNAVAILABLE: the service did not answer" in str(error), error
            monitor.end()
        finally:
            monitor.stop()


def test_a_collective_failed_by_a_dead_chief_names_it_at_once_and_the_store_is_called_no_more():
    # Nothing listens on the chief's store port (it died): a refused connection says so at once,
    # without the heartbeats' wait, and no further store call is made (torch logs each failing one
    # with a C++ stack).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    spec = ks.ClusterSpec({"worker": [f"127.0.0.1:{closed_port}", "127.0.0.1:2"]})
    second = resolve(SimpleClusterResolver(spec, task_type="worker", task_id=1))
    calls = []

    def gone(*args):
        calls.append(args)
        raise ConnectionError("Broken pipe")

    monitor = HealthMonitor(second, gone, gone, timeout=60, dead_after=30, interval=0.1)
    try:
        monitor.begin("gradient all-reduce")
        started = time.monotonic()
        error = monitor.failed(RuntimeError("Connection closed by peer"))
        assert time.monotonic() - started < 5
        assert isinstance(error, LostWorkerError)
        assert f"worker 0 (127.0.0.1:{closed_port}), which hosts the cluster's store, refuses connections" in str(error)
        assert "gradient all-reduce" in str(error)
        time.sleep(0.5)
        made = len(calls)
        time.sleep(0.5)  # five more heartbeat intervals
        assert len(calls) == made <= 1, calls
    finally:
        monitor.stop()


def test_a_dead_chief_is_named_at_once_also_when_its_store_port_closes_after_the_collective_failed():
    # A killed process closes its sockets one by one: the collective may fail while the store's
    # listening socket still accepts connections for a moment.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    spec = ks.ClusterSpec({"worker": [f"127.0.0.1:{port}", "127.0.0.1:2"]})
    second = resolve(SimpleClusterResolver(spec, task_type="worker", task_id=1))
    store = _Store()
    monitor = HealthMonitor(second, store.set, store.try_get, timeout=60, dead_after=30, interval=0.1)
    closer = threading.Timer(0.5, listener.close)
    try:
        monitor.begin("gradient all-reduce")
        started = time.monotonic()
        closer.start()
        error = monitor.failed(RuntimeError("Connection reset by peer"))
        assert time.monotonic() - started < 3
        assert f"worker 0 (127.0.0.1:{port}), which hosts the cluster's store, refuses connections" in str(error)
    finally:
        closer.join()
        listener.close()
        monitor.stop()


def test_watchdog_names_a_live_peer_that_never_joins_within_the_timeout():
    store = _Store()
    monitor = HealthMonitor(_two_workers(), store.set, store.try_get, timeout=1.0, dead_after=30, interval=0.1)
    beating = _live_peer(store)  # alive (heartbeats) but stuck before its first collective
    try:
        monitor.begin("gradient all-reduce")
        error = _wait_for_error(monitor, 5)
        assert error is not None and "worker 1 (127.0.0.1:2) did not join it within timeout_seconds=1" in str(error)
        monitor.end()
    finally:
        beating.set()
        monitor.stop()


def test_a_peer_that_left_after_completing_the_collective_is_not_an_error():
    store = _Store()
    monitor = HealthMonitor(_two_workers(), store.set, store.try_get, timeout=60, dead_after=30, interval=0.1)
    try:
        store.set("keras_strategies/heartbeat/1", "left 1")  # finished collective #0, then exited
        monitor.begin("last collective")
        time.sleep(0.6)
        assert monitor.error is None
        monitor.end()
        store.set("keras_strategies/heartbeat/1", "left 1")
        monitor.begin("one collective too many")
        error = _wait_for_error(monitor, 3)
        assert error is not None and "left the cluster" in str(error)
        monitor.end()
    finally:
        monitor.stop()


def test_keras_makedirs_tolerates_a_directory_another_worker_just_created(tmp_path, monkeypatch):
    from keras.src.utils import file_utils

    monkeypatch.setattr(chief_only, "_concurrent_workers", False)
    file_utils.makedirs(str(tmp_path / "ckpt"))
    with pytest.raises(FileExistsError):  # outside a cluster: Keras' own behaviour
        file_utils.makedirs(str(tmp_path / "ckpt"))
    chief_only.tolerate_concurrent_makedirs()
    file_utils.makedirs(str(tmp_path / "ckpt"))  # created meanwhile by a non-chief's workertemp dir
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        file_utils.makedirs(str(tmp_path / "file"))


def _never_joined(timeout):
    import subprocess

    from keras_strategies.launcher.tf_config import free_ports

    port, other = free_ports(2)
    program = os.path.join(os.path.dirname(__file__), "programs", "never_joined.py")
    return subprocess.Popen([sys.executable, program, str(port), str(other), str(timeout)],
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_STRATEGIES_CPU_DEVICES": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_worker_that_never_joins_is_named_after_timeout_seconds_with_progress_meanwhile():
    import time

    started = time.monotonic()
    process = _never_joined(6)
    out, err = process.communicate(timeout=120)
    assert process.returncode != 0 and "JOINED" not in out
    assert "worker 0 (127.0.0.1:" in err and "is waiting for the other 1 worker(s) to join" in err, err[-3000:]
    message = err.split("LostWorkerError: ")[-1]
    assert message.startswith("the cluster did not form within timeout_seconds=6: worker 0"), err[-3000:]
    assert "waited for worker 1 (127.0.0.1:" in message and "Start every worker" in message
    assert "Check failure" not in err and "Traceback" not in err, err[-3000:]  # no engine abort, no stack
    assert time.monotonic() - started < 6 + 60  # the start-up of Python and the backend, then the timeout


def test_ctrl_c_ends_a_worker_waiting_for_the_others_at_once():
    import signal
    import time

    process = _never_joined(120)
    for line in process.stderr:
        if "is waiting for the other" in line:
            break
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode != 0 and time.monotonic() - sent < 10
