"""Quick start: the same Keras script trained with `ks.MirroredStrategy` on every backend.

`python examples/quickstart.py` runs it once per backend (TensorFlow, JAX,
PyTorch), each on 4 virtual CPU devices, and ends with one line per backend
comparing the final weights with a single-device run of the same global batch.
`python examples/quickstart.py --backend jax` runs one backend in this process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

BACKENDS = ("tensorflow", "jax", "torch")
RESULT_PREFIX = "QUICKSTART-RESULT"


def train_once() -> None:
    os.environ.setdefault("KERAS_STRATEGIES_CPU_DEVICES", "4")
    import keras
    import numpy as np

    import keras_strategies as ks

    def build_model():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4)),
                keras.layers.Dense(1),
            ]
        )
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"])
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

    keras.utils.set_random_seed(42)
    strategy = ks.MirroredStrategy()  # all 4 virtual CPU devices
    print(f"{keras.backend.backend()}: {strategy.num_replicas_in_sync} replicas on {list(strategy.extended.worker_devices)}")
    with strategy.scope():
        model = build_model()
    initial_weights = model.get_weights()
    # 1000 samples with a global batch of 64: the last batch (40) is partial.
    # One log line per epoch: `run_all` reads this output through a pipe, where Keras' progress
    # bar would print every update on a line of its own.
    model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=2)
    loss, mae = model.evaluate(x, y, batch_size=64, verbose=0)

    single = build_model()  # no strategy: one device
    single.set_weights(initial_weights)
    single.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), single.get_weights()))
    print(f"{RESULT_PREFIX} {keras.backend.backend():>10}: {strategy.num_replicas_in_sync} replicas, "
          f"loss {loss:.5f}, max |weights - single-device weights| = {difference:.2e}")


def run_all() -> int:
    results, failed = [], []
    for backend in BACKENDS:
        print(f"\n===== KERAS_BACKEND={backend} =====", flush=True)
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        process = subprocess.Popen(
            [sys.executable, __file__, "--backend", backend], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for line in process.stdout:
            if line.startswith(RESULT_PREFIX):
                results.append(line[len(RESULT_PREFIX) + 1:].rstrip())
            print(line, end="", flush=True)
        if process.wait() != 0:
            failed.append(backend)
    print("\n===== MirroredStrategy vs one device =====")
    print("\n".join(results))
    if failed:
        print(f"FAILED on: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, help="run one backend in this process")
    arguments = parser.parse_args()
    if arguments.backend:
        os.environ["KERAS_BACKEND"] = arguments.backend
        train_once()
    else:
        sys.exit(run_all())
