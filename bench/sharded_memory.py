"""Memory and step time of `ks.experimental.ShardedDataParallelStrategy` against `ks.MirroredStrategy`.

One model (an MLP: 256 features -> 3 x Dense(1024, relu) -> Dense(10), Adam)
trained with `fit` on the same NumPy data and global batch (256) under
`ks.MirroredStrategy` (ZeRO stage 0) and `ShardedDataParallelStrategy` at
stages 1 and 2, on 2 and 4 (virtual) devices, on each backend.

Memory per replica is read from the arrays each strategy keeps, after
training, not estimated: parameters (the model's variables: every replica
reads them whole at stages 0-2), summed gradients (whole after the
all-reduce; one piece after stage 2's reduce-scatter, as recorded by the
last update) and optimizer state (`model.optimizer.variables` whole under
Mirrored; each device's copy's variables when sharded). On CPU that is the
bytes of the replica's arrays; there is no device memory to read.

Step time: a callback records `time.perf_counter()` around each train batch
(Keras converts the logs first, so the interval covers the whole step); the
first epoch (compilation, warm-up) is left out and the median of the rest is
reported; each process uses one intra-op thread, as the other benchmarks (see
"Machine and noise" on the Performance page). Each configuration of a (backend, devices) cell runs in one child
process, in an order that alternates between repeats, and the ratio to
Mirrored pairs runs of the same repeat; the median pair ratio and its range
are printed.

Usage:
    python bench/sharded_memory.py                  # every backend, 2 and 4 devices, 3 repeats
    python bench/sharded_memory.py --backends jax --devices 4 --repeats 5
    python bench/sharded_memory.py --smoke --backends jax   # every code path, tiny sizes (the suite's run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT_PREFIX = "BENCH-RESULT "
BACKENDS = ("tensorflow", "jax", "torch")
CONFIGS = ("mirrored", "stage1", "stage2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nbytes(value) -> int:
    import math

    import keras
    import numpy as np

    return math.prod(value.shape) * np.dtype(keras.backend.standardize_dtype(value.dtype)).itemsize


def run_child(args) -> None:
    """Trains every configuration of one (backend, devices) cell in this process; prints JSON lines."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mirrored_step_time import _limit_threads  # one intra-op thread, as the other benchmarks

    _limit_threads(os.environ["KERAS_BACKEND"], 1)
    import keras
    import numpy as np

    import keras_strategies as ks

    width, features, epochs, steps = (32, 16, 2, 3) if args.smoke else (1024, 256, 2, 20)
    batch = 32 if args.smoke else 256
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, features)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    devices = [f"cpu:{i}" for i in range(args.devices)]

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.start = [], 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    order = list(CONFIGS) if args.repeat % 2 == 0 else list(reversed(CONFIGS))
    for config in order:
        strategy = (ks.MirroredStrategy(devices) if config == "mirrored" else
                    ks.experimental.ShardedDataParallelStrategy(devices, stage=int(config[-1])))
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((features,))] + [
                keras.layers.Dense(width, activation="relu") for _ in range(3)] + [keras.layers.Dense(10)])
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        timer = Timer()
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
        params = sum(nbytes(v) for v in model.trainable_variables)
        if config == "mirrored":
            optimizer = sum(nbytes(v) for v in model.optimizer.variables)
            grads = params
        else:
            state = strategy.extended.optimizer_state(model.optimizer)
            optimizer, grads = max(state.bytes_per_replica()), max(state.gradient_bytes)
        print(RESULT_PREFIX + json.dumps({
            "config": config, "params": params, "grads": grads, "optimizer": optimizer,
            "ms": 1000 * statistics.median(timer.times[steps:]),
        }), flush=True)


def measure(backend: str, devices: int, repeat: int, smoke: bool) -> dict:
    env = {**os.environ, "KERAS_BACKEND": backend, "KERAS_STRATEGIES_CPU_DEVICES": str(devices),
           "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, os.path.abspath(__file__), "--child", "--devices", str(devices),
               "--repeat", str(repeat)] + (["--smoke"] if smoke else [])
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        sys.exit(f"{backend}, {devices} devices: the child exited {run.returncode}\n{run.stderr[-3000:]}")
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in run.stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    return {r["config"]: r for r in results}


def spread(values: list) -> str:
    median = statistics.median(values)
    return f"{median:.2f}" if len(values) == 1 else f"{median:.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--repeat", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        args.devices = int(args.devices)
        return run_child(args)
    counts = [2] if args.smoke else [int(d) for d in args.devices.split(",")]
    repeats = 1 if args.smoke else args.repeats
    if args.smoke:
        print("SMOKE run: tiny sizes; the numbers mean nothing.")
    print("| backend | devices | strategy | params B/replica | summed grads B/replica | optimizer B/replica "
          "| (grads + optimizer) / Mirrored's | ms/step | ms/step / Mirrored's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for devices in counts:
            runs = [measure(backend, devices, r, args.smoke) for r in range(repeats)]
            for config in CONFIGS:
                first, base = runs[0][config], runs[0]["mirrored"]
                state = (first["grads"] + first["optimizer"]) / (base["grads"] + base["optimizer"])
                name = "ks.MirroredStrategy" if config == "mirrored" else f"ShardedDataParallel, stage {config[-1]}"
                times = [run[config]["ms"] for run in runs]
                ratios = [run[config]["ms"] / run["mirrored"]["ms"] for run in runs]
                print(f"| {backend} | {devices} | {name} | {first['params']} | {first['grads']} | "
                      f"{first['optimizer']} | {state:.3f} | {spread(times)} | {spread(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
