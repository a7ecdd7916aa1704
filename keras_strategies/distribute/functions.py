"""Backend-neutral gradients and step compilation for custom training loops.

`ks.value_and_grad(loss_fn, variables)` is the one recommended way to take
gradients inside `strategy.run` on every backend (a tape cannot work on JAX,
which differentiates functions). `ks.function` compiles a distributed step
where the backend can: `tf.function` on TensorFlow; JAX and PyTorch run the
step eagerly (Keras variables are stateful, which `jax.jit` cannot trace).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from keras_strategies.backend import engine
from keras_strategies.distribute.strategy import sync_new_variables_from_chief


def value_and_grad(fn: Callable[..., Any], variables: Sequence[Any], *args: Any, **kwargs: Any) -> tuple[Any, list]:
    """Calls `fn(*args, **kwargs)` and returns `(its output, gradients of it w.r.t. variables)`.

    `fn` returns a scalar loss, or a tuple whose first item is the loss (the
    rest is passed through). Gradients are in the order of `variables`, zeros
    for variables the loss does not depend on.
    """
    variables = list(variables)
    if not variables:
        raise ValueError(
            "value_and_grad needs at least one variable, e.g. model.trainable_variables. A model "
            "has none until it is built: call it once on a batch (or `model.build(input_shape)`) "
            "before listing its variables."
        )
    return engine.gradients.variables_value_and_grad(fn, variables, args, kwargs)


def function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Compiles a training step that calls `strategy.run` (see the module docstring).

    Before each call, variables created since the last call are given the
    chief's values (multi-worker strategies), which cannot happen inside a
    compiled function.
    """
    compiled = engine.compiler.compile_step(fn)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        sync_new_variables_from_chief()
        return compiled(*args, **kwargs)

    return step
