"""Step-time benchmark: `ks.MirroredStrategy` next to plain Keras and the native baselines,
and `ks.CentralStorageStrategy` next to `ks.MirroredStrategy`.

Runs the same model, the same NumPy data and the same global batch through
`model.fit` in several configurations and prints Markdown tables of median
ms/step ratios, for each model of `--models`: an MLP (64 features -> 3 x
Dense(256, relu) -> Dense(10), global batch 256) and a small CNN (28x28x1
images -> Conv2D(16, 3) -> MaxPool -> Conv2D(32, 3) -> MaxPool -> Dense(10),
global batch 128):

1. `ks.MirroredStrategy(devices=["cpu:0"])` vs plain Keras `fit` (no strategy),
   on TensorFlow, JAX and PyTorch.
2. `ks.MirroredStrategy` on 2 and 4 virtual CPU devices vs
   `tf.distribute.MirroredStrategy` (TensorFlow backend), vs
   `keras.distribution.DataParallel` (JAX backend), and vs plain Keras on one
   device (PyTorch backend, which has no data parallelism of its own).
3. `ks.CentralStorageStrategy` vs `ks.MirroredStrategy` on 1, 2 and 4 devices,
   on every backend (target <= 1.10).
4. A custom training loop as in TensorFlow's distributed-training guide
   (`strategy.run` in a `ks.function`, `ks.compute_average_loss`, the same
   optimizer and accuracy metric) vs `ks.MirroredStrategy`'s `fit`, on 1, 2
   and 4 devices, on every backend (target <= 1.20).

Every measurement runs in its own child process, because the Keras backend
and the number of (virtual) devices are fixed when a process initialises its
backend. The parent spawns

    python bench/mirrored_step_time.py --worker --backend B --devices N --mode M ...

and each child prints one JSON line (prefixed with `BENCH-RESULT `). The smoke run, whose
numbers mean nothing, measures its cells a few per process instead (`--cells`): ours in
one, the baselines in another, per backend.

Timing: a Keras callback records `time.perf_counter()` in
`on_train_batch_begin` / `on_train_batch_end`. Because the callback overrides
`on_train_batch_end`, Keras calls it synchronously and converts the logs to
Python floats first, so the interval covers the whole step (asynchronous JAX /
TF work included). Epoch 0 (tracing / compilation / warm-up) is excluded; the
median over the remaining steps is reported. The begin-to-begin "cycle" time
(the step plus loop overhead between steps) is recorded too, as a cross-check.
Ratios pair each run of ours with the baseline run made right before or after
it (the order alternates between repeats) and report the median pair ratio.
After timing, `ks` workers also time the top-level pieces of ks's train step
(`--breakdown`), printed as a third table.

Usage:
    python bench/mirrored_step_time.py                      # full run (a few minutes)
    python bench/mirrored_step_time.py --quick              # fewer steps
    python bench/mirrored_step_time.py --smoke --backends jax  # every code path, tiny sizes (the test suite's run)
    python bench/mirrored_step_time.py --backends jax --devices 1,2
    python bench/mirrored_step_time.py --repeats 3          # 3 interleaved runs per cell (less noise)
    python bench/mirrored_step_time.py --compare central    # only CentralStorage against Mirrored
    python bench/mirrored_step_time.py --compare custom     # only the custom loop against fit
    python bench/mirrored_step_time.py --threads 0          # backend-default intra-op threads (default 1)
    python bench/mirrored_step_time.py --source /tmp/ks_snapshot  # a frozen copy of the package
    python bench/mirrored_step_time.py --worker --backend jax --devices 2 --mode ks --profile 20
    KS_PROFILE_CALLERS=device_put python bench/mirrored_step_time.py --worker ... --profile 20  # + callers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

RESULT_PREFIX = "BENCH-RESULT "
BACKENDS = ("tensorflow", "jax", "torch")
TARGET = 1.05
# our mode -> the `--compare` choice that selects its comparisons
COMPARE_OF = {"ks": "mirrored", "ks_central": "central", "ks_custom": "custom"}
# (ours, baseline) -> the ratio ours/baseline to stay under, where it is not TARGET
TARGETS = {("ks_central", "ks"): 1.10, ("ks_custom", "ks"): 1.20}
# `ks` on several virtual devices against plain Keras on one (PyTorch, which has no native peer)
MULTI_DEVICE_PLAIN_TARGETS = {"mlp": 2.0, "cnn": 1.1}
# (model, backend) -> the ratio to plain Keras on one device that `ks` on several devices stays
# under, where one is set, also where the row's baseline is the native strategy
PLAIN_TARGETS = {("mlp", "tensorflow"): 1.3, ("mlp", "jax"): 1.3, ("mlp", "torch"): 2.0,
                 ("cnn", "tensorflow"): 1.1, ("cnn", "torch"): 1.1}

FEATURES = 64
HIDDEN = 256
CLASSES = 10
IMAGE = 28
# The model measured (`--model`): the MLP above, or a small CNN on 28x28 images (two Conv2D + Dense).
MODEL = {"name": "mlp"}
GLOBAL_BATCHES = {"mlp": 256, "cnn": 128}
GLOBAL_BATCH = GLOBAL_BATCHES["mlp"]  # the MLP's, which the other bench scripts measure
MODEL_DESCRIPTIONS = {
    "mlp": f"MLP {FEATURES}->{HIDDEN}x3->{CLASSES}",
    "cnn": f"CNN {IMAGE}x{IMAGE}x1 -> Conv2D(16, 3) -> MaxPool -> Conv2D(32, 3) -> MaxPool -> Dense({CLASSES})",
}


def global_batch() -> int:
    return GLOBAL_BATCHES[MODEL["name"]]

# mode -> human-readable name
MODE_NAMES = {
    "ks": "ks.MirroredStrategy",
    "ks_central": "ks.CentralStorageStrategy",
    "ks_custom": "ks.MirroredStrategy custom loop",
    "plain": "plain Keras fit (no strategy)",
    "tf_mirrored": "tf.distribute.MirroredStrategy",
    "jax_dp": "keras.distribution.DataParallel",
}


# ---------------------------------------------------------------------------
# Worker: one backend, one device count, one mode, in this process.
# ---------------------------------------------------------------------------
def _configure_devices(backend: str, devices: int, mode: str) -> None:
    """Gives the backend `devices` CPU devices before it initialises.

    `ks` mode uses the package's own switch (KERAS_STRATEGIES_CPU_DEVICES, read
    at import); baseline modes never import keras_strategies and configure the
    backend directly, so they measure stock Keras.
    """
    if mode.startswith("ks"):
        os.environ["KERAS_STRATEGIES_CPU_DEVICES"] = str(devices)
        return
    os.environ.pop("KERAS_STRATEGIES_CPU_DEVICES", None)
    if devices == 1 or (mode == "plain" and backend == "torch"):  # torch has no virtual devices: plain runs on one
        return
    if backend == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(devices)]
        )
    elif backend == "jax":
        import jax

        jax.config.update("jax_num_cpu_devices", devices)
    else:
        raise SystemExit(f"mode {mode!r} with {devices} devices is not supported on {backend}")


def _limit_threads(backend: str, threads: int) -> None:
    """Caps intra-op threads (0 = backend default); call before the backend initialises.

    On a small shared machine, thread pools that spin-wait (OpenMP in PyTorch,
    Eigen in TF / XLA) make step times swing by 10x when other processes take
    the cores; one intra-op thread per process keeps the comparison stable.
    Inter-op parallelism (virtual devices running side by side) is left alone.
    """
    if threads <= 0:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    if backend == "jax" and threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB, macOS bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def _make_data(steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    n = steps * global_batch()
    shape = (IMAGE, IMAGE, 1) if MODEL["name"] == "cnn" else (FEATURES,)
    x = rng.normal(size=(n,) + shape).astype("float32")
    w = rng.normal(size=(int(np.prod(shape)), CLASSES)).astype("float32")
    y = np.argmax(x.reshape(n, -1) @ w + 0.5 * rng.normal(size=(n, CLASSES)), axis=1).astype("int32")
    return x, y


def _build_model(keras):
    if MODEL["name"] == "cnn":
        layers = [
            keras.Input((IMAGE, IMAGE, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ]
    else:
        layers = [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


_TF_STRATEGIES: dict = {}  # devices -> this process's tf.distribute.MirroredStrategy


def _model_under_mode(keras, backend: str, devices: int, mode: str):
    """Returns the compiled model for `mode` and a short description of the setup."""
    if mode == "plain":
        return _build_model(keras), "no strategy"
    if mode == "ks":
        import keras_strategies as ks

        strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(devices)])
        with strategy.scope():
            model = _build_model(keras)
        origin = os.path.dirname(os.path.dirname(os.path.abspath(ks.__file__)))
        return model, (f"{strategy!r}, cross_device_ops={type(strategy.extended._cross_device_ops).__name__}, "
                       f"keras_strategies from {origin}")
    if mode == "ks_custom":
        model, setup = _model_under_mode(keras, backend, devices, "ks")
        return model, f"the guide's custom loop in ks.function, {setup}"
    if mode == "ks_central":
        import keras_strategies as ks

        strategy = ks.CentralStorageStrategy([f"cpu:{i}" for i in range(devices)])
        with strategy.scope():
            model = _build_model(keras)
        return model, f"{strategy!r}, parameter device {strategy.extended.parameter_devices[0]}"
    if mode == "tf_mirrored":
        import tensorflow as tf

        # One strategy per process: a second one in the same process would reuse the first's
        # collective instance keys (the smoke run measures both models in one process).
        if devices not in _TF_STRATEGIES:
            _TF_STRATEGIES[devices] = tf.distribute.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(devices)])
        strategy = _TF_STRATEGIES[devices]
        with strategy.scope():
            model = _build_model(keras)
        return model, f"tf.distribute.MirroredStrategy({strategy.num_replicas_in_sync} replicas)"
    if mode == "jax_dp":
        import jax

        cpu = jax.devices("cpu")
        if len(cpu) != devices:
            raise SystemExit(f"JAX has {len(cpu)} CPU devices, wanted {devices}")
        if global_batch() % devices:
            raise SystemExit(f"DataParallel needs a batch divisible by {devices}")
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=cpu))
        return _build_model(keras), f"DataParallel over {len(cpu)} JAX CPU devices"
    raise SystemExit(f"unknown mode {mode!r}")


def run_worker(args) -> None:
    """Measures each cell of `--cells` (or the one of `--model` and `--mode`) in this process, one
    JSON line each. The cells of one process share its backend, devices and kind of mode (ours or
    a baseline, which never imports keras_strategies)."""
    if args.source:
        # Benchmark the keras_strategies package found in this directory (e.g. a
        # `git archive` snapshot) instead of the installed / editable one.
        sys.path.insert(0, os.path.abspath(args.source))
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cells = [tuple(cell.split(":")) for cell in args.cells.split(",")] if args.cells else [(args.model, args.mode)]
    started = time.perf_counter()
    _limit_threads(args.backend, args.threads)
    _configure_devices(args.backend, args.devices, cells[0][1])

    import keras

    if keras.backend.backend() != args.backend:
        raise SystemExit(f"wanted backend {args.backend}, got {keras.backend.backend()}")
    for model_name, mode in cells:
        result = measure(keras, args, model_name, mode, started)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        started = time.perf_counter()


def measure(keras, args, model_name: str, mode: str, started: float) -> dict:
    """One cell: `fit` (or the custom loop) of `model_name` under `mode`, timed per step."""
    import numpy as np

    MODEL["name"] = model_name
    load_before = os.getloadavg()[0]

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0
            self.begin: dict = {}
            self.end: dict = {}

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.begin[epoch] = []
            self.end[epoch] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.begin[self.epoch].append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            # Keras has already turned `logs` into Python floats (a device sync).
            self.end[self.epoch].append(time.perf_counter())

    keras.utils.set_random_seed(0)
    x, y = _make_data(args.steps)
    model, setup = _model_under_mode(keras, args.backend, args.devices, mode)
    timer = StepTimer()
    imported = time.perf_counter()
    rss_before_fit = _peak_rss_mb()
    try:
        if mode == "ks_custom":
            final_loss = _custom_loop(keras, model, x, y, 1 + args.epochs, timer)
        else:
            history = model.fit(
                x, y, batch_size=global_batch(), epochs=1 + args.epochs, shuffle=False, verbose=0, callbacks=[timer]
            )
            final_loss = float(history.history["loss"][-1])
    finally:
        if mode == "jax_dp":
            keras.distribution.set_distribution(None)
    peak_rss = _peak_rss_mb()  # before the breakdown and the profile, which run more steps
    step_ms, cycle_ms = [], []
    for epoch in range(1, 1 + args.epochs):  # epoch 0 is warm-up
        begins, ends = timer.begin[epoch], timer.end[epoch]
        step_ms += [1e3 * (e - b) for b, e in zip(begins, ends)]
        cycle_ms += [1e3 * (b2 - b1) for b1, b2 in zip(begins, begins[1:])]
    warmup_ms = [1e3 * (e - b) for b, e in zip(timer.begin[0], timer.end[0])]
    result = {
        "backend": args.backend,
        "model": model_name,
        "devices": args.devices,
        "mode": mode,
        "setup": setup,
        "threads": args.threads,
        "median_ms": statistics.median(step_ms),
        "p10_ms": float(np.percentile(step_ms, 10)),
        "p90_ms": float(np.percentile(step_ms, 90)),
        "cycle_median_ms": statistics.median(cycle_ms) if cycle_ms else None,
        "first_step_ms": warmup_ms[0],
        "measured_steps": len(step_ms),
        "final_loss": final_loss,
        "fit_s": time.perf_counter() - imported,
        "process_s": time.perf_counter() - started,
        "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "peak_rss_mb": peak_rss,
        "fit_rss_growth_mb": peak_rss - rss_before_fit,
    }

    if mode == "ks" and args.breakdown:
        result["breakdown_ms"] = _breakdown(model, args.backend, args.breakdown)
    if args.profile:
        _profile(model, args.profile)
    return result


def _custom_loop(keras, model, x, y, epochs: int, timer) -> float:
    """The distributed-training guide's custom loop over `x, y` with `model`'s optimizer, timed
    like `fit` (each step from taking its batch to its loss as a Python float); the last epoch's
    mean loss."""
    import keras_strategies as ks
    from keras_strategies.keras_integration.ownership import strategy_of

    strategy = strategy_of(model)
    batch = global_batch()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def replica_step(features, labels):
        def loss_fn():
            logits = model(features, training=True)
            return ks.compute_average_loss(loss_object(labels, logits), global_batch_size=batch), logits

        (loss, logits), grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits)
        return loss

    @ks.function
    def train_step(features, labels):
        return strategy.reduce("sum", strategy.run(replica_step, args=(features, labels)), axis=None)

    dataset = strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset((x, y)).batch(batch))
    for epoch in range(epochs):
        timer.on_epoch_begin(epoch)
        iterator, losses = iter(dataset), []
        for step in range(len(x) // batch):
            timer.on_train_batch_begin(step)
            features, labels = next(iterator)
            losses.append(float(keras.ops.convert_to_numpy(train_step(features, labels))))
            timer.on_train_batch_end(step)
    return sum(losses) / len(losses)


# Top-level pieces of `ReplicaStep.train_step` (keras_strategies/trainer/replica_step.py)
# timed by `_breakdown`; names that do not exist in the installed version are skipped.
BREAKDOWN_METHODS = (
    "_loss_scale", "_weights", "_state", "_train", "_reduce", "_assign_non_trainable",
    "_global_predictions", "_concat_predictions", "_update_metrics", "_run_replicas", "_sum_across_replicas",
)


def _piece(step_obj, name: str) -> tuple:
    """`(owner, attribute)` of a breakdown piece: a method of the `ReplicaStep`, or of one of its
    parts (`program`, `host_update`, `workers`), where it is public (`_update_metrics` is
    `host_update.update_metrics`)."""
    if hasattr(step_obj, name):
        return step_obj, name
    for part in ("program", "host_update", "workers"):
        owner = getattr(step_obj, part, None)
        if owner is not None and hasattr(owner, name.lstrip("_")):
            return owner, name.lstrip("_")
    return step_obj, name


def _breakdown(model, backend: str, steps: int) -> dict:
    """Mean ms per training step spent in each top-level piece of ks's train step.

    Wraps (in this process only) the methods of the model's `ReplicaStep`, the
    `Shards` constructor and `optimizer.apply` with `perf_counter` timers that
    wait for the section's results (JAX dispatches asynchronously), runs
    `steps` more steps, and reports the means; `other` is the rest of
    `train_step`. Sections that call each other would overlap, so only
    top-level ones are listed.
    """
    import importlib

    x, y = _make_data(steps)
    holder = next((v for k, v in vars(model).items() if k.startswith("_ks") and hasattr(v, "train_step")), None)
    if holder is None:
        return {}
    # The model keeps either the ReplicaStep itself or an object whose `train_step`
    # is a bound method of it.
    step_obj = getattr(holder.train_step, "__self__", holder)
    sync = completion_wait(backend)

    totals: dict = {}
    timing = {"depth": 0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if timing["depth"]:
                return fn(*args, **kwargs)
            timing["depth"] += 1
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                sync(out)
                return out
            finally:
                timing["depth"] -= 1
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    originals = []
    # A step compiled as a whole (TensorFlow) runs its pieces inside one program: timed as one
    # ("_compiled_train"). Where the engine runs it as it is (a bound method), its pieces are timed.
    compiled_steps = getattr(step_obj, "_compiled_steps", {})
    compiled_whole = compiled_steps.get("train")
    if callable(compiled_whole) and getattr(compiled_whole, "__self__", None) is not step_obj:
        compiled_steps["train"] = timed("_compiled_train", compiled_whole)
    else:
        compiled_whole = None
    for name in BREAKDOWN_METHODS:
        owner, attribute = _piece(step_obj, name)
        fn = getattr(owner, attribute, None)
        if callable(fn):
            originals.append((owner, attribute, owner.__dict__.get(attribute)))
            object.__setattr__(owner, attribute, timed(name, fn))
    optimizer = model.optimizer
    originals.append((optimizer, "apply", optimizer.__dict__.get("apply")))
    object.__setattr__(optimizer, "apply", timed("optimizer", optimizer.apply))
    # Newer versions update through `engine.optimizer.apply_gradients` (e.g. a jitted
    # `stateless_apply` on JAX) instead of calling `optimizer.apply` directly.
    engine_optimizer = None
    try:
        from keras_strategies.backend import engine

        engine_optimizer = getattr(engine, "optimizer", None)
    except ImportError:
        pass
    engine_apply = getattr(engine_optimizer, "apply_gradients", None)
    if engine_apply is not None:
        engine_optimizer.apply_gradients = timed("optimizer", engine_apply)
    module = importlib.import_module(type(step_obj).__module__)
    shards_cls = getattr(module, "Shards", None)
    if shards_cls is not None:
        module.Shards = timed("Shards", shards_cls)
    train_step = holder.train_step
    total = {"train_step": 0.0}

    def outer(data, **kwargs):
        start = time.perf_counter()
        out = train_step(data, **kwargs)
        sync(out)
        total["train_step"] += time.perf_counter() - start
        return out

    holder_original = holder.__dict__.get("train_step")
    object.__setattr__(holder, "train_step", outer)
    try:
        model.fit(x, y, batch_size=global_batch(), epochs=1, shuffle=False, verbose=0)
    finally:
        if shards_cls is not None:
            module.Shards = shards_cls
        if engine_apply is not None:
            engine_optimizer.apply_gradients = engine_apply
        if compiled_whole is not None:
            compiled_steps["train"] = compiled_whole
        for obj, name, original in originals + [(holder, "train_step", holder_original)]:
            if original is None:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, original)
    result = {name: 1e3 * t / steps for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}
    result["other"] = 1e3 * total["train_step"] / steps - sum(result.values())
    result["train_step"] = 1e3 * total["train_step"] / steps
    return result


def _profile(model, steps: int) -> None:
    """cProfile of `steps` more training steps (already compiled), top entries to stderr."""
    import cProfile
    import io
    import pstats

    x, y = _make_data(steps)
    profiler = cProfile.Profile()
    profiler.enable()
    model.fit(x, y, batch_size=global_batch(), epochs=1, shuffle=False, verbose=0)
    profiler.disable()
    for sort in ("cumulative", "tottime"):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(sort)
        stats.print_stats(40)
        if os.environ.get("KS_PROFILE_CALLERS"):  # who calls the functions matching this pattern
            stats.print_callers(os.environ["KS_PROFILE_CALLERS"])
        print(f"==== cProfile, {steps} steps, sorted by {sort} ====\n{out.getvalue()}", file=sys.stderr)


# ---------------------------------------------------------------------------
# Parent: spawn the workers, assemble the table.
# ---------------------------------------------------------------------------
def comparisons(backends, device_counts):
    """(backend, devices, our mode, baseline mode) comparisons: `ks` against plain Keras and the
    native strategies, then `ks_central` against `ks`."""
    pairs = []
    for backend in backends:
        if 1 in device_counts:
            pairs.append((backend, 1, "ks", "plain"))
    for n in device_counts:
        if n == 1:
            continue
        if "tensorflow" in backends:
            pairs.append(("tensorflow", n, "ks", "tf_mirrored"))
        if "jax" in backends:
            pairs.append(("jax", n, "ks", "jax_dp"))
        if "torch" in backends:  # no native peer: plain Keras on one device, the physical limit here
            pairs.append(("torch", n, "ks", "plain"))
    pairs += [(backend, n, "ks_central", "ks") for backend in backends for n in device_counts]
    pairs += [(backend, n, "ks_custom", "ks") for backend in backends for n in device_counts]
    return pairs


def smoke_pairs(pairs):
    """Per backend for `--smoke`: its last `ks` comparison (the multi-device baseline where there is
    one), and CentralStorage and the custom loop on the same devices, whose `ks` run they share."""
    last = {}
    for pair in pairs:
        if pair[2] == "ks":
            last[pair[0]] = pair
    chosen = list(last.values())
    return chosen + [(b, n, ours, "ks") for ours in ("ks_central", "ks_custom") for b, n, _, _ in last.values()
                     if (b, n, ours, "ks") in pairs]


def spawn(backend: str, devices: int, mode: str, steps: int, epochs: int, threads: int, timeout: float,
          breakdown: int = 0, source: str = "") -> dict:
    """One cell (the current model under `mode`) in a child process of its own."""
    return spawn_cells(backend, devices, [(MODEL["name"], mode)], steps, epochs, threads, timeout, breakdown,
                       source)[0]


def spawn_cells(backend: str, devices: int, cells: list, steps: int, epochs: int, threads: int, timeout: float,
                breakdown: int = 0, source: str = "") -> list:
    """The results of `cells` ((model, mode) pairs, all ours or all baselines) measured one after
    the other in one child process; a cell the process did not reach gets its error."""
    ours = cells[0][1].startswith("ks")
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend,
        "--devices", str(devices), "--cells", ",".join(f"{model}:{mode}" for model, mode in cells),
        "--steps", str(steps), "--epochs", str(epochs),
        "--threads", str(threads), "--breakdown", str(breakdown if ours else 0),
    ] + (["--source", source] if source and ours else [])
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_STRATEGIES_CPU_DEVICES", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout * len(cells))
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
    return results + [{"error": f"exit {proc.returncode}: {tail}"}] * (len(cells) - len(results))


def smoke_cells(args, models: list) -> dict:
    """`--smoke`: every cell of every model, measured in one child process per backend and kind
    (ours, the baselines) instead of one per cell; keyed by (model, backend, devices, mode)."""
    groups: dict = {}
    for index, model in enumerate(models):
        for backend, n, *modes in model_pairs(args, index > 0):
            for mode in modes:
                cells = groups.setdefault((backend, n, mode.startswith("ks")), [])
                if (model, mode) not in cells:
                    cells.append((model, mode))
    measured = {}
    for (backend, n, _), cells in groups.items():
        results = spawn_cells(backend, n, cells, args.steps, args.epochs, args.threads, args.timeout,
                              args.breakdown, args.source)
        measured.update({(model, backend, n, mode): result for (model, mode), result in zip(cells, results)})
    return measured


def source_fingerprint(source: str = "") -> str:
    """Git HEAD of the project, whether keras_strategies/ has uncommitted changes, and a hash of its sources."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = os.path.join(os.path.abspath(source) if source else root, "keras_strategies")
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "keras_strategies"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "?", ""
    state = "with uncommitted changes" if dirty else "clean"
    if source:
        return f"keras_strategies from {os.path.abspath(source)}, sources sha256 {digest.hexdigest()[:12]}"
    return f"git {head or '?'} ({state} in keras_strategies/), sources sha256 {digest.hexdigest()[:12]}"


