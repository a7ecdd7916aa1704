"""Worker 0 of a 2-worker cluster whose worker 1 is never started: it must give up after
`timeout_seconds` (argv[3]) with one clear error, saying while it waits that it waits."""

import json
import os
import sys

port, other, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{other}"]},
                                      "task": {"type": "worker", "index": 0}})

import keras_strategies as ks  # noqa: E402

ks.MultiWorkerMirroredStrategy(communication_options=ks.CommunicationOptions(timeout_seconds=timeout))
print("JOINED: the test expected a worker that never joins", flush=True)
