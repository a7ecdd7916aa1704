"""Optimizer updates under a multi-replica strategy, from replica context.

Called inside `strategy.run` (a custom loop, or a custom `train_step`),
`optimizer.apply(grads, vars)` / `apply_gradients(grads_and_vars)` sum the
gradients across replicas, then apply ONE update in cross-replica context, so
clipping (`clipnorm`, `clipvalue`, `global_clipnorm`) acts on the summed
gradient, as in tf-keras. `apply_gradients(..., skip_gradients_aggregation=True)`
is for users who all-reduce themselves. Outside strategy scopes, and for the
update that `fit` performs itself, Keras' code runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

from keras import ops
from keras.src import backend as keras_backend

from keras_strategies.distribute import context
from keras_strategies.backend import engine
from keras_strategies.backend.common import patches
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.sharding import optimizer_state

_state = threading.local()


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def direct_update() -> contextlib.AbstractContextManager:
    """Applies an update as Keras would, without the hook (used by `fit`, which reduces itself)."""
    return _flag("direct")


def _wrap_apply(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if getattr(_state, "direct", False) or not context.has_strategy():
            return original(self, grads, trainable_variables)
        strategy = context.get_strategy()
        replica_context = context.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "`apply_gradients()` cannot be called in cross-replica context. Call it inside "
                "`strategy.run(fn)`, where each replica passes its own gradients; they are summed "
                "across replicas and applied once."
            )

        def update(current, summed=None):
            if not self.built and trainable_variables is not None and not optimizer_state.shards_state(self):
                # Built at the first update, which may be traced inside a compiled step: its
                # variables are created outside the trace, as tf-keras creates its slots. (One whose
                # strategy shards its state is built in pieces by the update, never whole.)
                with engine.compiler.outside_compiled(), keras_backend.name_scope(self.name, caller=self):
                    self.build(list(trainable_variables))
                self.built = True
            with direct_update():
                if trainable_variables is None:
                    return original(self, grads if summed is None else summed, trainable_variables)
                return current.extended._apply_update(self, grads if summed is None else summed,
                                                      list(trainable_variables))

        if strategy.num_replicas_in_sync == 1:
            # The engine's update too: on JAX a stateful `LossScaleOptimizer` cannot run eagerly.
            return update(strategy)
        if strategy.extended._sums_gradients_in_update and trainable_variables is not None \
                and not getattr(_state, "skip_aggregation", False):
            # Each replica's own (weighted) gradients: the strategy sums them in its update.
            return replica_context.merge_call(update, args=(_weighted(replica_context, list(grads)),))
        grads = _aggregate(replica_context, grads)
        return replica_context.merge_call(update)

    return apply


def _aggregate(replica_context: Any, grads: Any) -> list:
    """Sums gradients over replicas, each weighted by its share of the batch when known."""
    grads = list(grads)
    if getattr(_state, "skip_aggregation", False):
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    local = [g for g in _weighted(replica_context, grads) if g is not None]
    # Not `replica_context.all_reduce`: nothing differentiates this sum, so it needs no gradient rule.
    summed = replica_context.strategy.extended._all_reduce(replica_context, ReduceOp.SUM, local)
    for i, g in zip(present, summed):
        grads[i] = g
    return grads


def _weighted(replica_context: Any, grads: list) -> list:
    """A replica's gradients, each weighted by its share of the batch when known (keeps IndexedSlices)."""
    weight = replica_context._gradient_weight
    return [g if g is None or weight is None else ops.multiply(g, weight) for g in grads]


def _wrap_stateless_apply(original: Callable) -> Callable:
    @functools.wraps(original)
    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        replica_context = context.get_replica_context()
        if (
            getattr(_state, "direct", False)
            or not context.has_strategy()
            or replica_context is None
            or context.get_strategy().num_replicas_in_sync == 1
        ):
            return original(self, optimizer_variables, grads, trainable_variables)
        # Every replica applies the same summed gradients to the same state: no merge needed.
        with direct_update():
            return original(self, optimizer_variables, _aggregate(replica_context, grads), trainable_variables)

    return stateless_apply


def _wrap_apply_gradients(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, skip_gradients_aggregation=False, experimental_aggregate_gradients=True, **kwargs):
        skip = skip_gradients_aggregation or not experimental_aggregate_gradients
        with _flag("skip_aggregation") if skip else contextlib.nullcontext():
            return original(self, grads_and_vars, **kwargs)

    return apply_gradients


_BASE, _LSO = "keras.src.optimizers.base_optimizer.BaseOptimizer", "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
_APPLY = {cls: patches.declare(f"{cls}.apply", "called in a replica, sums the gradients across replicas and applies one "
                                "update (clipping after the sum)") for cls in (_BASE, _LSO)}
_STATELESS_APPLY = {cls: patches.declare(f"{cls}.stateless_apply", "called in a replica, applies the gradients summed "
                                          "across replicas") for cls in (_BASE, _LSO)}
_APPLY_GRADIENTS = patches.declare(f"{_BASE}.apply_gradients", "tf.keras' `skip_gradients_aggregation` and "
                                   "`experimental_aggregate_gradients` arguments")


def install() -> None:
    """Installs the optimizer hooks (idempotent)."""
    for cls in (_BASE, _LSO):
        _APPLY[cls].apply(_wrap_apply)
        _STATELESS_APPLY[cls].apply(_wrap_stateless_apply)
    _APPLY_GRADIENTS.apply(_wrap_apply_gradients)
