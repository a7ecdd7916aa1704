"""Multi-worker benchmark: `ks.MultiWorkerMirroredStrategy` next to each backend's own multi-process path.

Two worker processes x 1 CPU device each, on 127.0.0.1, started by the
package's launcher (`python -m keras_strategies.launch`, which sets
`TF_CONFIG`). Same model, data and global batch as `bench/mirrored_step_time.py`
(MLP 64 -> 3 x Dense(256, relu) -> Dense(10), Adam(1e-3), sparse CE, global
batch 256, so 128 rows per worker). Per backend it measures:

1. Step time (median ms/step after a warm-up epoch) of `model.fit` under
   `ks.MultiWorkerMirroredStrategy` ("ks" jobs) vs the backend's own
   multi-process path ("native" jobs), reported as the ratio ours / native:
   - TensorFlow: a `tf.distribute.MultiWorkerMirroredStrategy` custom training
     loop (a `tf.function` train step with `strategy.run` and
     `optimizer.apply_gradients`; Keras 3 `fit` does not run under TF's
     own MultiWorkerMirroredStrategy).
   - JAX: Keras' own multi-process path, `keras.distribution.initialize(...)` +
     `set_distribution(DataParallel(devices=list_devices()))` + `fit`, each
     process feeding its half of every global batch (`batch_size=128`,
     `auto_shard_dataset=False`, which Keras requires for NumPy input; Keras
     builds the global array with `jax.make_array_from_process_local_data`).
   - PyTorch: a `torch.nn.parallel.DistributedDataParallel` loop (gloo) over
     the same Keras model (a `torch.nn.Module` on this backend) and Keras'
     Adam, as the TensorFlow loop uses them. For reference ("raw" jobs, after
     each pair, outside the target): the same MLP as plain `torch.nn` modules
     with `torch.optim.Adam` under DDP, which shows what Keras' own layers and
     optimizer cost on PyTorch.
   Every step of every mode ends with the global loss and accuracy on the host,
   as Keras' logs do (the TF and torch loops all-reduce [loss, correct] for it).
2. All-reduce throughput (in the "ks" jobs, after fit) for ~1 MB and ~16 MB of
   float32 split into 10 tensors (5 "kernels" + 5 "biases", like gradients),
   plus ~4 KB for the fixed cost of one collective:
   ours = `strategy.extended._cross_worker_sum(tensors, "bench", donated=True)`
   (as the train step sends its gradients, which the engine may sum in place;
   also reported with `donated=False`, a caller keeping its tensors), raw = the
   engine's bare collective on one pre-flattened buffer already in place:
   - TensorFlow: a `tf.function` running one `tf.raw_ops.CollectiveReduceV2`,
   - JAX: a jitted sum over a one-device-per-process mesh of a prebuilt global
     array (`jax.make_array_from_single_device_arrays`),
   - PyTorch: `torch.distributed.all_reduce` (gloo) of one flat tensor.
   Ours and raw alternate call by call, the same sequence on both workers.
   Reported: median ms per all-reduce, the payload rate (MB of payload / s) and
   the ratio ours_rate / raw_rate (target >= 0.9). For reference, also the raw
   engine handed the same ten tensors as they are ("raw, per tensor"; no
   target): one `CollectiveReduceV2` per tensor in one `tf.function`, one
   jitted `psum` of the list (XLA's CPU runtime runs its operands one after the
   other), `dist.all_reduce` of each tensor in turn. Also: ours on ~1 MB float32
   plus 256 targets as float32 vs as int32 (the engines run one collective per
   dtype, and a train step's exchange carries int32 targets).
3. Where ks's train step spends its time (`--breakdown`, one more epoch after
   the timed ones): forward + backward, the cross-worker exchange and the
   collective inside it (also the smaller of the two workers' times, step by
   step: the worker that arrives last waits least), optimizer, metrics.

Each job is one `launch(...)` of this script with `--job`; each worker prints
one `BENCH-RESULT {json}` line, the parent reads worker 0's (and worker 1's step
time and collective times as cross-checks) and prints Markdown tables. Jobs
alternate ks / native (order swapped on every repeat); ratios pair the runs
made back to back.

Timing: `model.fit` is timed with a Keras callback (`on_train_batch_begin` /
`on_train_batch_end`; defining `on_train_batch_end` makes Keras convert the
logs to floats first, a device sync), custom loops with `perf_counter` around
the step plus the host read of its loss and accuracy. Epoch 0 is warm-up.
Intra-op threads are capped at 1 per process (`--threads`), as in
`bench/mirrored_step_time.py`: 2 processes on 2 cores.

Usage:
    python bench/multi_worker_step_time.py                       # all backends (about 2 min)
    python bench/multi_worker_step_time.py --quick               # fewer steps / iterations
    python bench/multi_worker_step_time.py --smoke --backends jax  # every code path, tiny sizes (the test suite's run)
    python bench/multi_worker_step_time.py --backends torch,jax --repeats 2
    python bench/multi_worker_step_time.py --source /tmp/ks_snapshot   # a frozen copy of the package
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from mirrored_step_time import (  # noqa: E402  (the same model, data and thread cap)
    CLASSES,
    FEATURES,
    GLOBAL_BATCH,
    HIDDEN,
    _build_model,
    _limit_threads,
    _make_data,
    completion_wait,
    print_provenance,
    source_fingerprint,
)

RESULT_PREFIX = "BENCH-RESULT "
BACKENDS = ("tensorflow", "jax", "torch")
WORKERS = 2
STEP_TARGET = 1.2  # ours / native ms per step
RATE_TARGET = 0.9  # ours / raw all-reduce rate
PAYLOADS_MB = (1 / 256, 1, 16)  # 4 KB: the fixed cost of one collective (no target); 1 and 16 MB: throughput
SMOKE_PAYLOADS_MB = (0.25,)  # --smoke: the same code paths on one small payload
TENSORS = 10

NATIVE_NAMES = {
    "tensorflow": "tf.distribute.MultiWorkerMirroredStrategy custom loop",
    "jax": "keras.distribution.DataParallel fit (jax.distributed + gloo)",
    "torch": "torch DistributedDataParallel loop over the Keras model (gloo)",
}
# Reference runs without Keras, where the native path above keeps Keras' model (PyTorch).
RAW_REFERENCE = {"torch": "the same MLP as plain torch.nn modules, torch.optim.Adam, under DistributedDataParallel"}
RAW_NAMES = {
    "tensorflow": "tf.raw_ops.CollectiveReduceV2 in a tf.function",
    "jax": "jitted sum over a process mesh (gloo)",
    "torch": "dist.all_reduce, one flat tensor (gloo)",
}


# ---------------------------------------------------------------------------
# Worker side: one process of a 2-worker job.
# ---------------------------------------------------------------------------
def _cluster() -> tuple[int, list]:
    config = json.loads(os.environ["TF_CONFIG"])
    return int(config["task"]["index"]), list(config["cluster"]["worker"])


def _local_rows(index: int, x, y):
    """This worker's half of every global batch, in order (rows [128 i, 128 (i + 1)) of each)."""
    per_worker = GLOBAL_BATCH // WORKERS
    steps = x.shape[0] // GLOBAL_BATCH
    xl = x.reshape(steps, GLOBAL_BATCH, -1)[:, index * per_worker:(index + 1) * per_worker].reshape(-1, x.shape[1])
    yl = y.reshape(steps, GLOBAL_BATCH)[:, index * per_worker:(index + 1) * per_worker].reshape(-1)
    return xl, yl


