"""A `worker` or `ps` task: `ks.Server(...).join()`, as in TensorFlow's tutorial."""

import json
import os
import sys
import threading
import time

import keras_strategies as ks

cluster, job_name, task_index = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = ks.Server(ks.ClusterSpec(cluster), job_name=job_name, task_index=task_index, protocol="grpc", start=True)
print("serving", job_name, task_index, server.target, flush=True)


def exit_with_parent(parent=os.getppid()):
    """A task the test (or a chief that restarted it) leaves behind stops with it."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


threading.Thread(target=exit_with_parent, daemon=True).start()
server.join()
