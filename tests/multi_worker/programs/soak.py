"""A worker of the soak run: `fit` with BackupAndRestore under the launcher's `--max-restarts`.

argv: the output directory and the kill plan, JSON `{attempt: [task id, epoch, batch]}`: in
that attempt (`KERAS_STRATEGIES_RESTART_COUNT`) that worker kills itself (SIGKILL) after that
batch. Every worker records its pid per attempt; each writes its final weights.
"""

import json
import os
import signal
import sys

import keras_strategies as ks

strategy = ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=60))

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import GLOBAL_BATCH, build_model, data  # noqa: E402

EPOCHS = 4
out, plan = sys.argv[1], json.loads(sys.argv[2])
attempt = os.environ["KERAS_STRATEGIES_RESTART_COUNT"]
task_id = strategy.cluster_resolver.task_id
with open(os.path.join(out, f"pid_{attempt}_{task_id}"), "w") as file:
    file.write(str(os.getpid()))
keras.utils.set_random_seed(100 + task_id)
x, y = data()
with strategy.scope():
    model = build_model()
if attempt == "0" and strategy.extended.should_checkpoint:
    np.savez(os.path.join(out, "initial.npz"), *model.get_weights())


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if plan.get(attempt) == [task_id, self.epoch, batch]:
            print(f"KILLING worker {task_id} in attempt {attempt} at epoch {self.epoch} batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out, "backup")), Kill()]
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
np.savez(os.path.join(out, f"worker_{task_id}.npz"), *model.get_weights())
