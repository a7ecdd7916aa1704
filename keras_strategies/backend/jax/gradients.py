"""JAX gradients: `jax.value_and_grad` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable

import jax


def value_and_grad(fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`."""
    return jax.value_and_grad(fn, has_aux=True)


def variables_value_and_grad(fn: Callable[..., Any], variables: list, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """`(fn(*args, **kwargs), d fn / d variables)` for Keras variables.

    JAX differentiates functions of arrays, so `fn` runs with the variables
    mapped to traced values (Keras' `StatelessScope`); other variables that it
    assigns (e.g. BatchNormalization statistics) are updated afterwards.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

    class RecordingScope(StatelessScope):
        """Records assigned variables; unmapped lookups go to the enclosing scope."""

        def add_update(self, update):
            super().add_update(update)
            self.assigned[id(update[0])] = update[0]

        def get_current_value(self, variable):
            value = super().get_current_value(variable)
            return self.parent.get_current_value(variable) if value is None and self.parent is not None else value

    differentiated = {id(v) for v in variables}

    def pure(values):
        parent = get_stateless_scope()
        with RecordingScope(state_mapping=list(zip(variables, values))) as scope:
            scope.assigned, scope.parent = {}, parent
            output = fn(*args, **kwargs)
        value = output[0] if isinstance(output, tuple) else output
        updates = [(v, scope.get_current_value(v)) for k, v in scope.assigned.items() if k not in differentiated]
        return value, (output, updates)

    (_, (output, updates)), grads = jax.value_and_grad(pure, has_aux=True)([v.value for v in variables])
    for variable, new_value in updates:
        variable.assign(new_value)
    return output, grads
