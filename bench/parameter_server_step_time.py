"""Parameter-server benchmark: `ks.ParameterServerStrategy` next to `ks.MirroredStrategy` and the raw engine.

Per backend it measures, on 127.0.0.1:

1. **fit throughput.** Steps per second of `model.fit` under
   `ks.ParameterServerStrategy` with 1 and 2 workers x 1 and 2 parameter
   servers, against the same model, data and batches under
   `ks.MirroredStrategy(["cpu:0"])` in one process, reported as the ratio
   PS / Mirrored (higher is better; no target). The model is the one of
   TensorFlow's parameter-server tutorial (its `fit` section): Dense(10) on 10
   features, SGD (learning rate 0.01), mean squared error,
   `steps_per_execution=10`, global batch 64; here on NumPy arrays of
   `steps x 64` uniform random rows, `shuffle=False`. Under the
   parameter-server strategy each worker runs whole batches of 64 (one replica
   per worker), 10 steps per scheduled closure, asynchronously; the mirrored
   strategy on one device runs the steps one after the other (on PyTorch one
   step per call: Keras' PyTorch trainer refuses `steps_per_execution` > 1).
2. **Parameter round trip.** One worker reads 16 MB of float32 variables (10
   tensors: 5 kernels (d, d) and 5 biases (d,)) held by one parameter server
   and sends an update of the same size; ours against the raw engine's own call:
   - TensorFlow: a `tf.function` scheduled on the worker that reads each
     variable and `assign_add`s a multiple of it, waited for with `.fetch()`.
     Ours: Keras variables created in `ks.ParameterServerStrategy`'s scope,
     scheduled with `ks.coordinator.ClusterCoordinator`. Raw: `tf.Variable`s
     created in the scope of TensorFlow's own
     `tf.distribute.ParameterServerStrategy` (the instance ours runs on: a
     process joins one cluster) and scheduled with
     `tf.distribute.coordinator.ClusterCoordinator`.
   - Ray (JAX, PyTorch): inside one scheduled closure on the worker. Ours:
     `optimizer.apply_gradients` with Keras SGD on the variables (the worker's
     path: the gradients split by the registry's layout and sent to the
     shard, which applies them, then the new values read back into the
     worker's variables). Raw: `ray.get(actor.apply.remote(grads))` and
     `ray.get(actor.read.remote())` on a plain Ray actor holding the same
     arrays as NumPy (SGD in place).
   Ours and raw alternate call by call, in a fresh random order each round.
   Reported: median ms per round trip, MB/s of payload each way, and the
   ratio raw ms / ours ms (our rate / raw rate; target >= 0.8).

Processes. TensorFlow: one launch of the package launcher per cluster
(`python -m keras_strategies.launch --workers 1+W --chief --ps P`); its worker
and ps tasks run this script, which serves (`ks.Server(...).join()`), and its
chief runs the measurements and prints one `BENCH-RESULT {json}` line. A
process joins one cluster, so each (workers, ps) pair is a launch of its own;
the round trip runs in the 1 x 1 one. Ray: one chief process per backend for
every cluster; it starts a local Ray runtime with the largest cluster's actors
(the ps shards and workers), and the smaller clusters reuse them.

Timing. `fit` under the parameter-server strategy gives callbacks
epoch-level logs only (batch hooks are refused), so a callback takes
`time.perf_counter()` in `on_epoch_begin` / `on_epoch_end` on both sides: an
epoch's steps per second are its steps over its wall time, which includes the
`join` at the epoch end. Epoch 0 (tracing, dataset set-up, warm-up) is
excluded; a run's value is the median over its measured epochs. Each
parameter-server run is paired with a mirrored run made right before or
after it in the same process (the order alternates between repeats); the
table shows medians over runs and the median of the pair ratios with their
range in brackets. Intra-op threads are capped at 1 in the chief
(`--threads`), as in `bench/mirrored_step_time.py`.

`--smoke` runs every code path with tiny sizes (the 1 x 1 cluster, 10 steps,
one measured epoch, one repeat, a 0.25 MB round trip of 3 iterations) in a
few seconds plus process start-up, for the test suite: its numbers mean nothing.

Usage:
    python bench/parameter_server_step_time.py                      # all backends (a few minutes each)
    python bench/parameter_server_step_time.py --backends jax --repeats 5
    python bench/parameter_server_step_time.py --configs 1x1,2x2    # workers x ps
    python bench/parameter_server_step_time.py --smoke --backends torch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from mirrored_step_time import _limit_threads, print_provenance, source_fingerprint  # noqa: E402
from multi_worker_step_time import _interleaved  # noqa: E402  (calls alternate in a fresh random order)

RESULT_PREFIX = "BENCH-RESULT "
PROGRESS_PREFIX = "bench: "  # a job's progress lines on stderr, which the parent passes on
BACKENDS = ("tensorflow", "jax", "torch")
TARGET = 0.8  # raw ms / ours ms of the parameter round trip

FEATURES = 10
UNITS = 10
GLOBAL_BATCH = 64
STEPS_PER_EXECUTION = 10
TENSORS = 10

RAW_NAMES = {
    "tensorflow": "tf.distribute.ParameterServerStrategy + ClusterCoordinator, tf.Variables",
    "jax": "ray.get of a plain Ray actor's apply + read (NumPy)",
    "torch": "ray.get of a plain Ray actor's apply + read (NumPy)",
}


def parse_configs(text: str) -> list:
    """'1x1,2x2' -> [(1, 1), (2, 2)] (workers, ps)."""
    configs = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            workers, ps = (int(n) for n in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--configs takes WORKERSxPS items such as 1x1,2x2; got {item!r}") from None
        if workers < 1 or ps < 1:
            raise SystemExit(f"--configs needs at least 1 worker and 1 ps; got {item!r}")
        configs.append((workers, ps))
    if not configs:
        raise SystemExit("--configs is empty")
    return configs


# ---------------------------------------------------------------------------
# The model, the data and the timing of fit.
# ---------------------------------------------------------------------------
def _make_data(steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = steps * GLOBAL_BATCH
    return rng.uniform(size=(rows, FEATURES)).astype("float32"), rng.uniform(size=(rows, 1)).astype("float32")


def _build_model(keras, steps_per_execution: int = STEPS_PER_EXECUTION):
    """The model of TensorFlow's parameter-server tutorial (`fit` section)."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(UNITS)])
    model.compile(keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=steps_per_execution)
    return model