def _summary(step_s: list, cycles_ms: list, first_epoch_s: list) -> dict:
    """Median etc. of the measured step times (seconds) in ms."""
    import numpy as np

    ms = [1e3 * s for s in step_s]
    return {
        "median_ms": statistics.median(ms),
        "p10_ms": float(np.percentile(ms, 10)),
        "p90_ms": float(np.percentile(ms, 90)),
        "cycle_median_ms": statistics.median(cycles_ms) if cycles_ms else None,
        "first_step_ms": 1e3 * first_epoch_s[0] if first_epoch_s else None,
        "measured_steps": len(ms),
    }


def _fit_timed(keras, model, x, y, batch_size: int, epochs: int) -> dict:
    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch, self.begin, self.end = 0, {}, {}

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.begin[epoch], self.end[epoch] = [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.begin[self.epoch].append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            self.end[self.epoch].append(time.perf_counter())  # logs are Python floats by now

    timer = StepTimer()
    history = model.fit(x, y, batch_size=batch_size, epochs=1 + epochs, shuffle=False, verbose=0, callbacks=[timer])
    steps, cycles = [], []
    for epoch in range(1, 1 + epochs):
        b, e = timer.begin[epoch], timer.end[epoch]
        steps += [t1 - t0 for t0, t1 in zip(b, e)]
        cycles += [1e3 * (t1 - t0) for t0, t1 in zip(b, b[1:])]
    result = _summary(steps, cycles, [t1 - t0 for t0, t1 in zip(timer.begin[0], timer.end[0])])
    result["final_loss"] = float(history.history["loss"][-1])
    result["final_accuracy"] = float(history.history["accuracy"][-1])
    return result


def _loop_timed(step_fn, batches: list, epochs: int) -> dict:
    """Runs `step_fn(*batch) -> (loss, accuracy)` (host floats) over `batches`, 1 + epochs times.

    The final loss and accuracy are means over the last epoch, as in Keras' history.
    """
    per_epoch, cycles, logs = [], [], []
    for _ in range(1 + epochs):
        times, begins, logs = [], [], []
        for batch in batches:
            start = time.perf_counter()
            begins.append(start)
            logs.append(step_fn(*batch))
            times.append(time.perf_counter() - start)
        per_epoch.append(times)
        if len(per_epoch) > 1:
            cycles += [1e3 * (t1 - t0) for t0, t1 in zip(begins, begins[1:])]
    result = _summary([t for times in per_epoch[1:] for t in times], cycles, per_epoch[0])
    result["final_loss"] = statistics.fmean(float(loss) for loss, _ in logs)
    result["final_accuracy"] = statistics.fmean(float(accuracy) for _, accuracy in logs)
    return result


# Pieces of ks's multi-worker train step (`ReplicaStep.train_step`,
# keras_strategies/trainer/replica_step.py) timed by `_breakdown`.
# Where the engine runs the exchange inside the compiled step (TensorFlow,
# keras_strategies/trainer/exchange_in_program.py), that one program is timed instead.
BREAKDOWN_SECTIONS = ("_train", "_exchange", "optimizer", "_update_metrics", "step_program")


def _breakdown(keras, model, strategy, x, y, backend: str) -> dict:
    """Mean ms per step of the top-level pieces of ks's train step, over one more epoch of fit.

    Wraps (in this process only) the model's `ReplicaStep` methods, the engine's
    `optimizer.apply_gradients` and `strategy.extended._start_cross_worker_sum`
    (every cross-worker sum starts there; its time is the start plus the wait)
    with `perf_counter` timers that wait for each piece's results (JAX dispatches
    asynchronously). Where the exchange runs during the backward pass (PyTorch,
    one replica per worker), its sums start inside `_train` and the exchange
    column is what is left after the backward pass: the waits and the unpacking
    (`OverlappedExchange.finish`). Also records what one step sends across
    workers (bytes, dtypes: the engines run one collective per dtype) and each
    step's collective time, so that the parent can take, step by step, the
    smaller of the two workers' times: the worker that arrives last waits least,
    so that is about the transfer itself.
    """
    import numpy as np
    from keras_strategies.backend import engine
    from keras_strategies.trainer import replica_step

    try:
        from keras_strategies.trainer import worker_exchange
    except ImportError:  # a version whose step holds its exchange itself
        worker_exchange = None

    holder = getattr(model, "_ks_replica_step", None)
    step_obj = getattr(getattr(holder, "train_step", None), "__self__", None)
    if step_obj is None or not (hasattr(step_obj, "_exchange") or hasattr(step_obj, "workers")):
        return {}
    sync = completion_wait(backend)

    totals = {name: 0.0 for name in BREAKDOWN_SECTIONS + ("train_step",)}
    collective_ms: list = []
    payload: dict = {"bytes": 0, "tensors": 0, "dtypes": set()}
    state = {"inside": 0, "step": 0, "step_ms": 0.0}

    def timed(name, fn, after=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            if name == "train_step":
                state["step"] += 1
                state["step_ms"] = 0.0
            state["inside"] += name in ("_train", "_exchange")
            try:
                out = fn(*args, **kwargs)
                sync(out if after is None else after())
            finally:
                state["inside"] -= name in ("_train", "_exchange")
                totals[name] += time.perf_counter() - start
                if name == "train_step":
                    collective_ms.append(state["step_ms"])
            return out

        return wrapper

    class TimedWait:
        def __init__(self, started, ms):
            self._started, self._ms = started, ms

        def wait(self):
            start = time.perf_counter()
            out = self._started.wait()
            sync(out)
            state["step_ms"] += self._ms + 1e3 * (time.perf_counter() - start)
            return out

    extended = strategy.extended
    start_sum = getattr(extended, "_start_cross_worker_sum", None)

    def counted_start(values, what="all-reduce", donated=False):
        if not state["inside"]:
            return start_sum(values, what, donated)
        if state["step"] == 2:  # what one step sends (the same every step but the first)
            arrays = [np.asarray(keras.ops.convert_to_numpy(v)) for v in values]
            payload["bytes"] += sum(a.nbytes for a in arrays)
            payload["tensors"] += len(arrays)
            payload["dtypes"].update(str(a.dtype) for a in arrays)
        start = time.perf_counter()
        started = start_sum(values, what, donated)
        return TimedWait(started, 1e3 * (time.perf_counter() - start))

    # Each piece where this version has it: on the step, or on one of its parts (`workers.run`,
    # `host_update.update_metrics`).
    workers, host_update = getattr(step_obj, "workers", step_obj), getattr(step_obj, "host_update", step_obj)
    patched = [(step_obj, "_train", "_train"), (step_obj, "train_step", "train_step"),
               (workers, "run", "_exchange") if workers is not step_obj else (step_obj, "_exchange", "_exchange"),
               (host_update, "update_metrics", "_update_metrics") if host_update is not step_obj
               else (step_obj, "_update_metrics", "_update_metrics")]
    # The in-program exchange's compiled steps, by step kind (put back as they were afterwards).
    programs = getattr(getattr(step_obj, "_exchange_in_program", None), "_programs", {})
    kept_programs = dict(programs)
    for kind, program in kept_programs.items():
        programs[kind] = timed("step_program", program)
    for obj, name, section in patched:
        object.__setattr__(obj, name, timed(section, getattr(obj, name)))
    overlapped = getattr(worker_exchange, "OverlappedExchange", None) or getattr(replica_step, "_OverlappedExchange", None)
    overlapped_finish = getattr(overlapped, "finish", None)
    if overlapped_finish is not None:
        overlapped.finish = timed("_exchange", overlapped_finish)
    engine_apply = engine.optimizer.apply_gradients
    engine.optimizer.apply_gradients = timed(
        "optimizer", engine_apply, after=lambda: [v.value for v in model.optimizer.variables]
    )
    if start_sum is not None:  # (a snapshot from before it existed: no collective times)
        extended._start_cross_worker_sum = counted_start
    holder.train_step = step_obj.train_step
    steps = x.shape[0] // GLOBAL_BATCH
    try:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        engine.optimizer.apply_gradients = engine_apply
        extended.__dict__.pop("_start_cross_worker_sum", None)
        if overlapped_finish is not None:
            overlapped.finish = overlapped_finish
        for obj, name, _ in patched:
            obj.__dict__.pop(name, None)
        programs.update(kept_programs)
        holder.train_step = step_obj.train_step
    result = {name: 1e3 * value / steps for name, value in totals.items()}
    result["collective"] = sum(collective_ms) / steps
    result["collective_ms"] = collective_ms
    result["payload_kb"] = payload["bytes"] / 1024
    result["payload_tensors"] = payload["tensors"]
    result["dtypes"] = sorted(payload["dtypes"])
    return result


# --- native paths --------------------------------------------------------------------
def _native_tensorflow(args, index: int, x, y) -> tuple[dict, str]:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG; before any TF op
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _build_model(keras)  # compiled, but only its layers and optimizer are used
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_sum(loss_fn(yb, logits)) / GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces the gradients
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), yb), tf.float32))
        return tf.stack([loss, correct])

    @tf.function
    def train_step(xb, yb):
        per_replica = strategy.run(replica_step, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def step(xb, yb):
        totals = train_step(xb, yb).numpy()
        return totals[0], totals[1] / GLOBAL_BATCH

    xl, yl = _local_rows(index, x, y)
    half = GLOBAL_BATCH // WORKERS
    batches = [(tf.constant(xl[i:i + half]), tf.constant(yl[i:i + half])) for i in range(0, len(xl), half)]
    return _loop_timed(step, batches, args.epochs), (
        f"tf.distribute.MultiWorkerMirroredStrategy({strategy.num_replicas_in_sync} replicas), "
        f"custom tf.function loop, {half} rows per worker"
    )


def _native_jax(args, index: int, addresses: list, x, y) -> tuple[dict, str]:
    import jax

    # Keras' initialize() does not choose the CPU collectives; jax 0.10 uses gloo on CPU by
    # default (checked: DataParallel fit works without this line), set here as ks does.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    # The same seed (so the same initial weights) as the ks run; without a seed, initialize()
    # makes the processes agree on a random one with a pmap psum.
    keras.utils.set_random_seed(0)
    keras.distribution.initialize(job_addresses=",".join(addresses), num_processes=WORKERS, process_id=index)
    devices = keras.distribution.list_devices()
    # NumPy input must come pre-sharded: each process passes its own rows (Keras refuses
    # arrays with auto-sharding on, which only knows how to shard a tf.data.Dataset).
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))
    model = _build_model(keras)
    xl, yl = _local_rows(index, x, y)
    half = GLOBAL_BATCH // WORKERS
    result = _fit_timed(keras, model, xl, yl, half, args.epochs)
    return result, (
        f"keras.distribution.DataParallel(devices={devices}), jax.process_count()={jax.process_count()}, "
        f"fit(batch_size={half}) on each process's half of every global batch"
    )


