"""Preemption on every worker at one step, under the launcher's restarts.

Part 1, a custom loop through `ks.experimental.PreemptionCheckpointHandler`:
worker 1 gets SIGTERM after step 5 (the first time it gets there); every worker
saves after step 6 and exits with code 42. Part 2, `fit` with
`BackupAndRestore(save_before_preemption=True)`: worker 1 gets SIGTERM in epoch
2, after its batch 1 (the first time). The next attempts resume both where they
stopped. The chief saves the initial and final weights of both parts.
"""

import os
import signal
import sys

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=60))

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import GLOBAL_BATCH, PREEMPTION_STEPS, build_model, data, loop_step  # noqa: E402

out = sys.argv[1]
task_id = strategy.cluster_resolver.task_id
attempt = int(os.environ["KERAS_STRATEGIES_RESTART_COUNT"])
chief = strategy.extended.should_checkpoint
keras.utils.set_random_seed(100 + task_id)  # the chief's initial values reach every worker


def save_once(name, weights):
    path = os.path.join(out, name)
    if chief and not os.path.exists(path):
        np.savez(path, *weights)


def sigterm_once(what):
    """SIGTERM to this worker, the first time it gets to `what` (an attempt may have failed to start)."""
    marker = os.path.join(out, f"sigterm {what}")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    print(f"SIGTERM to worker {task_id} {what}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


# Part 1: the custom loop.
with strategy.scope():
    model = build_model()
    optimizer = keras.optimizers.SGD(0.05)
save_once("loop_initial.npz", model.get_weights())
manager = ks.experimental.CheckpointManager(ks.experimental.Checkpoint(model=model, optimizer=optimizer),
                                            os.path.join(out, "loop_ckpt"), max_to_keep=1)
handler = ks.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
print(f"attempt {attempt}: the loop starts at step {handler.total_run_calls}", flush=True)
step = loop_step(strategy, model, optimizer, ks)
while handler.total_run_calls < PREEMPTION_STEPS:
    if task_id == 1 and handler.total_run_calls == 5:
        sigterm_once("after loop step 5")
    handler.run(step, handler.total_run_calls)
if chief:
    manager.save(checkpoint_number=handler.total_run_calls)  # a later attempt skips the finished loop
    np.savez(os.path.join(out, "loop_final.npz"), *model.get_weights())


# Part 2: fit.
class SigtermInEpoch2(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, 1):
            sigterm_once("in epoch 2 after batch 1")


x, y = data()
with strategy.scope():
    fit_model = build_model()
save_once("fit_initial.npz", fit_model.get_weights())
callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_before_preemption=True)]
if task_id == 1:
    callbacks.insert(0, SigtermInEpoch2())
history = fit_model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=2, callbacks=callbacks)
print(f"attempt {attempt}: fit trained {len(history.history['loss'])} epoch(s)", flush=True)
np.savez(os.path.join(out, f"fit_final_{task_id}.npz"), *fit_model.get_weights())
print("DONE", flush=True)