def _mirrored_steps_per_execution(backend: str) -> int:
    """Keras' PyTorch trainer runs one step per call (it refuses `steps_per_execution` > 1)."""
    return 1 if backend == "torch" else STEPS_PER_EXECUTION


def _fit_run(keras, model, x, y, epochs: int) -> dict:
    """One `fit` of a warm-up epoch and `epochs` measured ones: steps per second per epoch."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.begin, self.seconds = 0.0, []

        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.begin)

    timer = EpochTimer()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1 + epochs, shuffle=False, verbose=0,
                        callbacks=[timer])
    steps = x.shape[0] // GLOBAL_BATCH
    rates = [steps / s for s in timer.seconds[1:]]
    return {"steps_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "warmup_s": timer.seconds[0], "loss": float(history.history["loss"][-1])}


# ---------------------------------------------------------------------------
# The parameter round trip.
# ---------------------------------------------------------------------------
def _payload_shapes(megabytes: float) -> list:
    """10 float32 shapes totalling ~`megabytes` MB: 5 kernels (d, d) and 5 biases (d,)."""
    floats = megabytes * 2**20 / 4
    d = int(((25 + 20 * floats) ** 0.5 - 5) / 10)  # 5 d^2 + 5 d = floats
    return [(d, d), (d,)] * (TENSORS // 2)


def _round_trip_tensorflow(keras, ks, strategy, megabytes: float, iters: int) -> dict:
    """Ours (Keras variables, ks's coordinator) and raw (tf.Variables, TF's own coordinator), on the ps."""
    import numpy as np
    import tensorflow as tf

    shapes = _payload_shapes(megabytes)
    with strategy.scope():
        ours_variables = [keras.Variable(np.ones(shape, "float32")) for shape in shapes]
    native = strategy.extended._runtime.strategy  # TensorFlow's own ParameterServerStrategy
    with native.scope():
        raw_variables = [tf.Variable(np.ones(shape, "float32")) for shape in shapes]
    devices = sorted({v.value.device for v in ours_variables} | {v.device for v in raw_variables})

    def round_trip(variables, read):
        @tf.function
        def fn():
            firsts = []
            for variable in variables:
                value = read(variable)  # ps -> worker
                variable.assign_add(value * -1e-4)  # worker -> ps
                firsts.append(tf.reshape(value, [-1])[0])
            return tf.add_n(firsts)

        return fn

    ours_fn = round_trip(ours_variables, lambda v: tf.convert_to_tensor(v.value))
    raw_fn = round_trip(raw_variables, lambda v: v.read_value())
    ours_coordinator = ks.coordinator.ClusterCoordinator(strategy)
    raw_coordinator = tf.distribute.coordinator.ClusterCoordinator(native)
    times = _interleaved({"ours": lambda: ours_coordinator.schedule(ours_fn).fetch(),
                          "raw": lambda: raw_coordinator.schedule(raw_fn).fetch()}, iters, warmup=2)
    return _round_trip_summary(times, shapes) | {"devices": devices}


class RawParameterServer:
    """The raw Ray baseline: a plain actor holding NumPy arrays, SGD in place."""

    def __init__(self, shapes: list, learning_rate: float):
        import numpy as np

        self.values = [np.ones(shape, "float32") for shape in shapes]
        self.learning_rate = learning_rate

    def apply(self, grads: list) -> None:
        for value, grad in zip(self.values, grads):
            value -= self.learning_rate * grad

    def read(self) -> list:
        return self.values


def _ray_round_trip_closure(variables: list, optimizer, raw_name: str, iters: int) -> dict:
    """Runs on the worker: ours (`optimizer.apply_gradients`) and raw (`ray.get` of a plain actor's
    apply + read), interleaved; seconds per call of each, and where ours spends its time.

    The worker actor's calls to the shards (`_call_shards`: the shard's `apply`, then its `read`)
    are timed, in this process only; the rest of ours is the worker's own work (gradients to
    NumPy, split by the layout, the values read assigned to its variables).
    """
    import keras
    import numpy as np
    import ray
    from keras.src.optimizers import base_optimizer

    raw = ray.get_actor(raw_name)
    grads_np = [np.full(tuple(v.shape), 1e-3, "float32") for v in variables]
    grads = [keras.ops.convert_to_tensor(g) for g in grads_np]
    worker = getattr(base_optimizer.BaseOptimizer.apply, "_ks_worker", [None])[0]
    calls: list = []  # per call of ours: {piece: seconds}, "total" included

    def ours():
        calls.append({})
        start = time.perf_counter()
        optimizer.apply_gradients(zip(grads, variables))
        calls[-1]["total"] = time.perf_counter() - start

    def raw_call():
        ray.get(raw.apply.remote(grads_np))
        return ray.get(raw.read.remote())

    if worker is not None and hasattr(worker, "_call_shards"):
        call_shards = worker._call_shards

        def timed(shard_calls):
            start = time.perf_counter()
            try:
                return call_shards(shard_calls)
            finally:
                if calls:
                    name = f"shard {shard_calls[0][1]}" if shard_calls else "shard (none)"
                    calls[-1][name] = calls[-1].get(name, 0.0) + time.perf_counter() - start

        worker._call_shards = timed
    try:
        times = _interleaved({"ours": ours, "raw": raw_call}, iters, warmup=2)
    finally:
        if worker is not None:
            worker.__dict__.pop("_call_shards", None)
    measured = calls[2:]  # after _interleaved's warm-up calls
    pieces = {}
    for name in sorted({name for call in measured for name in call if name != "total"}):
        pieces[name] = 1e3 * statistics.median(call.get(name, 0.0) for call in measured)
    if pieces:
        pieces["on the worker"] = 1e3 * statistics.median(
            call["total"] - sum(v for k, v in call.items() if k != "total") for call in measured)
    return {"times": times, "pieces_ms": pieces}


def _round_trip_ray(keras, ks, megabytes: float, iters: int) -> dict:
    """Ours and raw from one worker of a 1 worker x 1 ps strategy (Ray engine)."""
    import numpy as np
    import ray

    shapes = _payload_shapes(megabytes)
    strategy = _strategy(ks, keras.backend.backend(), 1, 1)
    with strategy.scope():
        variables = [keras.Variable(np.ones(shape, "float32")) for shape in shapes]
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(variables)
    name = f"ks-bench-raw-ps-{os.getpid()}"
    raw = ray.remote(RawParameterServer).options(num_cpus=0, name=name).remote(shapes, 0.01)
    try:
        ray.get(raw.read.remote())
        coordinator = ks.coordinator.ClusterCoordinator(strategy)
        measured = coordinator.schedule(_ray_round_trip_closure, args=(variables, optimizer, name, iters)).fetch()
    finally:
        ray.kill(raw)
    return _round_trip_summary(measured["times"], shapes) | {"ours_pieces_ms": measured["pieces_ms"]}


def _round_trip_summary(times: dict, shapes: list) -> dict:
    import numpy as np

    megabytes = 4 * sum(int(np.prod(s)) for s in shapes) / 2**20
    result = {"payload_mb": megabytes, "tensors": len(shapes), "iterations": len(times["ours"])}
    for name in ("ours", "raw"):
        result[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        result[f"{name}_p10_ms"] = 1e3 * float(np.percentile(times[name], 10))
        result[f"{name}_p90_ms"] = 1e3 * float(np.percentile(times[name], 90))
    return result


# ---------------------------------------------------------------------------
# Job: the chief (or, on TensorFlow, a worker / ps task that serves).
# ---------------------------------------------------------------------------
def _strategy(ks, backend: str, workers: int, ps: int):
    """TensorFlow: the launched cluster (TF_CONFIG); Ray: a cluster of `workers` x `ps` actors."""
    if backend == "tensorflow":
        return ks.ParameterServerStrategy(ks.cluster_resolver.TFConfigClusterResolver())
    # The Ray engine starts its actors itself; the addresses only name the tasks.
    spec = {"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{10 + i}" for i in range(workers)],
            "ps": [f"127.0.0.1:{20 + i}" for i in range(ps)]}
    resolver = ks.cluster_resolver.SimpleClusterResolver(ks.ClusterSpec(spec), task_type="chief", task_id=0)
    return ks.ParameterServerStrategy(resolver)


def _serve_if_a_server() -> bool:
    """On a launched `worker` or `ps` task: serve until the launcher stops the task (returns never)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    if config.get("task", {}).get("type") not in ("worker", "ps"):
        return False
    import keras_strategies as ks

    resolver = ks.cluster_resolver.TFConfigClusterResolver()
    ks.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
              protocol="grpc", start=True).join()
    return True


