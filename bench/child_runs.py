"""What the newer bench scripts share: a child process's one result line, a median with its range,
and for the scripts that train the models of `mirrored_step_time.py` side by side in one process
per backend and model, their options, their children, their models and their step timer."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import mirrored_step_time as single

NATIVE = {"tensorflow": "tf.distribute.MirroredStrategy", "jax": "keras.distribution.DataParallel", "torch": None}


def result_of(cmd: list, env: dict, prefix: str, timeout: float, what: str) -> dict:
    """The JSON after `prefix` on the child's stdout; else SystemExit with the end of its stderr."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
    raise SystemExit(f"{what} exited {proc.returncode} without a result:\n{tail}")


def spread(values: list) -> str:
    """`median (min–max)`, or the median alone for one value."""
    middle = f"{statistics.median(values):.2f}"
    return f"{middle} ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else middle


def side_by_side_options(description: str, rounds: int, rounds_help: str) -> argparse.ArgumentParser:
    """The options of a script that trains models side by side in one process per backend and model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", action="store_true", help="(internal) measure one backend and model here")
    parser.add_argument("--backend", choices=single.BACKENDS, help="worker: the Keras backend")
    parser.add_argument("--model", choices=sorted(single.GLOBAL_BATCHES), default="mlp", help="worker: the model")
    parser.add_argument("--backends", default=",".join(single.BACKENDS), help="comma-separated backends")
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated models (mlp, cnn)")
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices (default 4)")
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch (default 50)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default {rounds})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every code path (numbers mean nothing)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    return parser


def selected(args: argparse.Namespace) -> tuple[list, list]:
    """`(backends, models)` asked for; SystemExit naming any unknown one."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [b for b in backends if b not in single.BACKENDS] + [m for m in models if m not in single.GLOBAL_BATCHES]
    if unknown:
        raise SystemExit(f"unknown backend(s) or model(s) {unknown}; backends: {', '.join(single.BACKENDS)}; "
                         f"models: {', '.join(sorted(single.GLOBAL_BATCHES))}")
    return backends, models


def side_by_side_child(script: str, prefix: str, args: argparse.Namespace, backend: str, model: str) -> dict:
    """The result of `script --worker` for one backend and model, in a process of its own."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", "--backend", backend, "--model", model,
           "--devices", str(args.devices), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_STRATEGIES_CPU_DEVICES", None)  # the child sets its own devices
    return result_of(cmd, env, prefix, args.timeout, f"the {backend} {model} worker")


class SideBySide:
    """A worker's models, trained side by side in its process: ours under `ks.MirroredStrategy()`, the
    native peer on the same devices where the backend has one, and plain Keras on one device.

    They are the model of `args.model` with the data of `mirrored_step_time.py`, built from the same
    seed; `names` lists them in that order.
    """

    def __init__(self, args: argparse.Namespace):
        os.environ["KERAS_STRATEGIES_CPU_DEVICES"] = str(args.devices)
        single._limit_threads(args.backend, 1)

        import keras

        self.keras = keras
        single.MODEL["name"] = args.model
        self.x, self.y = single._make_data(args.steps)
        self.batch = single.global_batch()
        self.models = self._built(args.backend, args.devices)
        self.names = list(self.models)

    def _built(self, backend: str, devices: int) -> dict:
        """name -> (compiled model, context manager factory to train it in)."""
        import contextlib

        import keras_strategies as ks

        keras = self.keras

        def built(scope=contextlib.nullcontext):
            keras.utils.set_random_seed(0)
            with scope():
                return single._build_model(keras)

        strategy = ks.MirroredStrategy()
        models = {"ours": (built(strategy.scope), contextlib.nullcontext)}
        if backend == "tensorflow":
            import tensorflow as tf

            native = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])
            models["native"] = (built(native.scope), contextlib.nullcontext)
        elif backend == "jax":
            import jax

            native = keras.distribution.DataParallel(devices=jax.devices("cpu")[:devices])
            models["native"] = (built(native.scope), native.scope)
        models["plain"] = (built(), contextlib.nullcontext)
        return models

    def epoch(self, name: str, timer=None):
        """One epoch of model `name` (its `History`), timed by `timer` (`step_timer`) if given."""
        model, scope = self.models[name]
        with scope():
            return model.fit(self.x, self.y, batch_size=self.batch, epochs=1, verbose=0, shuffle=False,
                             callbacks=[timer] if timer else None)

    def rotation(self, rounds: int) -> list:
        """The models' names for `rounds` rounds of one epoch each, in an order that rotates from round
        to round, so that no model always follows the same one."""
        names = self.names
        return [name for r in range(rounds) for name in names[r % len(names):] + names[:r % len(names)]]


def step_timer(keras):
    """A Keras callback that records each training step's wall and processor time (seconds).

    It defines `on_train_batch_end`, so Keras calls it with the logs converted
    to Python floats: the interval covers the whole step, asynchronous work too.
    """

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.wall, self.cpu, self.start = [], [], (0.0, 0.0)

        def on_train_batch_begin(self, batch, logs=None):
            self.start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, batch, logs=None):
            self.wall.append(time.perf_counter() - self.start[0])
            self.cpu.append(time.process_time() - self.start[1])

    return StepTimer()
