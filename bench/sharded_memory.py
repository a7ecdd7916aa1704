"""Memory and step time of `ks.experimental.ShardedDataParallelStrategy` against `ks.MirroredStrategy`.

One model (an MLP: 256 features -> 3 x Dense(1024, relu) -> Dense(10), Adam)
trained with `fit` on the same NumPy data and global batch (256) under
`ks.MirroredStrategy` (ZeRO stage 0) and `ShardedDataParallelStrategy` at
stages 1 and 2, on 2 and 4 (virtual) devices, on each backend; on JAX also
under `keras.distribution.ModelParallel` with a `LayoutMap` that shards every
kernel and bias along its first axis over the same devices the batch is split
on (XLA's GSPMD then keeps the parameters and the optimizer's slots sharded:
Keras' own route to fully sharded data parallelism, JAX only).

Memory per replica is read from the arrays each strategy keeps, after
training, not estimated: parameters (the model's variables: every replica
reads them whole at stages 0-2), summed gradients (whole after the
all-reduce; one piece after stage 2's reduce-scatter, as recorded by the
last update) and optimizer state (`model.optimizer.variables` whole under
Mirrored; each device's copy's variables when sharded; under ModelParallel,
the bytes of each array's shard on the first device). On CPU that is the
bytes of the replica's arrays; there is no device memory to read.
ModelParallel's summed gradients live inside its compiled step only (they
take the parameters' sharding there), so no bytes are read for them.

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
CONFIGS = ("mirrored", "stage1", "stage2", "modelparallel")  # the last on JAX only
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

    def build():
        model = keras.Sequential([keras.Input((features,))] + [
            keras.layers.Dense(width, activation="relu", name=f"hidden_{i}") for i in range(3)]
            + [keras.layers.Dense(10, name="out")])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    configs = [c for c in CONFIGS if c != "modelparallel" or keras.backend.backend() == "jax"]
    order = configs if args.repeat % 2 == 0 else list(reversed(configs))
    for config in order:
        keras.utils.set_random_seed(0)
        if config == "modelparallel":
            model = model_parallel(keras, build, args.devices)
        else:
            strategy = (ks.MirroredStrategy(devices) if config == "mirrored" else
                        ks.experimental.ShardedDataParallelStrategy(devices, stage=int(config[-1])))
            with strategy.scope():
                model = build()
        timer = Timer()
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
        keras.distribution.set_distribution(None)
        params = sum(nbytes(v) for v in model.trainable_variables)
        if config == "modelparallel":
            params = sum(first_shard_bytes(v) for v in model.trainable_variables)
            optimizer = sum(first_shard_bytes(v) for v in model.optimizer.variables)
            grads = None
        elif config == "mirrored":
            optimizer = sum(nbytes(v) for v in model.optimizer.variables)
            grads = params
        else:
            state = strategy.extended.optimizer_state(model.optimizer)
            optimizer, grads = max(state.bytes_per_replica()), max(state.gradient_bytes)
        print(RESULT_PREFIX + json.dumps({
            "config": config, "params": params, "grads": grads, "optimizer": optimizer,
            "ms": 1000 * statistics.median(timer.times[steps:]),
        }), flush=True)


def model_parallel(keras, build, devices: int):
    """`build()` under `keras.distribution.ModelParallel`: every kernel and bias sharded along its
    first axis (where it divides) over the one mesh axis the batch is split on too. The
    distribution stays set for `fit`; the caller unsets it."""
    mesh = keras.distribution.DeviceMesh((devices,), ["batch"], keras.distribution.list_devices("cpu")[:devices])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/hidden_\\d+/kernel"] = ("batch", None)  # patterns match a variable's whole path
    layout_map[".*/hidden_\\d+/bias"] = ("batch",)
    layout_map[".*/out/kernel"] = ("batch", None)  # its bias (10 values) stays whole on every device
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    return build()


def first_shard_bytes(variable) -> int:
    """The bytes of `variable`'s shard on the first device (the whole array where it is replicated)."""
    return int(variable.value.addressable_shards[0].data.nbytes)


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
            for config in (c for c in CONFIGS if c in runs[0]):
                first, base = runs[0][config], runs[0]["mirrored"]
                if first["grads"] is None:  # ModelParallel: the optimizer state alone
                    state = f"{first['optimizer'] / base['optimizer']:.3f} (optimizer)"
                else:
                    state = f"{(first['grads'] + first['optimizer']) / (base['grads'] + base['optimizer']):.3f}"
                name = {"mirrored": "ks.MirroredStrategy", "modelparallel": "keras.distribution.ModelParallel"}.get(
                    config, f"ShardedDataParallel, stage {config[-1]}")
                times = [run[config]["ms"] for run in runs]
                ratios = [run[config]["ms"] / run["mirrored"]["ms"] for run in runs]
                grads = "—" if first["grads"] is None else first["grads"]
                print(f"| {backend} | {devices} | {name} | {first['params']} | {grads} | "
                      f"{first['optimizer']} | {state} | {spread(times)} | {spread(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
