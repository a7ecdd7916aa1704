"""JAX optimizer updates: Keras' `stateless_apply`, jitted, as Keras' own JAX trainer does.

Stateful `optimizer.apply` cannot run eagerly on JAX for optimizers whose
update branches with `ops.cond` (e.g. `LossScaleOptimizer`), and a compiled
update is much faster than op-by-op dispatch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from keras_strategies.backend.jax import flat_buffers, gradients

_JITTED = "_ks_jitted_stateless_apply"  # {layout of packed gradients, or None: -> jitted update}


def apply_gradients(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """Applies `grads` to `variables` with `optimizer` (one update)."""
    _apply(optimizer, None, grads, variables)


def apply_exchanged_gradients(optimizer: Any, exchanged: Sequence[Any], variables: Sequence[Any]) -> None:
    """Applies gradients as `gradients.pack_for_exchange` sent them across workers: flat buffers are
    cut back into gradients inside the jitted update, without copies."""
    if not gradients.packs_for_exchange(variables):
        return _apply(optimizer, None, exchanged, variables)
    layout = flat_buffers.layout_of(variables)
    expected = [(dtype, sum(int(np.prod(shape, dtype=np.int64)) for d, shape, _ in layout if d == dtype))
                for dtype in dict.fromkeys(d for d, _, _ in layout)]
    got = [(jnp.dtype(b.dtype).name, int(b.size)) for b in exchanged]
    if got != expected:
        raise RuntimeError(f"Packed gradients {got} do not match the variables' layout {expected}.")
    _apply(optimizer, layout, exchanged, variables)


def _update(optimizer: Any, layout: Any) -> Callable:
    """The jitted `stateless_apply` of `optimizer`, taking gradients packed with `layout` (or as they are)."""
    updates = getattr(optimizer, _JITTED, None)
    if updates is None:
        updates = {}
        object.__setattr__(optimizer, _JITTED, updates)
    if layout not in updates:
        if layout is None:
            updates[layout] = jax.jit(optimizer.stateless_apply)
        else:
            updates[layout] = jax.jit(lambda optimizer_values, buffers, values: optimizer.stateless_apply(
                optimizer_values, flat_buffers.unpack(buffers, layout), values))
    return updates[layout]


def _apply(optimizer: Any, layout: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    if not optimizer.built:
        optimizer.build(variables)
    new_variables, new_optimizer_variables = _update(optimizer, layout)(
        [v.value for v in optimizer.variables], list(grads), [v.value for v in variables]
    )
    for variable, value in zip(variables, new_variables):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer_variables):
        variable.assign(value)
