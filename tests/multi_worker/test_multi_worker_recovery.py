"""A killed worker fails the others within 20 s; restarting resumes from the chief's backup.

Real processes on 127.0.0.1. The crash run starts the workers directly (as on
separate machines, with no launcher to stop the survivors); the restart run
uses the launcher's `max_restarts`, which restarts every worker after the crash. Also checks that only the chief writes checkpoints,
TensorBoard logs, the saved model and the progress bar.
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_strategies.launcher.tf_config import free_ports, tf_config_for
from keras_strategies.launcher.supervisor import worker_env
from mw_launch import PROGRAMS, check, run_program

sys.path.insert(0, PROGRAMS)
from common import GLOBAL_BATCH, build_loss_scaled_model, build_model, data  # noqa: E402

TIMEOUT_SECONDS = 30  # the programs' CommunicationOptions(timeout_seconds=...)
# A killed worker fails the others about 10 s after it died (`health.DEAD_AFTER` without heartbeats):
# the bound from the kill to the chief's exit, with room for a slow or loaded machine.
LOST_WORKER_SECONDS = 20


def _start_workers(out, phase):
    ports = free_ports(2)
    processes = []
    for index in range(2):
        env = worker_env(tf_config_for(index, ports), backend=keras.backend.backend(), devices_per_worker=1,
                         env={"TF_CPP_MIN_LOG_LEVEL": "2"})
        processes.append(subprocess.Popen(
            [sys.executable, os.path.join(PROGRAMS, "recover.py"), str(out), phase],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    return processes


def _one_killed(out, phase):
    """Runs `phase`, in which one worker kills itself: (killed, survivor) as (exit code, stdout,
    stderr) and the seconds from the killed one's exit to the survivor's."""
    chief, worker = _start_workers(out, phase)
    killed, survivor = (chief, worker) if phase == "chief_crash" else (worker, chief)
    try:
        killed_out, killed_err = killed.communicate(timeout=240)
        killed_at = time.monotonic()
        survivor_out, survivor_err = survivor.communicate(timeout=TIMEOUT_SECONDS + 60)
        seconds = time.monotonic() - killed_at
    finally:
        for process in (chief, worker):
            if process.poll() is None:
                process.kill()
    return (killed.returncode, killed_out, killed_err), (survivor.returncode, survivor_out, survivor_err), seconds


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    out = tmp_path_factory.mktemp("recovery")
    (worker_code, worker_out, _), (chief_code, chief_out, chief_err), chief_seconds = _one_killed(out, "crash")
    return dict(out=out, worker_code=worker_code, worker_out=worker_out, chief_code=chief_code,
                chief_out=chief_out, chief_err=chief_err, chief_seconds=chief_seconds)


def test_a_killed_worker_fails_the_chief_within_20_seconds_naming_it(crash):
    assert "KILLING worker 1" in crash["worker_out"], crash["worker_out"]
    assert crash["worker_code"] == -9
    assert crash["chief_code"] not in (0, None), crash["chief_out"]
    assert crash["chief_seconds"] <= LOST_WORKER_SECONDS, crash["chief_seconds"]
    assert "LostWorkerError" in crash["chief_err"], crash["chief_err"][-3000:]
    assert "worker 1" in crash["chief_err"].split("LostWorkerError")[-1], crash["chief_err"][-3000:]
    assert "DONE" not in crash["chief_out"]


def test_a_killed_chief_fails_the_other_worker_within_20_seconds_naming_it_without_engine_noise(tmp_path):
    # The chief hosts the cluster's store and, on JAX, its coordination service: without them the
    # other workers must still end with our error, not a C++ abort (JAX) or stack traces (torch).
    (chief_code, chief_out, _), (worker_code, _, worker_err), seconds = _one_killed(tmp_path, "chief_crash")
    assert "KILLING worker 0" in chief_out and chief_code == -9, chief_out
    assert worker_code == 1, (worker_code, worker_err[-3000:])  # not an abort (-6)
    assert seconds <= LOST_WORKER_SECONDS, seconds
    message = worker_err.split("LostWorkerError")[-1]
    assert "worker 0 (127.0.0.1:" in message and "worker 1 (127.0.0.1:" in message, worker_err[-3000:]
    for noise in ("Check failure", "Terminating process"):
        assert noise not in worker_err, (noise, worker_err[-3000:])
    # PyTorch warns with a C++ stack for each store call that fails: at most the one that was in
    # flight when the chief died, none after its death is known.
    store_warnings = [line for line in worker_err.splitlines() if "[c10d]" in line or "Broken pipe" in line]
    assert len(store_warnings) <= 1, worker_err[-3000:]


def _chief_after(tmp_path, phase, signal_line):
    """(chief's exit code, its stderr, seconds from worker 1's `signal_line` to the chief's exit)."""
    chief, worker = _start_workers(tmp_path, phase)
    try:
        started = None
        for line in worker.stdout:
            if signal_line in line:
                started = time.monotonic()
                break
        assert started is not None, worker.communicate(timeout=5)
        _, chief_err = chief.communicate(timeout=120)
        seconds = time.monotonic() - started
    finally:
        for process in (chief, worker):
            if process.poll() is None:
                process.kill()  # a stopped process still takes SIGKILL
            process.communicate()
    return chief.returncode, chief_err, seconds


def test_a_hung_worker_fails_the_chief_after_timeout_seconds_naming_it(tmp_path):
    code, chief_err, seconds = _chief_after(tmp_path, "hang", "HANGING worker 1")
    assert code not in (0, None)
    assert 18 <= seconds < 20 + 20, seconds  # timeout_seconds=20 in the program, plus the step and the grace
    message = chief_err.split("LostWorkerError")[-1]
    assert "worker 1 (127.0.0.1:" in message and "did not join it within timeout_seconds=20" in message, chief_err[-3000:]


def test_a_stopped_worker_fails_the_chief_within_timeout_seconds_naming_it(tmp_path):
    # SIGSTOP: the worker neither dies nor answers; its sockets stay open, so no collective fails
    # by itself and only the heartbeats tell.
    code, chief_err, seconds = _chief_after(tmp_path, "stop", "STOPPING worker 1")
    assert code not in (0, None)
    assert seconds <= 20, seconds  # timeout_seconds=20 in the program; the heartbeats tell after about 10 s
    message = chief_err.split("LostWorkerError")[-1]
    assert "worker 1 (127.0.0.1:" in message and "sent no heartbeat" in message, chief_err[-3000:]


@pytest.fixture(scope="module", params=["mirrored", "sharded"])
def resumed(request, tmp_path_factory):
    """A launch with `max_restarts=1` whose first attempt loses worker 1 in epoch 2, under
    MultiWorkerMirroredStrategy or ShardedDataParallelStrategy (whose optimizer state lives in
    pieces over the workers: the chief's restored backup must reach every worker's pieces, and its
    LossScaleOptimizer's scale every worker)."""
    out = tmp_path_factory.mktemp(f"restart_{request.param}")
    args = [out, "restart"] + (["sharded"] if request.param == "sharded" else [])
    run = run_program("recover.py", args, workers=2, devices_per_worker=1, timeout=480, max_restarts=1)
    return out, check(run), request.param


def test_the_launcher_restarts_every_worker_once_a_worker_dies(resumed):
    _, run, _ = resumed
    assert "[worker 1] KILLING worker 1" in run.stdout, run.stdout
    assert "worker 1 was killed by SIGKILL" in run.stderr, run.stderr[-3000:]
    assert "restarting all 2 processes (restart 1 of 1)" in run.stderr, run.stderr[-3000:]
    assert run.stdout.count("KILLING") == 1 and run.stdout.count("[worker 0] DONE") == 1, run.stdout


def test_restart_resumes_from_the_chiefs_backup_and_equals_an_uninterrupted_run(resumed):
    out, _, strategy = resumed
    x, y = data()
    model = build_loss_scaled_model() if strategy == "sharded" else build_model()
    archive = np.load(out / "initial.npz")
    model.set_weights([archive[f"arr_{i}"] for i in range(len(archive.files))])
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    for task in (0, 1):
        archive = np.load(out / f"worker_{task}.npz")
        for i, expected in enumerate(model.get_weights()):
            np.testing.assert_allclose(archive[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)


def test_only_the_chief_writes_files_and_prints_progress(resumed):
    out, run, _ = resumed
    leftovers = [os.path.join(root, name) for root, dirs, files in os.walk(out) for name in dirs + files
                 if "workertemp" in name]
    assert not leftovers, leftovers
    assert sorted(os.listdir(out / "ckpt")) == ["model_1.keras", "model_2.keras", "model_3.keras"]
    assert os.path.exists(out / "final.keras")
    assert os.path.isdir(out / "tb" / "train")
    assert not os.path.exists(out / "backup"), "the chief deletes the backup after training"
    assert "[worker 0] Epoch 3/3" in run.stdout, run.stdout
    assert "[worker 0] Epoch 3: saving model to" in run.stdout, run.stdout  # ModelCheckpoint(verbose=1)
    # Neither the progress bar nor the callbacks' messages on the other worker.
    assert not [line for line in run.stdout.splitlines() if line.startswith("[worker 1]") and "Epoch" in line]