def _against_plain(runs: dict, backend: str, devices: int, mine: str) -> str:
    """`ks` on `devices` devices against plain Keras on one device, round by round of the same run
    (not back to back where the row's baseline is another mode), with the target where one is set."""
    plain = runs.get((backend, 1, "plain")) or runs.get((backend, devices, "plain"))
    ratios = paired_ratios(runs.get((backend, devices, mine), []), plain or [], "median_ms") if mine == "ks" else []
    if not ratios:
        return "—"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    target = PLAIN_TARGETS.get((MODEL["name"], backend)) if devices > 1 else TARGET
    met = "" if target is None else f", <= {target:.2f}" + (" met" if statistics.median(ratios) <= target else " **missed**")
    return f"{statistics.median(ratios):.2f}{spread}{met}"


def paired_ratios(ours: list, base: list, field: str) -> list:
    return [a[field] / b[field] for a, b in zip(ours, base)
            if "error" not in a and "error" not in b and a.get(field) and b.get(field)]


def _fmt(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def run_parent(args) -> int:
    """Every `--models` model in turn, each with its tables."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in GLOBAL_BATCHES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(GLOBAL_BATCHES)}")
    measured = None
    if args.smoke:  # tiny sizes; every cell measured first, a few per process (its numbers mean nothing)
        args.quick = False
        args.steps, args.epochs, args.repeats, args.breakdown = 2, 1, 1, min(args.breakdown, 2)
        measured = smoke_cells(args, models)
    failed = 0
    for index, model in enumerate(models):
        MODEL["name"] = model
        if len(models) > 1:
            print(f"{'' if index == 0 else chr(10)}### {MODEL_DESCRIPTIONS[model]}\n", flush=True)
        # The smoke run measures the second model in its multi-device comparison only.
        failed |= run_model(args, smoke_mirrored_only=args.smoke and index > 0, measured=measured)
    return failed


def model_pairs(args, smoke_mirrored_only: bool = False) -> list:
    """The (backend, devices, ours, baseline) comparisons of one model."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {BACKENDS}")
    device_counts = [1, 2] if args.smoke else [int(d) for d in args.devices.split(",") if d.strip()]
    pairs = [p for p in comparisons(backends, device_counts) if args.compare in ("all", COMPARE_OF[p[2]])]
    if args.smoke:
        pairs = smoke_pairs(pairs)
        if smoke_mirrored_only:
            pairs = [pair for pair in pairs if pair[2] == "ks"]
    if not pairs:
        raise SystemExit("nothing to run for these --backends / --devices")
    return pairs


