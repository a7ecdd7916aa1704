"""The JAX engine's replicas: eager replica threads, and how compiled replica programs are dispatched."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_strategies as ks


def test_a_sum_over_replicas_inside_jax_jit_in_strategy_run_says_what_to_do():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def fn():
        return jax.jit(lambda x: ks.get_replica_context().all_reduce("sum", x))(jnp.ones(2))

    with pytest.raises(NotImplementedError, match="jax.jit"):
        strategy.run(fn)


def test_replica_programs_dispatched_back_to_back_on_cpu_devices_do_not_deadlock():
    # With XLA's default CPU threading, many programs with collectives over the same virtual
    # devices in flight at once deadlock in a rendezvous, and XLA aborts the process after 40 s;
    # `replicas.dispatch` lets one run at a time. Default XLA flags, in a process of its own.
    program = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from keras_strategies.backend.jax import replicas

        mesh = replicas.mesh_of(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])

        def body(w, x):
            rows = jax.lax.all_gather(x[0], replicas.AXIS).reshape(-1, 256)
            return w - 1e-3 * rows.T @ jnp.tanh(rows @ w) + 1e-6 * jnp.sum(jax.lax.psum(x[0] @ w, replicas.AXIS))

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(replicas.AXIS)), out_specs=P(),
                                     check_vma=False))
        w = jax.device_put(np.full((256, 256), 0.01, "float32"), NamedSharding(mesh, P()))
        x = jax.device_put(np.ones((4, 64, 256), "float32"), NamedSharding(mesh, P(replicas.AXIS)))
        for _ in range(1000):
            w = replicas.dispatch(mesh, step, w, x)
        print("ran", int(jax.block_until_ready(w).shape[0]), flush=True)
    """)
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "OMP_NUM_THREADS")}
    env.update(KERAS_BACKEND="jax", KERAS_STRATEGIES_CPU_DEVICES="4")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ran", "256"], done.stdout


def test_a_sum_of_many_arrays_travels_as_one_buffer_per_dtype_with_the_same_totals():
    # XLA's CPU runtime sums an all-reduce's operands one after the other, each a meeting of the
    # devices' threads; the arrays of each dtype go as one buffer, Python numbers as they are.
    from jax.sharding import PartitionSpec as P
    from keras_strategies.backend.jax import replicas

    mesh = replicas.mesh_of([f"cpu:{i}" for i in range(4)])

    def program(total):
        def body(rows):
            row = rows[0]
            return total([row[:3], row[3:9].reshape(2, 3), row[9], row[:2].astype("int32"),
                          row[:2].astype("float16"), 2.0])

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(replicas.AXIS), out_specs=P()))

    step = program(replicas._packed_psum)
    rows = np.arange(40, dtype="float32").reshape(4, 10)
    packed, plain = step(rows), program(lambda values: jax.lax.psum(values, replicas.AXIS))(rows)
    for a, b in zip(packed, plain):
        assert jnp.asarray(a).dtype == jnp.asarray(b).dtype and jnp.shape(a) == jnp.shape(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(packed[5]) == 8.0
    all_reduces = [line for line in step.lower(rows).compile().as_text().splitlines() if " all-reduce(" in line]
    results = sorted(line.split("=")[1].split("all-reduce(")[0].strip() for line in all_reduces)
    assert results == ["f16[2]{0}", "f32[10]{0}", "s32[2]{0}"], all_reduces  # float32: 3 + 6 + 1 values
