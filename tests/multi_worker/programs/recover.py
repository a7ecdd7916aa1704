"""A worker of a run with BackupAndRestore, ModelCheckpoint, TensorBoard and `model.save`.

`crash` phase: worker 1 kills itself (SIGKILL) in the middle of epoch 2; the
chief must fail with `ks.LostWorkerError`. `chief_crash` phase: the chief does, and worker 1 must
fail with it, naming the chief. `restart` phase (under the launcher's
`--max-restarts`): the same crash in the first attempt only; the launcher
restarts every worker, which resume from the chief's backup and finish. `hang` phase: worker 1 hangs
instead (its heartbeats go on); the chief must fail after `timeout_seconds`. `stop` phase: worker 1 stops
itself with SIGSTOP (alive, its connections open, no heartbeats); the chief must fail within
`timeout_seconds`. `resume` phase: all workers start again, resume from the chief's backup and
finish; the chief alone writes. `recover.py OUT PHASE sharded` trains under
`ShardedDataParallelStrategy` instead (the optimizer's state split over the workers' replicas),
with a LossScaleOptimizer whose changing scale every worker must get back.
"""

import os
import shutil
import signal
import sys
import time

import keras_strategies as ks

TIMEOUT = 20 if sys.argv[2] in ("hang", "stop") else 30
options = ks.CommunicationOptions(timeout_seconds=TIMEOUT)
if sys.argv[3:] == ["sharded"]:
    strategy = ks.experimental.ShardedDataParallelStrategy(communication_options=options)
else:
    strategy = ks.MultiWorkerMirroredStrategy(communication_options=options)

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import GLOBAL_BATCH, build_loss_scaled_model, build_model, data  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
first_attempt = os.environ.get("KERAS_STRATEGIES_RESTART_COUNT", "0") == "0"
if phase in ("hang", "stop", "chief_crash"):
    out = os.path.join(out, phase)
    os.makedirs(out, exist_ok=True)
task_id = strategy.cluster_resolver.task_id
keras.utils.set_random_seed(100 + task_id)
x, y = data()

if phase == "restart" and not first_attempt and task_id == 1:
    # Worker 1 restarts as a new machine would, without its own backup: it resumes from the chief's.
    shutil.rmtree(os.path.join(out, "workertemp_1"), ignore_errors=True)

with strategy.scope():
    model = build_loss_scaled_model() if sys.argv[3:] == ["sharded"] else build_model()
if phase in ("crash", "restart") and first_attempt and strategy.extended.should_checkpoint:
    np.savez(os.path.join(out, "initial.npz"), *model.get_weights())


class KillMe(keras.callbacks.Callback):
    """Worker 1 dies (`crash`) or hangs forever (`hang`) in the middle of epoch 2."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 1:
            if phase == "hang":
                print(f"HANGING worker {task_id}", flush=True)
                time.sleep(3600)
            if phase == "stop":
                print(f"STOPPING worker {task_id}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            print(f"KILLING worker {task_id}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [
    keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
    keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt", "model_{epoch}.keras"), verbose=1),  # prints on the chief only
    keras.callbacks.TensorBoard(os.path.join(out, "tb")),
]
if (phase in ("crash", "hang", "stop") or (phase == "restart" and first_attempt)) and task_id == 1:
    callbacks.append(KillMe())
if phase == "chief_crash" and task_id == 0:
    callbacks.append(KillMe())
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=2, callbacks=callbacks)
model.save(os.path.join(out, "final.keras"))
np.savez(os.path.join(out, f"worker_{task_id}.npz"), *model.get_weights())
print("DONE", flush=True)
