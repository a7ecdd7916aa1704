"""PyTorch engine."""

from keras_strategies.backend.torch import devices  # noqa: F401
from keras_strategies.backend.torch import compiler  # noqa: F401
from keras_strategies.backend.torch import gradients  # noqa: F401
from keras_strategies.backend.torch import replicas  # noqa: F401
from keras_strategies.backend.torch import optimizer  # noqa: F401
from keras_strategies.backend.torch import trainer  # noqa: F401
from keras_strategies.backend.torch import collectives  # noqa: F401
from keras_strategies.backend.torch import keras_hooks  # noqa: F401
from keras_strategies.backend.torch import nccl  # noqa: F401
from keras_strategies.backend.torch import parameter_server  # noqa: F401
from keras_strategies.backend.torch import tpu  # noqa: F401