def run_model(args, smoke_mirrored_only: bool = False, measured: Optional[dict] = None) -> int:
    """One model's runs (or, with `measured`, the smoke run's results) and tables."""
    steps, epochs = (10, 1) if args.quick else (args.steps, args.epochs)
    pairs = model_pairs(args, smoke_mirrored_only)

    runs: dict = {}
    loads: list = []
    fingerprint = source_fingerprint(args.source)
    t0 = time.perf_counter()
    for repeat in range(args.repeats):
        for backend, n, mine, baseline in pairs:
            # Alternate which side goes first on successive repeats.
            order = (mine, baseline) if repeat % 2 == 0 else (baseline, mine)
            for mode in order:
                key = (backend, n, mode)
                if key in runs and len(runs[key]) > repeat:
                    continue
                result = (measured[(MODEL["name"], backend, n, mode)] if measured is not None else
                          spawn(backend, n, mode, steps, epochs, args.threads, args.timeout, args.breakdown,
                                args.source))
                runs.setdefault(key, []).append(result)
                loads += result.get("load_1min", [])
                status = result.get("error") or (
                    f"{result['median_ms']:.2f} ms/step (p10 {result['p10_ms']:.2f}, p90 {result['p90_ms']:.2f}, "
                    f"cycle {_fmt(result['cycle_median_ms'])}), loss {result['final_loss']:.4f}, "
                    f"{result['process_s']:.1f}s"
                )
                print(f"[{time.perf_counter() - t0:6.1f}s] {backend:<10} devices={n} {mode:<11} {status}",
                      file=sys.stderr, flush=True)

    def summary(key):
        ok = [r for r in runs.get(key, []) if "error" not in r]
        if not ok:
            errors = [r.get("error") for r in runs.get(key, [])]
            return None, None, errors
        return (statistics.median(r["median_ms"] for r in ok),
                statistics.median(r["cycle_median_ms"] for r in ok if r["cycle_median_ms"] is not None)
                if any(r["cycle_median_ms"] is not None for r in ok) else None,
                [])

    lines = [
        "| backend | devices | ours | ours ms/step | baseline | baseline ms/step | ratio | target "
        "| ours / plain Keras on 1 device (same rounds) |",
        "|---|---:|---|---:|---|---:|---:|---|---:|",
    ]
    cycle_lines = [
        "| backend | devices | ours | ours cycle ms | baseline | baseline cycle ms | cycle ratio |",
        "|---|---:|---|---:|---|---:|---:|",
    ]
    errors = []
    for backend, n, mine, baseline in pairs:
        ours, ours_cycle, e1 = summary((backend, n, mine))
        base, base_cycle, e2 = summary((backend, n, baseline))
        errors += [f"{backend}/{n}/{m}: {e}" for m, es in ((mine, e1), (baseline, e2)) for e in es]
        # Ratios of runs made back to back (repeat i of ours with repeat i of the
        # baseline), so slow drifts in machine load cancel; median and range.
        ratios = paired_ratios(runs.get((backend, n, mine), []), runs.get((backend, n, baseline), []), "median_ms")
        ratio = statistics.median(ratios) if ratios else None
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        target = TARGETS.get((mine, baseline), TARGET)
        if n > 1 and baseline == "plain":  # several replicas against one device: the per-replica overhead
            target = MULTI_DEVICE_PLAIN_TARGETS[MODEL["name"]]
        met = "" if ratio is None else (" met" if ratio <= target else " **missed**")
        lines.append(
            f"| {backend} | {n} | {MODE_NAMES[mine]} | {_fmt(ours)} | {MODE_NAMES[baseline]} | {_fmt(base)} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'}{spread} | <= {target:.2f}{met} | "
            f"{_against_plain(runs, backend, n, mine)} |"
        )
        cratios = paired_ratios(runs.get((backend, n, mine), []), runs.get((backend, n, baseline), []),
                                "cycle_median_ms")
        cratio = statistics.median(cratios) if cratios else None
        cycle_lines.append(
            f"| {backend} | {n} | {MODE_NAMES[mine]} | {_fmt(ours_cycle)} | {MODE_NAMES[baseline]} | "
            f"{_fmt(base_cycle)} | {'—' if cratio is None else f'{cratio:.2f}'} |"
        )

    per_run = steps * epochs
    print(f"{MODEL_DESCRIPTIONS[MODEL['name']]}, Adam, sparse CE + accuracy, global batch {global_batch()}, "
          f"median of {per_run} steps per run (warm-up epoch excluded), {args.repeats} run(s) per cell "
          f"(ms/step: median over runs; ratio: median of back-to-back run ratios, range in brackets), "
          f"intra-op threads {args.threads or 'backend default'}, "
          f"total {time.perf_counter() - t0:.0f}s" + (" (SMOKE: tiny sizes, numbers mean nothing)" if args.smoke else ""))
    print_provenance(fingerprint, args.source, loads)
    print()
    print("\n".join(lines))
    print()
    print("Cross-check, begin-to-begin cycle time (step + loop overhead between steps):")
    print()
    print("\n".join(cycle_lines))
    print()
    print("Peak resident memory of each run's process (MiB; growth: from the compiled model to the end "
          "of fit, i.e. what fit itself added; plain Keras on one device is the reference):")
    print()
    print(memory_table(runs))
    breakdown = breakdown_table(pairs, runs)
    if breakdown:
        print()
        print(f"Where ks.MirroredStrategy's train step spends its time (mean ms/step over {args.breakdown} extra "
              "steps, each piece timed to completion; cf. bench/mirrored_step_time.py:_breakdown):")
        print()
        print(breakdown)
    if errors:
        print("\nErrors:\n" + "\n".join(errors))
    return 1 if errors else 0


