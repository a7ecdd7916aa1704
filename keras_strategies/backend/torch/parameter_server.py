"""ParameterServerStrategy's engine on PyTorch: Ray actors hold the variables and run the closures.

The runtime is backend-neutral (`backend/common/ray_parameter_server`); this
module gives it the engine interface every backend's `parameter_server` has.
"""

from keras_strategies.backend.common.ray_parameter_server import (  # noqa: F401
    connect,
    current_worker_index,
    serve,
)