def _native_torch(args, index: int, addresses: list, x, y) -> tuple[dict, str]:
    """torch's own data parallelism over the same Keras model and optimizer (as TensorFlow's
    native loop uses them): the model, a `torch.nn.Module` on this backend, wrapped in
    `DistributedDataParallel`, which all-reduces the gradient buckets during `backward()`."""
    import torch

    _join_torch_group(index, addresses)
    import keras

    keras.utils.set_random_seed(0)
    model = _build_model(keras)  # compiled, but only its layers and optimizer are used
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    variables = model.trainable_variables
    half = GLOBAL_BATCH // WORKERS

    def step(xb, yb):
        logits = wrapped(xb, training=True)
        loss = torch.sum(loss_fn(yb, logits)) / half  # the local mean; DDP averages over ranks
        for variable in variables:
            variable.value.grad = None
        loss.backward()
        with torch.no_grad():
            optimizer.apply([variable.value.grad for variable in variables], variables)
        return _global_loss_and_accuracy(loss, logits, yb)

    return _torch_loop(args, index, x, y, step), (
        f"DistributedDataParallel(gloo, world_size={WORKERS}) over the Keras model, Keras Adam, {half} rows per rank"
    )


def _raw_torch(args, index: int, addresses: list, x, y) -> tuple[dict, str]:
    """Reference for the PyTorch row: the same MLP as plain `torch.nn` modules with
    `torch.optim.Adam` under `DistributedDataParallel`, without Keras."""
    import torch

    _join_torch_group(index, addresses)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    model = torch.nn.parallel.DistributedDataParallel(net)  # broadcasts rank 0's weights
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()  # mean over the local rows; DDP averages over ranks

    def step(xb, yb):
        optimizer.zero_grad(set_to_none=True)
        logits = model(xb)
        loss = loss_fn(logits, yb)
        loss.backward()  # DDP all-reduces the gradient buckets here
        optimizer.step()
        return _global_loss_and_accuracy(loss, logits, yb)

    return _torch_loop(args, index, x, y, step), (
        f"DistributedDataParallel(gloo, world_size={WORKERS}) over torch.nn, torch.optim.Adam, "
        f"{GLOBAL_BATCH // WORKERS} rows per rank"
    )


