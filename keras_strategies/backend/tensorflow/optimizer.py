"""Keras' TensorFlow optimizer, made usable in `tf.distribute` cross-replica context.

Keras 3's TF optimizer always routes its update through
`maybe_merge_call`, which needs a replica context and fails with
`AttributeError: 'NoneType' object has no attribute 'merge_call'` in
cross-replica context. Our optimizer hook applies the (already summed)
gradients exactly there, inside a merge call, so the update (and the
gradient accumulation, the EMA overwrite and `LossScaleOptimizer`'s update)
is made directly instead of through the optimizer's own strategy.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import tensorflow as tf
from keras.src.optimizers import base_optimizer

from keras_strategies.backend.common import patches


class _DirectExtended:
    """`extended.update` for plain (non-distributed) variables: just run the update."""

    @staticmethod
    def update(var, fn, args=(), kwargs=None, group=True):
        with tf.device(var.device):
            return fn(var, *args, **(kwargs or {}))


class _DirectUpdates:
    extended = _DirectExtended()


_MERGE_CALL = patches.declare(
    "tensorflow._api.v2.__internal__.distribute.interim.maybe_merge_call",
    "Keras' TF optimizer routes its update through a merge call, which fails in cross-replica context; there "
    "the update runs directly", when="while a summed update is applied in TF's cross-replica context")


def _direct_merge_call(original: Callable) -> Callable:
    def maybe_merge_call(fn, strategy, *args, **kwargs):
        return fn(_DirectUpdates(), *args, **kwargs)

    return maybe_merge_call


def _direct_merge_calls() -> contextlib.AbstractContextManager:
    return _MERGE_CALL.applied(_direct_merge_call)


def _wrap(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not tf.distribute.in_cross_replica_context():
            return method(self, *args, **kwargs)
        with _direct_merge_calls():
            return method(self, *args, **kwargs)

    return wrapper


def _wrap_add_variable_from_reference(method: Callable) -> Callable:
    """Slot variables created in cross-replica context (an optimizer first used inside
    `strategy.run`) cannot be colocated through the optimizer's own strategy, captured when
    it was made: TensorFlow refuses to enter it there. They are placed by the reference
    variable's device instead, as Keras does on the other backends."""

    @functools.wraps(method)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        if not tf.distribute.in_cross_replica_context():
            return method(self, reference_variable, *args, **kwargs)
        with tf.device(getattr(reference_variable, "value", reference_variable).device):
            return base_optimizer.BaseOptimizer.add_variable_from_reference(self, reference_variable, *args, **kwargs)

    return add_variable_from_reference


def _wrap_overwrite_with_average(method: Callable) -> Callable:
    """`use_ema`'s overwrite of the model variables goes through the optimizer's own strategy,
    which TensorFlow refuses to enter inside another one ("Must not nest tf.distribute.Strategy
    scopes"): in cross-replica context, where our hook applies the update, assign directly."""

    @functools.wraps(method)
    def overwrite(self, trainable_variables):
        if not tf.distribute.in_cross_replica_context():
            return method(self, trainable_variables)
        for variable, average in zip(trainable_variables, self._model_variables_moving_average):
            _DirectExtended.update(getattr(variable, "value", variable), lambda a, b: a.assign(b), args=(average,))

    return overwrite


def _wrap_loss_scale_apply(method: Callable) -> Callable:
    """`LossScaleOptimizer` refuses cross-replica context ("apply() must be called in a replica
    context"), where our hook applies the summed gradients once: there its update is Keras'
    backend-neutral one (a `cond` on finite gradients), as under strategies without merge calls;
    the inner optimizer's merge calls there are the ones `install` makes direct."""

    @functools.wraps(method)
    def _tf_apply(self, grads, trainable_variables=None):
        if not tf.distribute.in_cross_replica_context():
            return method(self, grads, trainable_variables)
        return self._common_apply(grads, trainable_variables=trainable_variables)

    return _tf_apply


_WHY = "the summed update is applied in TF's cross-replica context, where Keras' merge call fails"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer.TFOptimizer"
_PATCHES = (
    *((patches.declare(f"{_TF_OPTIMIZER}.{name}", _WHY), _wrap) for name in (
        "_backend_update_step", "_apply_weight_decay", "_backend_increment_gradient_accumulators")),
    (patches.declare(f"{_TF_OPTIMIZER}._overwrite_model_variables_with_average_value",
                     "use_ema's overwrite assigns directly (TF refuses to nest the optimizer's own strategy)"),
     _wrap_overwrite_with_average),
    (patches.declare(f"{_TF_OPTIMIZER}.add_variable_from_reference",
                     "slot variables made in cross-replica context are placed by their reference variable"),
     _wrap_add_variable_from_reference),
    (patches.declare("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply",
                     "LossScaleOptimizer applies the summed gradients in cross-replica context"),
     _wrap_loss_scale_apply),
)


def install() -> None:
    """Installs the cross-replica fixes on Keras' TF optimizer (idempotent)."""
    for patch, wrap in _PATCHES:
        patch.apply(wrap)


_COMPILED = "_ks_compiled_apply"


class _Apply:
    """`optimizer.apply(grads, variables)` as an object, not a lambda: TF counts traces per code
    object, and one lambda's first traces for every optimizer added up to a warning of
    "frequent retracing"."""

    def __init__(self, optimizer, variables):
        self.optimizer, self.variables = optimizer, variables

    def __call__(self, grads):
        return self.optimizer.apply(grads, self.variables)


def apply_gradients(optimizer, grads, variables) -> None:
    """Applies `grads` to `variables` with `optimizer` (one update): Keras' `apply` in a
    `tf.function`, cached per optimizer and variable list (eagerly it costs hundreds of ops)."""
    variables = list(variables)
    if not optimizer.built:
        optimizer.build(variables)
    key = tuple(id(v) for v in variables)
    cached = getattr(optimizer, _COMPILED, None)
    if cached is None or cached[0] != key:
        cached = (key, tf.function(_Apply(optimizer, variables), autograph=False))
        object.__setattr__(optimizer, _COMPILED, cached)
    cached[1](list(grads))
