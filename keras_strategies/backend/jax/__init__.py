"""JAX engine: its modules (`keras_strategies/backend/contract.py`) and its capabilities."""

import jax

from keras_strategies.backend.common.capabilities import Capabilities
from keras_strategies.backend.jax import devices  # noqa: F401
from keras_strategies.backend.jax import compiler  # noqa: F401
from keras_strategies.backend.jax import gradients  # noqa: F401
from keras_strategies.backend.jax import replicas  # noqa: F401
from keras_strategies.backend.jax import optimizer  # noqa: F401
from keras_strategies.backend.jax import trainer  # noqa: F401
from keras_strategies.backend.jax import collectives  # noqa: F401
from keras_strategies.backend.jax import keras_hooks  # noqa: F401
from keras_strategies.backend.jax import nccl  # noqa: F401
from keras_strategies.backend.jax import parameter_server  # noqa: F401
from keras_strategies.backend.jax import tpu  # noqa: F401

CAPABILITIES = Capabilities(
    # Keras' JAX steps return new state (`trainer.step_state` gives it), combined across replicas.
    stateful_steps=False,
    # Keras' own JAX trainer builds a model from the first batch before `fit`; one it cannot build fails.
    defers_build=False,
    # Keras' own JAX trainer reads NumPy batches, which draw from no global generator unless shuffled.
    pipeline_draws_rng=False,
    # A compiled program over the replicas takes one shard shape: uneven shards are padded and masked.
    equal_shards=True,
    native_sync_batch_norm=False,
    # JAX computes all gradients in one program (a cross-worker sum overlapping it would have to be in it).
    overlaps_backward=False,
    # `ks.function` traces a custom step over its variables' state (`compiler.custom_step_program`).
    traces_custom_steps=True,
    # Cross-worker sums run between programs (gloo through `jax.distributed`).
    exchanges_in_program=False,
    # A variable's value is a `jax.Array`, which nothing writes in place.
    immutable_values=True,
    # What tracing a model's own step raises when JAX cannot compile it: a Python decision on a
    # traced value, or a `merge_call`.
    untraceable_errors=(jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                        jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError,
                        NotImplementedError),
)