def _join_torch_group(index: int, addresses: list) -> None:
    import torch.distributed as dist

    host, port = addresses[0].rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=index, world_size=WORKERS)


def _global_loss_and_accuracy(loss, logits, yb) -> tuple:
    """The global batch's loss and accuracy on the host, as Keras' logs are."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        totals = torch.stack([loss.detach() * yb.shape[0], (logits.argmax(-1) == yb).sum().float()])
        dist.all_reduce(totals)
    loss_sum, correct = totals.tolist()
    return loss_sum / GLOBAL_BATCH, correct / GLOBAL_BATCH


def _torch_loop(args, index: int, x, y, step) -> dict:
    """`step` timed over this rank's rows of every global batch; leaves the process group."""
    import torch
    import torch.distributed as dist

    xl, yl = _local_rows(index, x, y)
    half = GLOBAL_BATCH // WORKERS
    batches = [(torch.from_numpy(xl[i:i + half].copy()), torch.from_numpy(yl[i:i + half].astype("int64")))
               for i in range(0, len(xl), half)]
    try:
        return _loop_timed(step, batches, args.epochs)
    finally:
        dist.barrier()
        dist.destroy_process_group()


# --- all-reduce: ours vs the raw engine -------------------------------------------------
def _payload_shapes(megabytes: float) -> list:
    """10 float32 shapes totalling ~`megabytes` MB: 5 kernels (d, d) and 5 biases (d,)."""
    floats = megabytes * 2**20 / 4
    d = int(((25 + 20 * floats) ** 0.5 - 5) / 10)  # 5 d^2 + 5 d = floats
    return [(d, d), (d,)] * (TENSORS // 2)


_TF_INSTANCE_KEYS: list = []


def _backend_tensors(backend: str, arrays: list) -> list:
    """NumPy arrays as tensors of the backend (TF: on the worker's device), like gradients."""
    if backend == "tensorflow":
        import tensorflow as tf
        from keras_strategies.backend.tensorflow import collectives

        with tf.device(collectives._state["device"]):
            return [tf.constant(a) for a in arrays]
    if backend == "jax":
        import jax.numpy as jnp

        return [jnp.asarray(a) for a in arrays]
    import torch

    return [torch.from_numpy(a) for a in arrays]


def _ours(backend: str, strategy, arrays: list, donated: bool = True):
    """One `strategy.extended._cross_worker_sum` of `arrays` (as backend tensors), run to completion.

    `donated=True` is how the train step sends its gradients (the engine may
    sum them in place); `False` is a caller that keeps its tensors.
    """
    tensors = _backend_tensors(backend, arrays)
    reduce_ours = strategy.extended._cross_worker_sum
    if backend == "jax":
        import jax

        return lambda: jax.block_until_ready(reduce_ours(tensors, "bench", donated))
    # Eager TF and torch on CPU: the results are ready on return.
    return lambda: reduce_ours(tensors, "bench", donated)


def _tf_collective_sum():
    """A bare `CollectiveReduceV2` sum over the workers, with an instance key of our own group (TF)."""
    import tensorflow as tf

    instance_key = 7_000_000 + len(_TF_INSTANCE_KEYS)
    _TF_INSTANCE_KEYS.append(instance_key)
    return lambda t: tf.raw_ops.CollectiveReduceV2(
        input=t, group_size=WORKERS, group_key=7_000_000, instance_key=instance_key,
        ordering_token=[], merge_op="Add", final_op="Id", communication_hint="auto",
    )


def _jax_process_mesh() -> tuple:
    """`(mesh with one device per process, this process's device, sharding over processes)` of the engine."""
    from keras_strategies.backend.jax import collectives

    return collectives._state["mesh"], collectives._state["device"], collectives._state["split"]


def _raw(backend: str, total: int):
    """The engine's bare collective on one pre-flattened float32 buffer of `total` elements, in place."""
    import numpy as np

    if backend == "tensorflow":
        import tensorflow as tf
        from keras_strategies.backend.tensorflow import collectives

        device = collectives._state["device"]
        collective_sum = _tf_collective_sum()
        with tf.device(device):
            flat = tf.zeros([total], "float32")

        @tf.function
        def raw_fn(t):
            with tf.device(device):
                return collective_sum(t)

        return lambda: raw_fn(flat)
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh, device, split = _jax_process_mesh()
        local = jax.device_put(np.zeros((1, total), "float32"), device)
        stacked = jax.make_array_from_single_device_arrays((mesh.size, total), split, [local])
        program = jax.jit(lambda s: jnp.sum(s, axis=0), out_shardings=NamedSharding(mesh, P()))
        return lambda: program(stacked).block_until_ready()
    import torch
    import torch.distributed as dist

    flat = torch.zeros(total, dtype=torch.float32)
    return lambda: dist.all_reduce(flat)


def _raw_per_tensor(backend: str, arrays: list):
    """The engine's bare collective on the same list of tensors, as they are (no packing, no ks code).

    On copies of `arrays`: torch sums in place, and the other functions share
    the arrays' memory.
    """
    tensors = _backend_tensors(backend, [a.copy() for a in arrays])
    if backend == "tensorflow":
        import tensorflow as tf
        from keras_strategies.backend.tensorflow import collectives

        device = collectives._state["device"]
        sums = [_tf_collective_sum() for _ in tensors]

        @tf.function
        def per_tensor(ts):
            with tf.device(device):
                return [collective_sum(t) for collective_sum, t in zip(sums, ts)]

        return lambda: per_tensor(tensors)
    if backend == "jax":
        import jax
        from jax.sharding import PartitionSpec as P

        mesh, device, split = _jax_process_mesh()
        blocks = [jax.make_array_from_single_device_arrays(
            (mesh.size,) + tuple(t.shape), split, [jax.device_put(t[None], device)]) for t in tensors]
        program = jax.jit(jax.shard_map(lambda *bs: jax.lax.psum(list(bs), "workers"), mesh=mesh,
                                        in_specs=P("workers"), out_specs=P(), check_vma=False))
        return lambda: jax.block_until_ready([out.addressable_data(0) for out in program(*blocks)])
    import torch.distributed as dist

    def run():
        for t in tensors:
            dist.all_reduce(t)

    return run


def _packed(backend: str, arrays: list):
    """A bare list-in, list-out all-reduce: one concatenation, the raw collective, one split (no ks code).

    What `_cross_worker_sum` has to do at least: the floor for "ours" on the
    same list of tensors. On JAX everything stays on the device (a jitted
    concatenation, the global array assembled from the local one, a jitted sum
    and split with replicated outputs).
    """
    import numpy as np

    shapes = [a.shape for a in arrays]
    sizes = [int(np.prod(shape)) for shape in shapes]
    total = sum(sizes)
    tensors = _backend_tensors(backend, arrays)
    if backend == "tensorflow":
        import tensorflow as tf
        from keras_strategies.backend.tensorflow import collectives

        device = collectives._state["device"]
        collective_sum = _tf_collective_sum()

        @tf.function
        def packed_fn(ts):
            with tf.device(device):
                summed = collective_sum(tf.concat([tf.reshape(t, [-1]) for t in ts], 0))
                return [tf.reshape(p, shape) for p, shape in zip(tf.split(summed, sizes), shapes)]

        return lambda: packed_fn(tensors)
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh, device, split = _jax_process_mesh()
        tensors = [jax.device_put(t, device) for t in tensors]
        pack = jax.jit(lambda ts: jnp.concatenate([jnp.ravel(t) for t in ts])[None])
        offsets = np.cumsum([0] + sizes)

        def total_and_split(stacked):
            summed = jnp.sum(stacked, axis=0)
            return [summed[offsets[i]:offsets[i + 1]].reshape(shape) for i, shape in enumerate(shapes)]

        program = jax.jit(total_and_split, out_shardings=NamedSharding(mesh, P()))

        def run():
            stacked = jax.make_array_from_single_device_arrays((mesh.size, total), split, [pack(tensors)])
            return jax.block_until_ready([out.addressable_data(0) for out in program(stacked)])

        return run
    import torch.distributed as dist

    def run():
        import torch

        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        return [p.view(shape) for p, shape in zip(flat.split(sizes), shapes)]

    return run


def _interleaved(fns: dict, iters: int, warmup: int = 3) -> dict:
    """Seconds per call of each function: `warmup` calls each, then `iters` rounds of one call each.

    The functions alternate call by call, so slow drifts of the machine (load,
    frequency) fall on all of them alike, and each round runs them in a fresh
    random order (seeded by the round: every worker runs the same sequence),
    so each one follows each other one equally often. With a fixed or rotating
    order a call mostly followed the same neighbour: JAX's "ours" followed
    "packed" and paid for the memory that call had just freed back to the OS
    (donated and kept calls, the same code on JAX, differed by 15%).
    """
    for fn in fns.values():
        for _ in range(warmup):  # tracing, compilation, connections
            fn()
    times: dict = {name: [] for name in fns}
    for round_ in range(iters):
        names = list(fns)
        random.Random(round_).shuffle(names)
        for name in names:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _all_reduce_bench(backend: str, strategy, iters: int, payloads_mb: tuple = PAYLOADS_MB) -> tuple[list, dict]:
    import numpy as np

    rows = []
    for megabytes in payloads_mb:
        shapes = _payload_shapes(megabytes)
        total = sum(int(np.prod(s)) for s in shapes)
        nbytes = 4 * total
        arrays = [np.zeros(s, "float32") for s in shapes]
        times = _interleaved(
            {"ours": _ours(backend, strategy, arrays), "kept": _ours(backend, strategy, arrays, donated=False),
             "raw": _raw(backend, total), "packed": _packed(backend, arrays),
             "per_tensor": _raw_per_tensor(backend, arrays)},
            iters,
        )
        row = {"payload_mb": nbytes / 2**20, "tensors": len(shapes), "iterations": len(times["ours"])}
        for name in ("ours", "kept", "raw", "packed", "per_tensor"):
            ms = statistics.median(times[name]) * 1e3
            row[f"{name}_ms"] = ms
            row[f"{name}_p10_ms"] = float(np.percentile(times[name], 10) * 1e3)
            row[f"{name}_p90_ms"] = float(np.percentile(times[name], 90) * 1e3)
            row[f"{name}_mb_s"] = nbytes / 2**20 / (ms / 1e3)
        rows.append(row)
    # A train step's exchange carries int32 targets next to float32 values, and the
    # engines run one collective per dtype: the same ~1 MB with the 256 targets as
    # float32 (one collective) and as int32 (two).
    arrays = [np.zeros(s, "float32") for s in _payload_shapes(1)]
    times = _interleaved(
        {
            "one_dtype": _ours(backend, strategy, arrays + [np.zeros((GLOBAL_BATCH,), "float32")]),
            "two_dtypes": _ours(backend, strategy, arrays + [np.zeros((GLOBAL_BATCH,), "int32")]),
        },
        iters,
    )
    split = {f"{name}_ms": statistics.median(values) * 1e3 for name, values in times.items()}
    return rows, split


def run_job(args) -> None:
    if args.source:
        sys.path.insert(0, os.path.abspath(args.source))
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    index, addresses = _cluster()
    _limit_threads(args.backend, args.threads)
    x, y = _make_data(args.steps)

    if args.mode == "ks":
        import keras_strategies as ks

        strategy = ks.MultiWorkerMirroredStrategy()  # at program start: joins the cluster
        import keras

        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = _build_model(keras)
        joined = time.perf_counter()
        result = _fit_timed(keras, model, x, y, GLOBAL_BATCH, args.epochs)
        origin = os.path.dirname(os.path.dirname(os.path.abspath(ks.__file__)))
        setup = f"{strategy!r}, fit(batch_size={GLOBAL_BATCH}) on the full data, keras_strategies from {origin}"
        if args.breakdown:
            result["breakdown_ms"] = _breakdown(keras, model, strategy, x, y, args.backend)
        if args.allreduce_iters:
            result["allreduce"], result["dtype_split"] = _all_reduce_bench(
                args.backend, strategy, args.allreduce_iters, SMOKE_PAYLOADS_MB if args.smoke else PAYLOADS_MB
            )
    else:
        joined = time.perf_counter()
        if args.backend == "tensorflow":
            result, setup = _native_tensorflow(args, index, x, y)
        elif args.backend == "jax":
            result, setup = _native_jax(args, index, addresses, x, y)
        elif args.mode == "raw":
            result, setup = _raw_torch(args, index, addresses, x, y)
        else:
            result, setup = _native_torch(args, index, addresses, x, y)
    result.update(
        backend=args.backend, mode=args.mode, worker=index, setup=setup, threads=args.threads,
        process_s=time.perf_counter() - started, after_start_s=time.perf_counter() - joined,
        load_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)],
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------
# Parent: one 2-worker job per (backend, mode, repeat), then the tables.
# ---------------------------------------------------------------------------
def launch_job(backend: str, mode: str, args) -> dict:
    """One 2-worker job, started by the package's launcher (`python -m keras_strategies.launch`, which
    starts without importing Keras; from the `--source` snapshot when there is one)."""
    job_args = [
        "--job", "--backend", backend, "--mode", mode, "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--threads", str(args.threads), "--allreduce-iters", str(args.allreduce_iters if mode == "ks" else 0),
        "--breakdown", str(int(args.breakdown)),
    ] + (["--source", args.source] if args.source and mode == "ks" else []) + (["--smoke"] if args.smoke else [])
    command = [
        sys.executable, "-m", "keras_strategies.launch", "--workers", str(WORKERS), "--devices-per-worker", "1",
        "--backend", backend, "--timeout", str(args.timeout), os.path.abspath(__file__), *job_args,
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND=backend)
    root = os.path.abspath(args.source) if args.source else os.path.dirname(BENCH_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout + 60)
    code = proc.returncode
    out, err = io.StringIO(proc.stdout), io.StringIO(proc.stderr)
    wall = time.perf_counter() - start
    results = {}
    for line in out.getvalue().splitlines():
        head, sep, rest = line.partition("] ")
        if sep and rest.startswith(RESULT_PREFIX):
            results[head.strip("[")] = json.loads(rest[len(RESULT_PREFIX):])
    if code != 0 or "worker 0" not in results:
        tail = "\n".join(err.getvalue().strip().splitlines()[-20:])
        return {"error": f"exit {code}: {tail}", "wall_s": wall}
    result = dict(results["worker 0"])
    other = results.get("worker 1", {})
    result["worker1_median_ms"] = other.get("median_ms")
    result["worker1_breakdown_ms"] = other.get("breakdown_ms")
    result["wall_s"] = wall
    return result


