"""`ks.experimental.PreemptionCheckpointHandler` in one process: SIGTERM saves at the next step, a new
handler resumes there, and the result equals an uninterrupted loop. (Several workers:
tests/multi_worker/test_multi_worker_preemption.py.)"""

import os
import signal

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks

STEPS = 6


class Preempted(Exception):
    pass


def _exit():
    raise Preempted()


def _setup(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.05)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def replica_step(features, labels):
        def loss_fn():
            return ks.compute_average_loss(ops.square(model(features) - labels)[:, 0], global_batch_size=len(x))

        loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step():
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    return model, optimizer, step


def test_sigterm_saves_at_the_next_step_and_a_restart_resumes_there_exactly(tmp_path):
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    reference, _, reference_step = _setup(strategy)
    for _ in range(STEPS):
        reference_step()

    model, optimizer, step = _setup(strategy)
    config = ks.experimental.TerminationConfig(exit_fn=_exit)
    checkpoint = ks.experimental.Checkpoint(model=model, optimizer=optimizer)
    before = signal.getsignal(signal.SIGTERM)
    handler = ks.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, str(tmp_path), config)
    assert handler.total_run_calls == 0
    with pytest.raises(Preempted):
        while handler.total_run_calls < STEPS:
            if handler.total_run_calls == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the notice; the handler saves at the boundary
            handler.run(step)
    assert os.listdir(tmp_path) == ["ckpt-3.npz"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler gave SIGTERM back

    model, optimizer, step = _setup(strategy)  # a restarted program
    checkpoint = ks.experimental.Checkpoint(model=model, optimizer=optimizer)
    handler = ks.experimental.PreemptionCheckpointHandler(None, checkpoint, str(tmp_path), config)
    assert handler.total_run_calls == 3
    while handler.total_run_calls < STEPS:
        handler.run(step)
    for expected, actual in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_watcher_function_and_save_fn_replace_sigterm_and_the_checkpoint(tmp_path):
    strategy = ks.OneDeviceStrategy("cpu:0")
    model, optimizer, step = _setup(strategy)
    notices, saves = [], []
    before = signal.getsignal(signal.SIGTERM)
    config = ks.experimental.TerminationConfig(termination_watcher_fn=lambda: bool(notices), exit_fn=_exit,
                                               save_fn=lambda: saves.append(handler.total_run_calls))
    handler = ks.experimental.PreemptionCheckpointHandler(None, ks.experimental.Checkpoint(model=model),
                                                          str(tmp_path), config)
    assert signal.getsignal(signal.SIGTERM) is before  # the watcher function is the notice
    with handler.watch_preemption_scope(), pytest.raises(Preempted):
        for i in range(200):
            step()
            if i == 1:
                notices.append(True)
            handler.save_checkpoint_if_preempted()
            if not saves:
                import time
                time.sleep(0.02)
    assert saves and saves[0] >= 2 and os.listdir(tmp_path) == []


def test_bad_arguments_get_clear_errors(tmp_path):
    model, _, _ = _setup(ks.OneDeviceStrategy("cpu:0"))
    checkpoint = ks.experimental.Checkpoint(model=model)
    with pytest.raises(ValueError, match="pass checkpoint_dir"):
        ks.experimental.PreemptionCheckpointHandler(None, checkpoint)
    with pytest.raises(ValueError, match="tf.train's checkpoints exist only on TensorFlow"):
        ks.experimental.PreemptionCheckpointHandler(None, model, str(tmp_path))
    manager = ks.experimental.CheckpointManager(checkpoint, str(tmp_path))
    with pytest.raises(ValueError, match="Pass one or the other"):
        ks.experimental.PreemptionCheckpointHandler(None, manager, str(tmp_path))
    with pytest.raises(ValueError, match="termination_config must be"):
        ks.experimental.PreemptionCheckpointHandler(None, manager, termination_config={"grace_period": 1})
    with pytest.raises(ValueError, match="grace_period"):
        ks.experimental.TerminationConfig(grace_period=-1)
    with pytest.raises(ValueError, match="exit_fn"):
        ks.experimental.TerminationConfig(exit_fn=42)
