"""The JAX engine's replicas: eager replica threads, and how compiled replica programs are dispatched."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
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