def memory_table(runs) -> str:
    """Median peak RSS and fit's growth per run, with the ratio to plain Keras on the same backend."""
    lines = ["| backend | devices | run | peak RSS MiB | growth in fit MiB | peak vs plain Keras |",
             "|---|---:|---|---:|---:|---:|"]
    for backend, n, mode in sorted(runs, key=lambda k: (BACKENDS.index(k[0]), k[1], k[2] != "plain", k[2])):
        ok = [r for r in runs[(backend, n, mode)] if "peak_rss_mb" in r]
        if not ok:
            continue
        peak = statistics.median(r["peak_rss_mb"] for r in ok)
        growth = statistics.median(r["fit_rss_growth_mb"] for r in ok)
        plain = [r["peak_rss_mb"] for r in runs.get((backend, 1, "plain"), []) if "peak_rss_mb" in r]
        ratio = f"{peak / statistics.median(plain):.2f}" if plain else "—"
        lines.append(f"| {backend} | {n} | {MODE_NAMES[mode]} | {peak:.0f} | {growth:.0f} | {ratio} |")
    return "\n".join(lines)


BREAKDOWN_COLUMNS = ("_compiled_train", "optimizer", "_train", "_reduce", "_update_metrics", "_global_predictions")


def breakdown_table(pairs, runs) -> str:
    rows = []
    seen = set()
    for backend, n, _, _ in pairs:
        if (backend, n) in seen:
            continue
        seen.add((backend, n))
        parts = [r["breakdown_ms"] for r in runs.get((backend, n, "ks"), []) if r.get("breakdown_ms")]
        if not parts:
            continue
        part = parts[-1]
        total = part.get("train_step", 0.0)
        cells = [part.get(name) for name in BREAKDOWN_COLUMNS]
        rest = total - sum(c for c in cells if c is not None)
        share = lambda v: "—" if v is None else f"{v:.2f} ({100 * v / total:.0f}%)" if total else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {backend} | {n} | {total:.2f} | " + " | ".join(share(c) for c in cells) + f" | {share(rest)} |")
    if not rows:
        return ""
    header = ("| backend | devices | train_step ms | one compiled program (replicas + update + metrics) | "
              "optimizer update | _train (replica program) | "
              "_reduce (cross-device ops) | _update_metrics | _global_predictions | rest |")
    return "\n".join([header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + rows)


def completion_wait(backend: str):
    """`sync(out)`: waits until `out` is computed (JAX dispatches asynchronously; others return at once)."""
    if backend != "jax":
        return lambda out: out
    import jax

    def sync(out):
        try:
            jax.block_until_ready(out)
        except Exception:  # noqa: BLE001 - non-array leaves
            pass

    return sync


def print_provenance(fingerprint: str, source: str, loads: list) -> None:
    """Which code was measured (and whether it changed during the run), and how loaded the machine was."""
    fingerprint_end = source_fingerprint(source)
    if fingerprint_end != fingerprint:
        fingerprint += f" at the start; CHANGED during the run, at the end: {fingerprint_end}"
    print(f"Code: {fingerprint}. Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"1-min load average during the run {min(loads, default=0):.2f}-{max(loads, default=0):.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="(internal) run one measurement in this process")
    parser.add_argument("--backend", choices=BACKENDS, help="worker: the Keras backend")
    parser.add_argument("--mode", choices=sorted(MODE_NAMES), help="worker: what to measure")
    parser.add_argument("--devices", default="1,2,4",
                        help="parent: comma-separated device counts (default 1,2,4); worker: one count")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="parent: comma-separated backends")
    parser.add_argument("--models", default="mlp,cnn",
                        help="parent: comma-separated models, each with its tables (mlp: global batch 256; "
                             "cnn: 28x28 images, global batch 128; default both)")
    parser.add_argument("--model", choices=sorted(GLOBAL_BATCHES), default="mlp", help="worker: the model")
    parser.add_argument("--cells", default="",
                        help="worker: instead of --model and --mode, comma-separated model:mode cells measured "
                             "one after the other (the smoke run's)")
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch (default 50)")
    parser.add_argument("--epochs", type=int, default=2, help="measured epochs after the warm-up epoch (default 2)")
    parser.add_argument("--quick", action="store_true", help="parent: 10 steps x 1 measured epoch")
    parser.add_argument("--smoke", action="store_true",
                        help="parent: every code path with tiny sizes, for the test suite (numbers mean nothing): "
                             "2 steps, 1 run, per backend and model one comparison on 2 devices, "
                             "and for the first model CentralStorage against Mirrored on them")
    parser.add_argument("--compare", choices=("all", "mirrored", "central", "custom"), default="all",
                        help="parent: which comparisons: ks.MirroredStrategy against plain Keras and the native "
                             "strategies (mirrored), ks.CentralStorageStrategy against ks.MirroredStrategy "
                             "(central), the guide's custom loop against ks.MirroredStrategy's fit (custom), or "
                             "all of them (default)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="parent: interleaved runs per cell, median of medians (default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker process (default 1; 0 = backend default)")
    parser.add_argument("--source", default="",
                        help="directory holding the keras_strategies package to benchmark (e.g. a `git archive` "
                             "snapshot); default: the installed (editable) package")
    parser.add_argument("--timeout", type=float, default=600.0, help="parent: seconds per worker")
    parser.add_argument("--breakdown", type=int, default=20,
                        help="ks workers: afterwards, time the pieces of ks's train step over this many steps "
                             "(0 = off; default 20)")
    parser.add_argument("--profile", type=int, default=0,
                        help="worker: after timing, cProfile this many steps and print to stderr")
    args = parser.parse_args(argv)
    if args.worker:
        if not args.backend or not (args.mode or args.cells):
            parser.error("--worker needs --backend and --mode (or --cells)")
        args.devices = int(args.devices)
        run_worker(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
