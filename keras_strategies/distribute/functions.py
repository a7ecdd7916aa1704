"""Backend-neutral gradients and step compilation for custom training loops.

`ks.value_and_grad(loss_fn, variables)` is the one recommended way to take
gradients inside `strategy.run` on every backend (a tape cannot work on JAX,
which differentiates functions). `ks.function` compiles a distributed step
where the backend can: `tf.function` on TensorFlow; on JAX one program over
the replicas, traced over the state of the variables the step uses
(`traced_function.py`); PyTorch runs the step as it is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from keras_strategies.backend import engine
from keras_strategies.distribute.strategy import sync_new_variables_from_chief
from keras_strategies.distribute.traced_function import TracedFunction


def value_and_grad(fn: Callable[..., Any], variables: Sequence[Any], *args: Any, **kwargs: Any) -> tuple[Any, list]:
    """Calls `fn(*args, **kwargs)` and returns `(its output, gradients of it w.r.t. variables)`.

    The one way to take gradients in a custom training step on every backend
    (`tf.GradientTape` on TensorFlow, `torch.autograd` on PyTorch,
    `jax.value_and_grad` over the variables' values on JAX). On TensorFlow,
    `tf.GradientTape` keeps working too.

    `fn` returns a scalar loss, or a tuple whose first item is the loss (the
    rest is passed through). Gradients are in the order of `variables`, zeros
    for variables the loss does not depend on.

    Examples:
        >>> w = keras.Variable(3.0)
        >>> loss, grads = ks.value_and_grad(lambda: w * w, [w])
        >>> float(loss), float(grads[0])
        (9.0, 6.0)
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
    """Compiles a training step that calls `strategy.run`, where the backend can.

    `tf.function` on TensorFlow. On JAX one program over the strategy's
    devices, traced over the values of the variables the step reads and
    writes; shards of a partial batch are padded to the compiled shape with
    a row mask, and a step JAX cannot trace runs eagerly after a one-time
    warning. PyTorch runs the step as it is. Use it where TensorFlow's guides
    use `@tf.function`. Before each call, variables
    created since the last call are given the chief's values (multi-worker
    strategies), which cannot happen inside a compiled function.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        ...     optimizer = keras.optimizers.SGD(0.1)
        >>> def replica_step(x, y):
        ...     def loss_fn():
        ...         per_example = keras.losses.mean_squared_error(y, model(x))
        ...         return ks.compute_average_loss(per_example, global_batch_size=8)
        ...     loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
        >>> @ks.function
        ... def train_step(x, y):
        ...     return strategy.reduce("sum", strategy.run(replica_step, args=(x, y)), axis=None)
        >>> data = (np.ones((16, 2), "float32"), np.ones((16, 1), "float32"))
        >>> dataset = strategy.make_experimental_numpy_dataset(data).batch(8)
        >>> losses = [float(train_step(x, y)) for x, y in strategy.experimental_distribute_dataset(dataset)]
    """
    compiled = engine.compiler.compile_step(fn)
    whole = TracedFunction(fn, eager=compiled) if engine.capabilities.traces_custom_steps else compiled

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        sync_new_variables_from_chief()
        return whole(*args, **kwargs)

    step._ks_compiled = compiled  # for schedulers that take only the compiled function (TF's coordinator)
    return step
