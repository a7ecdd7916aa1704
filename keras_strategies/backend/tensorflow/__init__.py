"""TensorFlow engine: its modules (`keras_strategies/backend/contract.py`) and its capabilities."""

from keras_strategies.backend.common.capabilities import Capabilities
from keras_strategies.backend.tensorflow import devices  # noqa: F401
from keras_strategies.backend.tensorflow import compiler  # noqa: F401
from keras_strategies.backend.tensorflow import gradients  # noqa: F401
from keras_strategies.backend.tensorflow import replicas  # noqa: F401
from keras_strategies.backend.tensorflow import optimizer  # noqa: F401
from keras_strategies.backend.tensorflow import trainer  # noqa: F401
from keras_strategies.backend.tensorflow import collectives  # noqa: F401
from keras_strategies.backend.tensorflow import keras_hooks  # noqa: F401
from keras_strategies.backend.tensorflow import nccl  # noqa: F401
from keras_strategies.backend.tensorflow import parameter_server  # noqa: F401
from keras_strategies.backend.tensorflow import tpu  # noqa: F401

CAPABILITIES = Capabilities(
    # The step writes the model's variables itself (see `backend/common/replica_variables.py`).
    stateful_steps=True,
    # Keras' own TensorFlow trainer builds a model when its step is first traced, not before `fit`.
    defers_build=True,
    # An unshuffled `tf.data` pipeline draws from no global generator.
    pipeline_draws_rng=False,
    # tf.distribute accepts per-replica values of different shapes.
    equal_shards=False,
    # Keras synchronises BatchNormalization natively only on TensorFlow.
    native_sync_batch_norm=True,
    # The tape's gradient is one graph call (a cross-worker sum overlapping it would have to be in it).
    overlaps_backward=False,
    # `compiler.compile_step` compiles a custom step as a whole (`tf.function`).
    traces_custom_steps=False,
    # TF's collectives are ops of a `tf.function` (`CollectiveReduceV2`).
    exchanges_in_program=True,
    # Ops of a `tf.function` run on the device of their `tf.device` scope.
    programs_span_devices=True,
)
