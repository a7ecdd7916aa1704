"""A `LossScaleOptimizer` over an optimizer whose state is sharded: its dynamic scale, step by step.

Keras' `LossScaleOptimizer.apply` checks the summed gradients, applies its
inner optimizer's update only where they are all finite, and doubles or
halves its scale (`_common_apply`), in stateful `ops.cond` branches around
the whole update. Sharded, the inner optimizer's update runs in pieces on
every device, so the same rules are written as data that every compiled
part can take: each device keeps its update only where the gradients were
finite (`kept_if_finite`), and the scale and its step counter follow
`next_scale`. The scaler's own variables are built without its inner
optimizer, whose state lives in pieces (`build_own`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from keras import initializers
from keras import ops
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.utils import tracking


def scaler_and_inner(optimizer: Any) -> tuple:
    """`(the LossScaleOptimizer, its inner optimizer)`, or `(None, optimizer)` for any other."""
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer, optimizer.inner_optimizer
    return None, optimizer


def build_own(scaler: Any, variables: Sequence[Any]) -> None:
    """`LossScaleOptimizer.build` without building its inner optimizer whole: the step counter and
    the dynamic scale, as Keras makes them (the suite compares them with Keras' own build)."""
    if getattr(scaler, "dynamic_scale", None) is not None:
        return
    with tracking.DotNotTrackScope():
        scaler.step_counter = scaler.add_variable(shape=(), dtype="int", initializer=initializers.Zeros(),
                                                  aggregation="none", name="step_counter")
        scaler.dynamic_scale = scaler.add_variable(shape=(), dtype="float32",
                                                   initializer=initializers.Constant(scaler.initial_scale),
                                                   aggregation="none", name="dynamic_scale")
    super(LossScaleOptimizer, scaler).build(list(variables))
    scaler.built = True


def own_variables(scaler: Optional[Any]) -> list:
    """The scaler's own variables (iterations, learning rate, step counter, scale), in its order."""
    return [] if scaler is None else list(scaler._variables)


def kept_if_finite(finite: Any, apply: Callable[[], None], variables: Sequence[Any]) -> None:
    """Runs `apply`, then gives `variables` back their values from before it unless `finite`."""
    before = [ops.copy(v.value) for v in variables]  # (torch updates in place)
    apply()
    for variable, value in zip(variables, before):
        variable.assign(ops.where(finite, variable.value, value))


def next_scale(scaler: Any, finite: Any) -> None:
    """The scale after a step: doubled after `dynamic_growth_steps` finite steps in a row, halved
    after a step whose gradients were not finite (`LossScaleOptimizer._common_apply`)."""
    counter, scale = scaler.step_counter, scaler.dynamic_scale
    grow = ops.logical_and(finite, ops.equal(counter.value, scaler.dynamic_growth_steps - 1))
    zero = ops.zeros_like(counter.value)
    counter.assign(ops.where(ops.logical_and(finite, ops.logical_not(grow)), counter.value + 1, zero))
    scale.assign(ops.where(grow, scale.value * 2.0, ops.where(finite, scale.value, scale.value * 0.5)))


def finite_everywhere(flags: Sequence[Any], summed_across_workers: Optional[Callable[[list], list]]) -> Any:
    """Whether every flag (one per device) is true, also on every worker where they are several."""
    bad = ops.sum(ops.stack([ops.cast(ops.logical_not(f), "float32") for f in flags]))
    if summed_across_workers is not None:
        bad = summed_across_workers([bad])[0]
    return ops.equal(bad, 0.0)
