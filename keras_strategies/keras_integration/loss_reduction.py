"""Keras loss reductions inside our replica programs, so that replicas sum to the global loss.

A replica step weights each replica's loss by its share of the global batch,
`rows_i / B` (`trainer/replica_step.py`), which is exact for Keras' default
mean reduction. Two hooks on `keras.src.losses.loss` make every reduction
exact, per loss, also in models mixing reductions:

- `reduce_values`: a `"sum"` loss is divided by the share (replicas add up
  to the global sum), and `"mean_with_sample_weight"` divides by the sample
  weights summed over all replicas (and workers), not by the replica's own.
- `reduce_weighted_values`: a shard's padding rows (equal shard shapes on JAX,
  one placeholder row for a replica without data) reach Keras as the row
  mask passed as sample weight. Keras fits a sample weight to the loss values
  by rank (`squeeze_or_expand_to_same_rank`), which suits `(rows,)` values
  but fails on per-timestep or per-pixel values `(rows, steps, ...)`, or
  broadcasts along the wrong axis when a dimension equals the row count. The
  mask is spread over the values' full shape first, and a
  `"mean_with_sample_weight"` loss divides by the element count as Keras does
  without sample weights. A loss of outputs carrying a Keras mask, which Keras
  divides by the batch's unmasked entries, is divided by those of the global
  batch (summed over replicas and workers), padding rows excluded. A loss that
  returns one value for the whole shard is noted on the replica context: no
  weight can leave padding rows out of it.

Outside our replica programs (no `_loss_share` on the replica context) Keras'
functions run unchanged; in a custom step compiled with padded shards
(`distribute/traced_function.py`) a loss reduced over the rows is noted, so
that the step runs its uneven batches eagerly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from keras import ops
from keras.src.losses import loss as keras_loss

from keras_strategies.backend.common import patches
from keras_strategies.distribute import context, traced_function
from keras_strategies.keras_integration.row_mask import spread_rows

def enter_replica_loss(share: Any, row_mask: Any, sample_weight: Any) -> Any:
    """Sets this replica's share of the global batch; returns the sample weight for its loss.

    Without user weights and with padding rows, that is the row mask (marked
    so the hook can spread it).
    """
    replica_context = context.get_replica_context()
    replica_context._loss_share = share
    if sample_weight is None and row_mask is not None:
        replica_context._padding_weight = sample_weight = row_mask
    return sample_weight


def _replica_context() -> Optional[Any]:
    replica_context = context.get_replica_context()
    if replica_context is None or getattr(replica_context, "_loss_share", None) is None:
        return None
    return replica_context


def _element_count(tensor: Any) -> Any:
    return ops.prod(ops.convert_to_tensor(ops.shape(tensor), "int32"))


def _masked_mean(original: Callable, replica_context: Any, values: Any, sample_weight: Any, mask: Any,
                 padding: bool, dtype: Any) -> Any:
    """Keras' mean of masked values (`apply_mask`), divided by the valid entries of the global batch.

    Keras scales the mask by `entries / valid` of the batch it sees; per replica
    that would be the replica's own valid count. Here the replica's masked sum
    (its share handled by `reduce_values`) is divided by the valid entries of
    every replica (and worker), times Keras' `mask entries / value entries`.
    """
    valid_mask = ops.cast(mask, values.dtype)
    if replica_context._row_mask is not None:  # padding rows hold no valid entries, masked or not
        valid_mask = valid_mask * spread_rows(replica_context._row_mask, valid_mask)
    if padding or sample_weight is None:  # the row weights are in the mask now
        weights = valid_mask
    else:
        valid_mask_like, weights = keras_loss.squeeze_or_expand_to_same_rank(valid_mask, ops.cast(sample_weight, values.dtype))
        weights = weights * valid_mask_like
    valid = ops.stop_gradient(ops.sum(valid_mask))
    total_valid = replica_context.strategy.extended._synchronized_sum(replica_context, valid)
    ratio = ops.cast(_element_count(valid_mask), values.dtype) / ops.cast(_element_count(values), values.dtype)
    summed = original(values, sample_weight=weights, mask=None, reduction="sum", dtype=dtype)
    return ops.divide_no_nan(summed * ratio, total_valid)


def _wrap_weighted(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_weighted_values(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
        replica_context = _replica_context()
        if replica_context is None:
            if reduction not in (None, "none"):
                traced_function.note_rows_enter("a Keras loss reduces the shard's rows itself")
            return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)
        values = ops.convert_to_tensor(values, dtype=dtype)
        padding = sample_weight is not None and sample_weight is replica_context._padding_weight
        if len(values.shape) == 0:
            # One value for the whole shard: padding rows cannot be left out of it, so Keras' steps
            # run such a model on shards of their own sizes (`trainer/replica_step.py`).
            replica_context._scalar_loss = True
            if padding:  # spread over the rows, the mask would also scale the loss by the share of real rows
                return original(values, sample_weight=None, mask=mask, reduction=reduction, dtype=dtype)
        if padding:
            sample_weight = spread_rows(sample_weight, values)
            if reduction == "mean_with_sample_weight" and mask is None:
                # Keras divides by the element count when there are no sample weights.
                reduction = "sum_over_batch_size"
        if mask is not None and reduction in ("mean", "sum_over_batch_size"):
            return _masked_mean(original, replica_context, values, sample_weight, mask, padding, dtype)
        return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)

    return reduce_weighted_values


def _wrap_values(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = original(values, sample_weight, reduction)
        replica_context = _replica_context()
        if replica_context is None or reduction in (None, "none") or tuple(values.shape) in ((), (0,)):
            return loss
        share = ops.cast(replica_context._loss_share, loss.dtype)
        if reduction == "sum":  # a replica without rows has share 0 and a loss of 0
            return ops.divide_no_nan(loss, share)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            local = ops.stop_gradient(ops.cast(ops.sum(sample_weight), loss.dtype))
            total = replica_context.strategy.extended._synchronized_sum(replica_context, local)
            return ops.divide_no_nan(ops.divide_no_nan(ops.sum(values), total), share)
        return loss

    return reduce_values


_WHY = "every loss reduction sums over replicas to the global batch's loss, padding rows excluded"
_VALUES = patches.declare("keras.src.losses.loss.reduce_values", _WHY)
_WEIGHTED = patches.declare("keras.src.losses.loss.reduce_weighted_values", _WHY)


def install() -> None:
    """Installs the hooks (idempotent)."""
    _VALUES.apply(_wrap_values)
    _WEIGHTED.apply(_wrap_weighted)
