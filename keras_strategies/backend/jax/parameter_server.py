"""ParameterServerStrategy's engine on JAX: Ray actors hold the variables and run the closures.

The runtime is backend-neutral (`backend/common/ray_parameter_server`); this
module gives it the engine interface every backend's `parameter_server` has,
and `TENSOR_OPS`, the JAX ways of a shard's updates and reads.
"""

from typing import Any

import numpy as np

from keras_strategies.backend.common.ray_parameter_server import (  # noqa: F401
    connect,
    current_worker_index,
    serve,
)
from keras_strategies.backend.common.ray_parameter_server.tensors import TensorOps


class _JaxTensorOps(TensorOps):
    """A shard's optimizer step compiled once (eager JAX makes a new array per operation), updating the
    variables' buffers in place (donated). Reads are views: JAX refuses to donate a buffer that a NumPy
    view still holds (it writes new buffers then), so a value Ray is still serializing never changes.
    """

    def gradients(self, keras: Any, arrays: list) -> list:
        import jax

        # On CPU `device_put` aliases an aligned NumPy buffer (Ray's are) instead of copying it; the step
        # only reads its gradients.
        return [jax.device_put(a) for a in arrays]

    def assign(self, keras: Any, variable: Any, array: np.ndarray) -> None:
        import jax

        if array.dtype == np.dtype(variable.dtype):  # aliased, as the gradients: JAX never writes into it
            variable.assign(jax.device_put(array))
        else:
            variable.assign(array)

    def apply(self, keras: Any, optimizer: Any, grads: list, variables: list) -> None:
        trainable = optimizer._trainable_variables
        if len(variables) != len(trainable) or any(a is not b for a, b in zip(variables, trainable)):
            optimizer.apply(grads, variables)  # a subset: the eager path
            return
        step = optimizer.__dict__.get("_ks_compiled_apply")
        if step is None:
            import jax

            step = (jax.jit(optimizer.stateless_apply, donate_argnums=(0, 2)), jax.jit(optimizer.stateless_apply))
            optimizer.__dict__["_ks_compiled_apply"] = step
        slots = optimizer.variables
        slot_values, values = [v.value for v in slots], [v.value for v in variables]
        # A buffer can be donated once per call: variables sharing one array take the copying step.
        unique = len({id(x) for x in slot_values + values}) == len(slot_values) + len(values)
        new_values, new_slots = step[0 if unique else 1](slot_values, grads, values)
        for variable, value in zip(variables, new_values):
            variable.assign(value)
        for variable, value in zip(slots, new_slots):
            variable.assign(value)

    def view(self, keras: Any, value: Any) -> np.ndarray:
        import jax

        if isinstance(value, keras.Variable):
            value = value.value
        if isinstance(value, jax.Array):
            return np.asarray(value)  # no copy on CPU (Keras' `convert_to_numpy` copies)
        return super().view(keras, value)

    def snapshot(self, keras: Any, value: Any, buffers: list) -> np.ndarray:
        return self.view(keras, value)


TENSOR_OPS = _JaxTensorOps()
