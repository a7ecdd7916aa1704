"""PyTorch engine: its modules (`keras_strategies/backend/contract.py`) and its capabilities."""

from keras_strategies.backend.common.capabilities import Capabilities
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

CAPABILITIES = Capabilities(
    # The step writes the model's variables itself (see `backend/common/replica_variables.py`).
    stateful_steps=True,
    # Keras' own PyTorch trainer builds a model from the first batch before `fit`; one it cannot build fails.
    defers_build=False,
    # Each `DataLoader` iterator draws its base seed from torch's global generator, even unshuffled:
    # Keras' own loops (validation, `evaluate`, `predict`) all move the order of later shuffles.
    pipeline_draws_rng=True,
    # Replicas may have different shard sizes: each runs its own shard unpadded.
    equal_shards=False,
    native_sync_batch_norm=False,
    # Autograd runs a tensor's hooks as soon as its gradient is computed.
    overlaps_backward=True,
    # `ks.function` runs a custom step as it is.
    traces_custom_steps=False,
    # Steps run eagerly and send during the backward pass.
    exchanges_in_program=False,
)