def _print_table(title: str, lines: list) -> None:
    """A Markdown table after its title, set off by blank lines."""
    print()
    print(title)
    print()
    print("\n".join(lines))


def _fmt(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_parent(args) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {BACKENDS}")
    if args.quick:
        args.steps, args.epochs, args.allreduce_iters = 20, 1, 20
    if args.smoke:
        args.steps, args.epochs, args.allreduce_iters, args.repeats = 2, 1, 2, 1
    fingerprint = source_fingerprint(args.source)
    t0 = time.perf_counter()
    runs: dict = {}
    loads: list = []
    for repeat in range(args.repeats):
        for backend in backends:
            order = ("ks", "native") if repeat % 2 == 0 else ("native", "ks")
            order += ("raw",) if backend in RAW_REFERENCE else ()  # after the pair, which stays back to back
            for mode in order:
                result = launch_job(backend, mode, args)
                runs.setdefault((backend, mode), []).append(result)
                loads += result.get("load_1min", [])
                status = result.get("error") or (
                    f"{result['median_ms']:.2f} ms/step (p10 {result['p10_ms']:.2f}, p90 {result['p90_ms']:.2f}; "
                    f"worker 1 {_fmt(result['worker1_median_ms'])}), loss {result['final_loss']:.4f}, "
                    f"acc {result['final_accuracy']:.4f}, job {result['wall_s']:.1f}s"
                )
                print(f"[{time.perf_counter() - t0:6.1f}s] {backend:<10} {mode:<6} {status}", file=sys.stderr, flush=True)
                for row in result.get("allreduce", []):
                    print(f"          all-reduce {row['payload_mb']:.4f} MB: ours {row['ours_ms']:.3f} ms (p10 {row['ours_p10_ms']:.3f}), "
                          f"kept {row['kept_ms']:.3f} ms, "
                          f"raw {row['raw_ms']:.3f} ms (p10 {row['raw_p10_ms']:.3f}), packed {row['packed_ms']:.3f} ms, "
                          f"raw per tensor {row.get('per_tensor_ms', float('nan')):.3f} ms",
                          file=sys.stderr, flush=True)

    errors = []
    reference_lines = [
        "| backend | reference without Keras | its ms/step (p10) | native / it | ours / it |",
        "|---|---|---:|---:|---:|",
    ]
    step_lines = [
        "| backend | ours ms/step (p10) | native path | native ms/step (p10) | ratio ours/native | ratio of p10s "
        "| target (median ratio) |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    cycle_lines = [
        "| backend | ours cycle ms | native cycle ms | cycle ratio | ours, worker 1 ms/step | native, worker 1 ms/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    split_lines = [
        "| backend | ~1 MB float32 + 256 targets as float32 (1 collective) ms | same, targets as int32 (2 collectives) ms "
        "| extra ms |",
        "|---|---:|---:|---:|",
    ]
    reduce_lines = [
        "| backend | payload | ours ms | ours MB/s | raw engine | raw ms | raw MB/s | ratio ours/raw (rate) | target "
        "| ours, kept inputs ms (rate ratio) | packed ms (concat + raw + split) "
        "| raw, per tensor ms (ours/it, rate) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for backend in backends:
        ours_runs = [r for r in runs[(backend, "ks")] if "error" not in r]
        base_runs = [r for r in runs[(backend, "native")] if "error" not in r]
        errors += [f"{backend}/{mode}: {r['error']}" for mode in ("ks", "native")
                   for r in runs[(backend, mode)] if "error" in r]
        pairs = list(zip(runs[(backend, "ks")], runs[(backend, "native")]))
        ratios = [a["median_ms"] / b["median_ms"] for a, b in pairs if "error" not in a and "error" not in b]
        cratios = [a["cycle_median_ms"] / b["cycle_median_ms"] for a, b in pairs
                   if "error" not in a and "error" not in b and a.get("cycle_median_ms") and b.get("cycle_median_ms")]
        ratio = _median(ratios)
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        p10_ratios = [a["p10_ms"] / b["p10_ms"] for a, b in pairs if "error" not in a and "error" not in b]
        p10_spread = f" ({min(p10_ratios):.2f}-{max(p10_ratios):.2f})" if len(p10_ratios) > 1 else ""
        met = "" if ratio is None else (" met" if ratio <= STEP_TARGET else " **missed**")
        ours = _median(r["median_ms"] for r in ours_runs)
        base = _median(r["median_ms"] for r in base_runs)
        step_lines.append(
            f"| {backend} | {_fmt(ours)} ({_fmt(_median(r['p10_ms'] for r in ours_runs))}) | {NATIVE_NAMES[backend]} | "
            f"{_fmt(base)} ({_fmt(_median(r['p10_ms'] for r in base_runs))}) | {_fmt(ratio)}{spread} | "
            f"{_fmt(_median(p10_ratios))}{p10_spread} | <= {STEP_TARGET:.2f}{met} |"
        )
        cycle_lines.append(
            f"| {backend} | {_fmt(_median(r['cycle_median_ms'] for r in ours_runs))} | "
            f"{_fmt(_median(r['cycle_median_ms'] for r in base_runs))} | {_fmt(_median(cratios))} | "
            f"{_fmt(_median(r['worker1_median_ms'] for r in ours_runs))} | "
            f"{_fmt(_median(r['worker1_median_ms'] for r in base_runs))} |"
        )
        raw_runs = [r for r in runs.get((backend, "raw"), []) if "error" not in r]
        errors += [f"{backend}/raw: {r['error']}" for r in runs.get((backend, "raw"), []) if "error" in r]
        if raw_runs:
            raw = _median(r["median_ms"] for r in raw_runs)
            reference_lines.append(
                f"| {backend} | {RAW_REFERENCE[backend]} | {_fmt(raw)} ({_fmt(_median(r['p10_ms'] for r in raw_runs))}) "
                f"| {_fmt(base / raw if base else None)} | {_fmt(ours / raw if ours else None)} |"
            )
        splits = [r["dtype_split"] for r in ours_runs if r.get("dtype_split")]
        if splits:
            one = _median(x["one_dtype_ms"] for x in splits)
            two = _median(x["two_dtypes_ms"] for x in splits)
            split_lines.append(f"| {backend} | {one:.3f} | {two:.3f} | {two - one:+.3f} |")
        by_payload: dict = {}
        for r in ours_runs:
            for row in r.get("allreduce", []):
                by_payload.setdefault(round(row["payload_mb"], 4), []).append(row)
        for payload, rows in sorted(by_payload.items()):
            size = f"{payload * 1024:.1f} KB" if payload < 0.1 else f"{payload:.2f} MB"
            o_ms = _median(row["ours_ms"] for row in rows)
            r_ms = _median(row["raw_ms"] for row in rows)
            k_ms = _median(row.get("kept_ms") for row in rows)
            rate_ratios = [row["raw_ms"] / row["ours_ms"] for row in rows]
            rr = _median(rate_ratios)
            spread = f" ({min(rate_ratios):.2f}-{max(rate_ratios):.2f})" if len(rate_ratios) > 1 else ""
            target = (f">= {RATE_TARGET:.2f}" + (" met" if rr >= RATE_TARGET else " **missed**")) if payload >= 0.1 \
                else "— (latency)"
            reduce_lines.append(
                f"| {backend} | {size} in {rows[0]['tensors']} tensors | {o_ms:.3f} | {payload / o_ms * 1e3:.0f} | "
                f"{RAW_NAMES[backend]} | {r_ms:.3f} | {payload / r_ms * 1e3:.0f} | {rr:.2f}{spread} | {target} | "
                f"{_fmt(k_ms, '.3f')} ({_fmt(_median([row['raw_ms'] / row['kept_ms'] for row in rows if row.get('kept_ms')]))}) | "
                f"{_fmt(_median(row.get('packed_ms') for row in rows), '.3f')} | "
                f"{_fmt(_median(row.get('per_tensor_ms') for row in rows), '.3f')} "
                f"({_fmt(_median([row['per_tensor_ms'] / row['ours_ms'] for row in rows if row.get('per_tensor_ms')]))}) |"
            )

    breakdown_lines = [
        "| backend | train_step ms | _train (forward + backward) | _exchange (cross-worker work after the backward "
        "pass) | cross-worker sums (start + wait) | same, worker that arrived last | optimizer update | "
        "_update_metrics | one program: replicas, exchange, update, metrics | rest | sent per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for backend in backends:
        done = [r for r in runs[(backend, "ks")] if r.get("breakdown_ms")]
        if not done:
            continue
        part, other = done[-1]["breakdown_ms"], done[-1].get("worker1_breakdown_ms") or {}
        total = part["train_step"]
        share = lambda v: f"{v:.2f} ({100 * v / total:.0f}%)" if total else f"{v:.2f}"  # noqa: E731
        rest = total - sum(part[name] for name in BREAKDOWN_SECTIONS)
        mine, theirs = part.get("collective_ms", []), other.get("collective_ms", [])
        last = _median([min(a, b) for a, b in zip(mine, theirs)]) if mine and len(mine) == len(theirs) else None
        breakdown_lines.append(
            f"| {backend} | {total:.2f} | {share(part['_train'])} | {share(part['_exchange'])} | "
            f"{share(part['collective'])} | {'—' if last is None else share(last)} | {share(part['optimizer'])} | "
            f"{share(part['_update_metrics'])} | {share(part.get('step_program', 0.0))} | {share(rest)} | "
            + (f"{part['payload_kb']:.0f} KB, {part['payload_tensors']} tensors, dtypes {', '.join(part['dtypes'])} |"
               if part["payload_tensors"] else "inside the program |")
        )

    per_run = args.steps * args.epochs
    print(f"2 workers x 1 CPU device on 127.0.0.1 (keras_strategies.launcher), MLP {FEATURES}->{HIDDEN}x3->{CLASSES}, "
          f"Adam, sparse CE + accuracy, global batch {GLOBAL_BATCH} ({GLOBAL_BATCH // WORKERS} rows per worker), "
          f"median of {per_run} steps per run on worker 0 (warm-up epoch excluded), {args.repeats} run(s) per cell, "
          f"all-reduce: median of {args.allreduce_iters} iterations per run, "
          f"intra-op threads {args.threads or 'backend default'}, total {time.perf_counter() - t0:.0f}s"
          + (" (SMOKE: tiny sizes, numbers mean nothing)" if args.smoke else ""))
    print_provenance(fingerprint, args.source, loads)
    print()
    print("\n".join(step_lines))
    _print_table("Cross-checks: begin-to-begin cycle time on worker 0 (step + loop overhead), and worker 1's median "
                 "step:", cycle_lines)
    if len(reference_lines) > 2:
        _print_table("Reference: the engine's data parallelism without Keras (medians of the runs; what Keras' own "
                     "layers and optimizer cost on that backend, outside the target):", reference_lines)
    _print_table("All-reduce, ours (`strategy.extended._cross_worker_sum(tensors, donated=True)`, as the train step "
                 "sends its gradients) vs the raw engine (one pre-flattened buffer), worker 0; 'kept inputs' is the "
                 "same call with donated=False; 'raw, per tensor' is the engine given the same ten tensors as they "
                 "are (reference, no target):", reduce_lines)
    if len(split_lines) > 2:  # more than the header and separator
        _print_table("One collective per dtype: `_cross_worker_sum` of the same payload with the targets as "
                     "float32 or int32 (medians, worker 0):", split_lines)
    if len(breakdown_lines) > 2:
        _print_table("Where ks.MultiWorkerMirroredStrategy's train step spends its time on worker 0 (mean ms/step "
                     "over one more epoch, each piece timed to completion; cf. `_breakdown`):", breakdown_lines)
    if errors:
        print("\nErrors:\n" + "\n".join(errors))
    return 1 if errors else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", action="store_true", help="(internal) run as one worker of a launched job")
    parser.add_argument("--backend", choices=BACKENDS, help="job: the Keras backend")
    parser.add_argument("--mode", choices=("ks", "native", "raw"),
                        help="job: ks.MultiWorkerMirroredStrategy, native, or (torch) raw torch.nn under DDP")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="parent: comma-separated backends")
    parser.add_argument("--steps", type=int, default=50, help="global steps per epoch (default 50)")
    parser.add_argument("--epochs", type=int, default=2, help="measured epochs after the warm-up epoch (default 2)")
    parser.add_argument("--allreduce-iters", type=int, default=80,
                        help="all-reduce iterations per payload and side (default 80; 0 = skip)")
    parser.add_argument("--breakdown", type=int, default=1, choices=(0, 1),
                        help="ks jobs: afterwards, time the pieces of ks's train step over one more epoch (default 1)")
    parser.add_argument("--quick", action="store_true", help="parent: 20 steps x 1 measured epoch, 20 all-reduces")
    parser.add_argument("--smoke", action="store_true",
                        help="every code path with tiny sizes, for the test suite (numbers mean nothing): 2 steps, "
                             f"1 run, 2 all-reduces of {', '.join(f'{mb:g}' for mb in SMOKE_PAYLOADS_MB)} MB")
    parser.add_argument("--repeats", type=int, default=1, help="parent: runs per cell, alternating order (default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker process (default 1; 0 = backend default)")
    parser.add_argument("--source", default="",
                        help="directory holding the keras_strategies package to benchmark (a `git archive` snapshot)")
    parser.add_argument("--timeout", type=float, default=600.0, help="parent: seconds per job")
    args = parser.parse_args(argv)
    if args.job:
        if not args.backend or not args.mode:
            parser.error("--job needs --backend and --mode")
        run_job(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
