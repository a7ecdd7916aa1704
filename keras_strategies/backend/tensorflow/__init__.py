"""TensorFlow engine."""

from keras_strategies.backend.tensorflow import devices  # noqa: F401
from keras_strategies.backend.tensorflow import compiler  # noqa: F401
from keras_strategies.backend.tensorflow import gradients  # noqa: F401
from keras_strategies.backend.tensorflow import replicas  # noqa: F401
from keras_strategies.backend.tensorflow import optimizer  # noqa: F401

from keras_strategies.backend.tensorflow import trainer  # noqa: F401
from keras_strategies.backend.tensorflow import collectives  # noqa: F401
from keras_strategies.backend.tensorflow import keras_hooks  # noqa: F401
from keras_strategies.backend.tensorflow import nccl  # noqa: F401
from keras_strategies.backend.tensorflow import tpu  # noqa: F401
