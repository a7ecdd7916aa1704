"""What N virtual CPU devices cost the backend's own data-parallel step: a bare step, no Keras.

`bench/mirrored_step_time.py` sets `ks.MirroredStrategy` on N virtual devices
against plain Keras on one device. On this kind of machine the N devices share
the same cores, so part of that ratio belongs to the backend, not to any library
on top: the cost of its own data-parallel step on N devices against its own
step on one. This script measures that cost with the same model, batch and
optimizer arithmetic as the MLP of `mirrored_step_time.py` (64 features -> 3 x
Dense(256, relu) -> Dense(10), sparse cross-entropy from logits, global batch
256, Adam 1e-3), written with the backend's own operations only:

- JAX: one `jax.jit` step on one device; on N devices a `shard_map` over a mesh
  of the N host-platform devices (each device its rows, a sum of the gradients,
  the update on every device), the shape of `ks`'s and of
  `keras.distribution.DataParallel`'s compiled step. Two sums: `psum` of the
  gradients (one tuple all-reduce, as `DataParallel`'s program has), and the
  gradients packed into one buffer and summed by one `psum` (as `ks` does on
  CPU devices: XLA's CPU runtime sums a tuple's operands one at a time).
- TensorFlow: one `tf.function` step on one device; on N devices a
  `tf.distribute.MirroredStrategy` over N logical CPU devices (`strategy.run`,
  an all-reduce of the gradients with `ReductionToOneDevice`, the update of the
  mirrored variables), the mechanism `ks` uses for CPU devices on TensorFlow.
- PyTorch has no virtual devices: `ks` runs its replicas on the one CPU device
  as one vectorised program, so plain Keras on one device is what it is set against.

Each step sends the batch from NumPy and reads the loss as a Python float, as a
`fit` step with a callback does. Each device count N runs in a process of its
own with N virtual devices, side by side with the one-device step on the first
of them (TensorFlow's collectives allow one group size per process), one
intra-op thread as `mirrored_step_time.py`'s default, in rounds whose order
alternates. The table shows the median ms/step with its range over the rounds,
the median of the per-round ratios N devices / 1 device, and the first step's
loss of both (the same: the steps compute the same thing).

Usage:
    python bench/virtual_device_cost.py                  # jax and tensorflow, 2 and 4 devices against 1
    python bench/virtual_device_cost.py --backends jax --rounds 9
    python bench/virtual_device_cost.py --smoke          # tiny sizes (the test suite's run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from child_runs import result_of, spread
from mirrored_step_time import CLASSES, FEATURES, HIDDEN, _configure_devices, _limit_threads
from mirrored_step_time import GLOBAL_BATCH as BATCH

RESULT_PREFIX = "COST-RESULT "
MEASURED = ("jax", "tensorflow")
BACKENDS = MEASURED + ("torch",)
NO_VIRTUAL_DEVICES = ("torch: no virtual devices; ks runs the replicas on the one CPU device as one "
                      "vectorised program, so plain Keras on one device is what it is set against.")


def _sizes():
    return [FEATURES, HIDDEN, HIDDEN, HIDDEN, CLASSES]


def _data(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(BATCH,)).astype("int32")
    params = [(rng.normal(size=(a, b)).astype("float32") * (2.0 / a) ** 0.5, np.zeros(b, "float32"))
              for a, b in zip(_sizes(), _sizes()[1:])]
    return x, y, params


def _timed(step, steps: int) -> float:
    """Median ms of `steps` calls of `step()` (each returns a float), after 3 warm-up calls."""
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------
def _jax_steps(devices: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

    x, y, params = _data()

    def summed_loss(p, xs, ys):
        h = xs
        for i, (w, b) in enumerate(p):
            h = h @ w + b
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.sum(jnp.take_along_axis(logp, ys[:, None], axis=1))

    def update(p, m, v, t, g):
        t = t + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        scale = jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        p = jax.tree.map(lambda p, m, v: p - 1e-3 * scale * m / (jnp.sqrt(v) + 1e-7), p, m, v)
        return p, m, v, t

    def psum(tree):
        return jax.lax.psum(tree, "replicas")

    def packed(tree):
        """The leaves as one buffer, one `psum` (as `ks` sums them on CPU devices)."""
        leaves, structure = jax.tree.flatten(tree)
        flat = jax.lax.psum(jnp.concatenate([jnp.ravel(leaf) for leaf in leaves]), "replicas")
        pieces = jnp.split(flat, np.cumsum([leaf.size for leaf in leaves])[:-1])
        return jax.tree.unflatten(structure, [piece.reshape(leaf.shape) for piece, leaf in zip(pieces, leaves)])

    def make(n, summed=psum):
        used = jax.devices()[:n]
        if n == 1:
            def body(p, m, v, t, xs, ys):
                loss, g = jax.value_and_grad(summed_loss)(p, xs, ys)
                return (*update(p, m, v, t, jax.tree.map(lambda g: g / BATCH, g)), loss / BATCH)
            fn, state_at, batch_at = jax.jit(body, donate_argnums=(0, 1, 2)), used[0], used[0]
        else:
            mesh = Mesh(np.array(used), ("replicas",))

            def replica(p, m, v, t, xs, ys):
                loss, g = jax.value_and_grad(summed_loss)(p, xs, ys)
                g, loss = summed((g, loss))
                return (*update(p, m, v, t, jax.tree.map(lambda g: g / BATCH, g)), loss / BATCH)

            spec = (P(),) * 4
            fn = jax.jit(shard_map(replica, mesh=mesh, in_specs=spec + (P("replicas"),) * 2,
                                   out_specs=spec + (P(),)), donate_argnums=(0, 1, 2))
            state_at, batch_at = NamedSharding(mesh, P()), NamedSharding(mesh, P("replicas"))
        fresh = lambda: jax.device_put(jax.tree.map(np.copy, params), state_at)  # noqa: E731
        state = [fresh(), jax.tree.map(jnp.zeros_like, fresh()), jax.tree.map(jnp.zeros_like, fresh()),
                 jax.device_put(np.float32(0), state_at)]

        def step() -> float:
            *state[:], loss = fn(*state, jax.device_put(x, batch_at), jax.device_put(y, batch_at))
            return float(loss)

        return step

    return {"1 device": make(1), "psum (a tuple all-reduce)": make(devices),
            "one buffer, one psum": make(devices, packed)}


# ---------------------------------------------------------------------------
# TensorFlow
# ---------------------------------------------------------------------------
def _tf_steps(devices: int) -> dict:
    import tensorflow as tf

    x, y, params = _data()

    def make(n):
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=(
            tf.distribute.ReductionToOneDevice())) if n > 1 else None
        with strategy.scope() if strategy else tf.device("/cpu:0"):
            p = [tf.Variable(a) for pair in params for a in pair]
            m = [tf.Variable(tf.zeros_like(a)) for a in p]
            v = [tf.Variable(tf.zeros_like(a)) for a in p]
            t = tf.Variable(0.0)

        def gradients(xs, ys):
            with tf.GradientTape() as tape:
                h = xs
                for i in range(0, len(p), 2):
                    h = tf.matmul(h, p[i]) + p[i + 1]
                    if i < len(p) - 2:
                        h = tf.nn.relu(h)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(ys, h)) / BATCH
            return loss, tape.gradient(loss, p)

        def update(grads):
            t.assign_add(1.0)
            scale = tf.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
            for var, g, mv, vv in zip(p, grads, m, v):
                mv.assign(0.9 * mv + 0.1 * g)
                vv.assign(0.999 * vv + 0.001 * g * g)
                var.assign_sub(1e-3 * scale * mv / (tf.sqrt(vv) + 1e-7))

        if strategy is None:
            @tf.function
            def fn(xs, ys):
                loss, grads = gradients(xs, ys)
                update(grads)
                return loss

            def step() -> float:
                return float(fn(tf.constant(x), tf.constant(y)))

            return step

        def replica(xs, ys):
            loss, grads = gradients(xs, ys)
            summed = tf.distribute.get_replica_context().all_reduce("SUM", [loss] + grads)
            return summed

        @tf.function
        def dfn(inputs):
            summed = strategy.run(replica, args=inputs)
            first = [strategy.experimental_local_results(s)[0] for s in summed]
            update(first[1:])
            return first[0]

        shards = lambda: strategy.experimental_distribute_values_from_function(  # noqa: E731
            lambda ctx: tuple(tf.constant(a[ctx.replica_id_in_sync_group::n]) for a in (x, y)))

        def step() -> float:
            return float(dfn(shards()))

        return step

    return {"1 device": make(1), "ReductionToOneDevice": make(devices)}


# ---------------------------------------------------------------------------
# Worker and parent
# ---------------------------------------------------------------------------
def run_worker(args) -> None:
    devices = int(args.devices)
    _limit_threads(args.backend, args.threads)
    _configure_devices(args.backend, devices, "bare")  # a baseline's devices, set before the backend starts
    steps = (_jax_steps if args.backend == "jax" else _tf_steps)(devices)
    first_loss = {label: step() for label, step in steps.items()}  # the same: the steps compute the same thing
    times: dict = {label: [] for label in steps}
    labels = list(steps)
    for r in range(args.rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            times[label].append(_timed(steps[label], args.steps))
    print(RESULT_PREFIX + json.dumps({"backend": args.backend, "devices": devices, "first_loss": first_loss,
                                         "ms": times}), flush=True)


def _spawn(args, backend: str, devices: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend, "--devices", str(devices),
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--threads", str(args.threads)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return result_of(cmd, env, RESULT_PREFIX, args.timeout, f"the {backend} worker on {devices} devices")


def table(results: list) -> str:
    lines = ["| backend | devices | gradients summed by | bare step ms | bare step on 1 device, same process "
             "| ratio | first loss (N, 1) |", "|---|---:|---|---:|---:|---:|---|"]
    for result in results:
        one = result["ms"]["1 device"]
        for label, times in result["ms"].items():
            if label == "1 device":
                continue
            ratio = spread([a / b for a, b in zip(times, one)])
            losses = f"{result['first_loss'][label]:.6f}, {result['first_loss']['1 device']:.6f}"
            lines.append(f"| {result['backend']} | {result['devices']} | {label} | {spread(times)} | {spread(one)} "
                         f"| {ratio} | {losses} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="(internal) measure one backend in this process")
    parser.add_argument("--backend", choices=MEASURED, help="worker: the backend")
    parser.add_argument("--backends", default=",".join(MEASURED), help="comma-separated backends")
    parser.add_argument("--devices", default="2,4",
                        help="parent: comma-separated device counts above 1 (default 2,4); worker: one count")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per device count and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per device count (alternating order)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0 = backend default)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every code path (numbers mean nothing)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per backend")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    if args.smoke:
        args.devices, args.steps, args.rounds = "2", 2, 2
    counts = [int(d) for d in args.devices.split(",") if d.strip() and int(d) > 1]
    print(f"Bare data-parallel step, MLP {FEATURES}->{HIDDEN}x3->{CLASSES}, batch {BATCH}, "
          f"{args.rounds} rounds of {args.steps} steps, load {os.getloadavg()[0]:.1f}\n", flush=True)
    results = [_spawn(args, b, n) for b in backends if b in MEASURED for n in counts]
    if results:
        print(table(results))
    if "torch" in backends:
        print("\n" + NO_VIRTUAL_DEVICES)
    if args.smoke:
        print("\nSMOKE run: tiny sizes, the numbers mean nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
