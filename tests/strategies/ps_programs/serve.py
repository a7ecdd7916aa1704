"""A `worker` or `ps` task: `ks.Server(...).join()`, as in TensorFlow's tutorial."""

import json
import sys

import keras_strategies as ks

cluster, job_name, task_index = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = ks.Server(ks.ClusterSpec(cluster), job_name=job_name, task_index=task_index, protocol="grpc", start=True)
print("serving", job_name, task_index, server.target, flush=True)
server.join()