def run_job(args) -> None:
    if args.source:
        sys.path.insert(0, os.path.abspath(args.source))
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    _limit_threads(args.backend, args.threads)
    if _serve_if_a_server():
        return

    import keras

    import keras_strategies as ks

    configs = parse_configs(args.configs)
    if args.backend == "tensorflow":
        config = json.loads(os.environ["TF_CONFIG"])["cluster"]
        launched = (len(config.get("worker", [])), len(config.get("ps", [])))
        if configs != [launched]:
            raise SystemExit(f"this chief's cluster has {launched[0]} worker(s) x {launched[1]} ps, "
                             f"but --configs says {args.configs}")
    else:  # the largest cluster first: the smaller ones reuse its actors
        configs = sorted(configs, key=lambda c: (-c[0] * c[1], -c[0]))

    x, y = _make_data(args.steps)
    fits, round_trip = [], None
    for workers, ps in configs:
        # First the strategy: on TensorFlow it connects this process to the cluster, after which
        # variables created before live on a device that is gone.
        strategy = _strategy(ks, args.backend, workers, ps)
        keras.utils.set_random_seed(0)
        weights = _build_model(keras).get_weights()
        with strategy.scope():
            model = _build_model(keras)
        model.set_weights(weights)
        with ks.MirroredStrategy(["cpu:0"]).scope():  # the same initial weights, trained alongside
            mirrored_model = _build_model(keras, _mirrored_steps_per_execution(args.backend))
        mirrored_model.set_weights(weights)
        runs = []
        for repeat in range(args.repeats):
            order = ("ps", "mirrored") if repeat % 2 == 0 else ("mirrored", "ps")
            run = {}
            for side in order:
                run[side] = _fit_run(keras, model if side == "ps" else mirrored_model, x, y, args.epochs)
            runs.append(run)
            print(f"{PROGRESS_PREFIX}{args.backend} {workers}x{ps} repeat {repeat}: PS {run['ps']['steps_per_s']:.0f} steps/s "
                  f"(loss {run['ps']['loss']:.4f}), Mirrored {run['mirrored']['steps_per_s']:.0f} steps/s "
                  f"(loss {run['mirrored']['loss']:.4f})", file=sys.stderr, flush=True)
        fits.append({"workers": workers, "ps": ps, "setup": repr(strategy), "runs": runs})
        if (workers, ps) == (1, 1) and args.round_trip_iters and args.backend == "tensorflow":
            round_trip = [_round_trip_tensorflow(keras, ks, strategy, args.round_trip_mb, args.round_trip_iters)
                          for _ in range(args.repeats)]
    if args.round_trip_iters and args.backend != "tensorflow":
        round_trip = [_round_trip_ray(keras, ks, args.round_trip_mb, args.round_trip_iters)
                      for _ in range(args.repeats)]
    origin = os.path.dirname(os.path.dirname(os.path.abspath(ks.__file__)))
    result = {
        "backend": args.backend, "fits": fits, "round_trip": round_trip, "threads": args.threads,
        "keras_strategies": origin, "process_s": time.perf_counter() - started,
        "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()
    if args.backend == "tensorflow":
        # TensorFlow's exit handlers would wait on the cluster, which the launcher stops after this.
        os._exit(0)


# ---------------------------------------------------------------------------
# Parent: the jobs of each backend, then the table.
# ---------------------------------------------------------------------------
def _child_env(backend: str, source: str) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_STRATEGIES_CPU_DEVICES", None)
    env.pop("TF_CONFIG", None)
    root = os.path.abspath(source) if source else os.path.dirname(BENCH_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _job_args(backend: str, configs: str, args, round_trip: bool) -> list:
    return [
        os.path.abspath(__file__), "--job", "--backend", backend, "--configs", configs,
        "--steps", str(args.steps), "--epochs", str(args.epochs), "--repeats", str(args.repeats),
        "--threads", str(args.threads), "--round-trip-mb", str(args.round_trip_mb),
        "--round-trip-iters", str(args.round_trip_iters if round_trip else 0),
    ] + (["--source", args.source] if args.source else [])


def _result_of(stdout: str, stderr: str, code: int, prefix: str = "") -> dict:
    for line in stdout.splitlines():
        if line.startswith(prefix + RESULT_PREFIX):
            return json.loads(line[len(prefix + RESULT_PREFIX):])
    tail = "\n".join((stderr or "").strip().splitlines()[-20:])
    return {"error": f"exit {code}: {tail}"}


def run_backend(backend: str, configs: list, args) -> list:
    """The job results of one backend: one per cluster on TensorFlow, one for all on Ray."""
    env = _child_env(backend, args.source)
    if backend != "tensorflow":
        text = ",".join(f"{w}x{p}" for w, p in configs)
        proc = subprocess.run([sys.executable] + _job_args(backend, text, args, True), env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        for line in proc.stderr.splitlines():
            if line.startswith(PROGRESS_PREFIX):
                print("  " + line[len(PROGRESS_PREFIX):], file=sys.stderr, flush=True)
        return [_result_of(proc.stdout, proc.stderr, proc.returncode)]
    results = []
    for workers, ps in configs:
        command = [sys.executable, "-m", "keras_strategies.launch", "--workers", str(1 + workers), "--chief",
                   "--ps", str(ps), "--backend", backend, "--timeout", str(args.timeout)]
        command += _job_args(backend, f"{workers}x{ps}", args, (workers, ps) == (1, 1))
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout + 60)
        for line in proc.stderr.splitlines():
            if line.startswith("[chief 0] " + PROGRESS_PREFIX):
                print("  " + line[len("[chief 0] " + PROGRESS_PREFIX):], file=sys.stderr, flush=True)
        results.append(_result_of(proc.stdout, proc.stderr, proc.returncode, prefix="[chief 0] "))
    return results


def _fmt(value, spec=".0f") -> str:
    return "—" if value is None else format(value, spec)


def _median_range(values: list, spec: str = ".2f") -> str:
    if not values:
        return "—"
    if spec == "ratio":  # two decimals, or two significant digits below 0.1
        spec = ".2f" if min(values) >= 0.1 else ".2g"
    text = format(statistics.median(values), spec)
    return text + (f" ({format(min(values), spec)}–{format(max(values), spec)})" if len(values) > 1 else "")


def table_rows(backend: str, results: list) -> tuple:
    """Markdown rows for one backend's job results, its notes and its errors."""
    rows, trip_rows, notes, errors = [], [], [], []
    for result in results:
        if "error" in result:
            errors.append(f"{backend}: {result['error']}")
            continue
        for fit in sorted(result["fits"], key=lambda f: (f["workers"], f["ps"])):
            runs = fit["runs"]
            ours = [r["ps"]["steps_per_s"] for r in runs]
            base = [r["mirrored"]["steps_per_s"] for r in runs]
            ratios = [a / b for a, b in zip(ours, base)]
            rows.append(
                f"| {backend} | fit, {fit['workers']} worker(s) x {fit['ps']} ps: steps/s | {_median_range(ours, '.0f')} "
                f"| ks.MirroredStrategy, 1 device | {_median_range(base, '.0f')} | {_median_range(ratios, 'ratio')} | — |"
            )
        for_trip = result.get("round_trip") or []
        if for_trip:
            megabytes = for_trip[0]["payload_mb"]
            ours = [r["ours_ms"] for r in for_trip]
            raw = [r["raw_ms"] for r in for_trip]
            ratios = [r["raw_ms"] / r["ours_ms"] for r in for_trip]
            ratio = statistics.median(ratios)
            met = " met" if ratio >= TARGET else " **missed**"
            trip_rows.append(
                f"| {backend} | round trip, {megabytes:.2f} MB read + update, 1 worker x 1 ps: ms "
                f"({megabytes / statistics.median(ours) * 1e3:.0f} MB/s each way) | {_median_range(ours)} "
                f"| {RAW_NAMES[backend]} ({megabytes / statistics.median(raw) * 1e3:.0f} MB/s) | {_median_range(raw)} "
                f"| {_median_range(ratios, 'ratio')} | >= {TARGET:.2f}{met} |"
            )
            pieces = [r["ours_pieces_ms"] for r in for_trip if r.get("ours_pieces_ms")]
            if pieces:
                names = sorted({name for piece in pieces for name in piece})
                parts = {name: statistics.median(piece.get(name, 0.0) for piece in pieces) for name in names}
                notes.append(f"{backend}: ours, median {statistics.median(ours):.2f} ms per round trip: "
                             + ", ".join(f"{name} {ms:.2f} ms" for name, ms in parts.items()))
    return rows + trip_rows, notes, errors


def run_parent(args) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {BACKENDS}")
    configs = parse_configs(args.configs)
    fingerprint = source_fingerprint(args.source)
    t0 = time.perf_counter()
    rows, notes, errors, loads, seconds = [], [], [], [], {}
    for backend in backends:
        start = time.perf_counter()
        results = run_backend(backend, configs, args)
        seconds[backend] = time.perf_counter() - start
        print(f"[{time.perf_counter() - t0:6.1f}s] {backend} done in {seconds[backend]:.1f}s", file=sys.stderr,
              flush=True)
        loads += [v for r in results for v in r.get("load_1min", [])]
        backend_rows, backend_notes, backend_errors = table_rows(backend, results)
        rows += backend_rows
        notes += backend_notes
        errors += backend_errors

    print(f"Model of TensorFlow's parameter-server tutorial: Dense({UNITS}) on {FEATURES} features, SGD(0.01), MSE, "
          f"steps_per_execution={STEPS_PER_EXECUTION}, global batch {GLOBAL_BATCH}; {args.steps} steps per epoch, "
          f"warm-up epoch + {args.epochs} measured, {args.repeats} run(s) per cell (medians over runs, range in "
          f"brackets; ratio: median of same-process run pairs; fit ratio = ours / baseline steps/s, round-trip "
          f"ratio = raw ms / ours ms, both higher is better); round trip: {args.round_trip_iters} interleaved "
          f"iterations per run; intra-op threads {args.threads or 'backend default'}; "
          f"{', '.join(f'{b} {s:.0f}s' for b, s in seconds.items())}"
          + (" (SMOKE: tiny sizes, numbers mean nothing)" if args.smoke else ""))
    print_provenance(fingerprint, args.source, loads)
    print()
    print("| backend | measurement | ours | baseline | baseline value | ratio | target |")
    print("|---|---|---:|---|---:|---:|---|")
    print("\n".join(rows))
    if notes:
        print("\nWhere ours spends a round trip (medians; 'shard apply' and 'shard read': the worker's call to the "
              "shard actor and the wait for it; 'on the worker': the rest, gradients to NumPy, the split by the "
              "layout, the values read assigned to the worker's variables):\n")
        print("\n".join(notes))
    if errors:
        print("\nErrors:\n" + "\n".join(errors))
    return 1 if errors else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", action="store_true", help="(internal) run as a chief, worker or ps task")
    parser.add_argument("--backend", choices=BACKENDS, help="job: the Keras backend")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="parent: comma-separated backends")
    parser.add_argument("--configs", default="1x1,1x2,2x1,2x2",
                        help="comma-separated clusters as WORKERSxPS (default 1x1,1x2,2x1,2x2)")
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch (default 100)")
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs after the warm-up epoch (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell, alternating order (default 3)")
    parser.add_argument("--round-trip-mb", type=float, default=16.0, help="round-trip payload in MB (default 16)")
    parser.add_argument("--round-trip-iters", type=int, default=20,
                        help="round trips per side and run (default 20; 0 = skip)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of the chief (default 1; 0 = backend default)")
    parser.add_argument("--source", default="",
                        help="directory holding the keras_strategies package to benchmark (a `git archive` snapshot)")
    parser.add_argument("--timeout", type=float, default=900.0, help="parent: seconds per job")
    parser.add_argument("--smoke", action="store_true",
                        help="every code path with tiny sizes, for the test suite (numbers mean nothing)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.configs, args.steps, args.epochs, args.repeats = "1x1", 10, 1, 1
        args.round_trip_mb, args.round_trip_iters = 0.25, 3
    if args.job:
        if not args.backend:
            parser.error("--job needs --backend")
        run_job(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
