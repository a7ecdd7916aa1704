"""JAX optimizer updates: Keras' `stateless_apply`, jitted, as Keras' own JAX trainer does.

Stateful `optimizer.apply` cannot run eagerly on JAX for optimizers whose
update branches with `ops.cond` (e.g. `LossScaleOptimizer`), and a compiled
update is much faster than op-by-op dispatch.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

_JITTED = "_ks_jitted_stateless_apply"


def apply_gradients(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """Applies `grads` to `variables` with `optimizer` (one update)."""
    if not optimizer.built:
        optimizer.build(variables)
    update = getattr(optimizer, _JITTED, None)
    if update is None:
        update = jax.jit(optimizer.stateless_apply)
        object.__setattr__(optimizer, _JITTED, update)
    new_variables, new_optimizer_variables = update(
        [v.value for v in optimizer.variables], list(grads), [v.value for v in variables]
    )
    for variable, value in zip(variables, new_variables):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer_variables):
        variable.assign(value)
