"""Loss scaling helpers with `tf.nn.compute_average_loss` semantics, on every backend.

Each replica divides the *sum* of its per-example losses by the global batch
size, so that summing gradients across replicas gives the mean gradient of
the global batch.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from keras import ops

from keras_strategies.distribute import context
from keras_strategies.keras_integration.row_mask import spread_rows


def _check_replica_context(name: str) -> None:
    if context.has_strategy() and context.in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{name}` in cross replica context, while it was expected to "
            "be called in replica context. Call it inside `strategy.run(fn)`"
            + (", or pass `global_batch_size`." if name == "compute_average_loss" else ".")
        )


def _as_float_tensor(value: Any):
    tensor = ops.convert_to_tensor(value)
    if "float" not in str(tensor.dtype):
        tensor = ops.cast(tensor, "float32")
    return tensor


def _match_weight_rank(losses, weights):
    """TF's squeeze-or-expand rule, so `(B, 1)` weights apply to `(B,)` losses and back."""
    loss_rank, weight_rank = len(losses.shape), len(weights.shape)
    if weight_rank - loss_rank == 1 and weights.shape[-1] == 1:
        weights = ops.squeeze(weights, axis=-1)
    elif loss_rank - weight_rank == 1:
        weights = ops.expand_dims(weights, axis=-1)
    try:  # static shapes only: a traced unknown dimension is left to the backend
        np.broadcast_shapes(*(tuple(1 if d is None else d for d in t.shape) for t in (losses, weights)))
    except ValueError:
        raise ValueError(
            f"sample_weight of shape {tuple(weights.shape)} does not match per_example_loss of shape "
            f"{tuple(losses.shape)}: give one weight per example (or a scalar)."
        ) from None
    return weights


def _check_global_batch_size(global_batch_size: Any) -> None:
    if isinstance(global_batch_size, (bool, np.bool_)):
        raise TypeError(f"global_batch_size must be an integer, got {global_batch_size!r}.")
    if isinstance(global_batch_size, (int, np.integer)):
        value = int(global_batch_size)
    else:
        dtype = str(getattr(global_batch_size, "dtype", type(global_batch_size).__name__))
        if "int" not in dtype:
            raise TypeError(
                f"global_batch_size must be an integer, got {global_batch_size!r} ({dtype})."
            )
        if len(getattr(global_batch_size, "shape", ())) != 0:
            raise ValueError(
                f"global_batch_size must be scalar, got shape {tuple(global_batch_size.shape)}."
            )
        try:
            value = int(ops.convert_to_numpy(global_batch_size))
        except Exception:  # a symbolic value inside a compiled function: checked at run time
            return
    if value < 0:
        raise ValueError(f"global_batch_size must be non-negative, got {value}.")


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Optional[Any] = None,
    global_batch_size: Optional[Any] = None,
):
    """`sum(per_example_loss * sample_weight) / global_batch_size`, 0 when the divisor is 0.

    As `tf.nn.compute_average_loss`: each replica divides its loss by the
    global batch size, so that summing the replicas' gradients gives the
    gradient of the mean loss over the global batch.

    Without `global_batch_size` the divisor is the local batch size times
    `num_replicas_in_sync`, as in TensorFlow; that is exact only when every
    replica has the same number of examples, so pass `global_batch_size` when
    batches can be uneven. All elements are summed, including non-batch axes.

    Args:
        per_example_loss: Losses of this replica's examples (rank >= 1).
        sample_weight: Optional weights, one per example or a scalar.
        global_batch_size: The number of examples of the step over all replicas.

    Raises:
        ValueError: `per_example_loss` is a scalar, or `global_batch_size` is negative.
        TypeError: `global_batch_size` is not an integer.
        RuntimeError: no `global_batch_size` and called in cross-replica context.

    Examples:
        >>> per_example_loss = keras.ops.convert_to_tensor([1.0, 2.0, 3.0, 4.0])
        >>> float(ks.compute_average_loss(per_example_loss, global_batch_size=8))
        1.25
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> per_replica = strategy.run(lambda: ks.compute_average_loss(keras.ops.ones((4,))))  # / (4 x 2)
        >>> float(strategy.reduce("sum", per_replica, axis=None))
        1.0
    """
    losses = ops.convert_to_tensor(per_example_loss)
    input_dtype = losses.dtype if "float" in str(losses.dtype) else "float32"
    if len(losses.shape) == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least "
            f"rank 1. Received per_example_loss={per_example_loss} with rank 0."
        )
    if sample_weight is not None:
        losses = ops.cast(losses, "float32")
        weights = ops.cast(ops.convert_to_tensor(sample_weight), "float32")
        losses = ops.multiply(losses, _match_weight_rank(losses, weights))
    losses = ops.cast(losses, input_dtype)
    mask = _row_mask_of(losses)
    rows = ops.shape(losses)[0]
    if mask is not None:  # a padded shard of a compiled step: its padding rows count nowhere
        losses = ops.multiply(losses, spread_rows(mask, losses))
        rows = ops.sum(ops.cast(mask, "int32"))
    if global_batch_size is None:
        _check_replica_context("compute_average_loss")
        num_replicas = context.get_strategy().num_replicas_in_sync
        global_batch_size = rows * num_replicas
    else:
        _check_global_batch_size(global_batch_size)
    total = ops.sum(losses)
    return ops.divide_no_nan(total, ops.cast(global_batch_size, input_dtype))


def _row_mask_of(losses: Any) -> Any:
    """The replica's row mask when `losses` are per-row losses of a padded shard, else None."""
    replica_context = context.get_replica_context() if context.has_strategy() else None
    mask = None if replica_context is None else replica_context._row_mask
    if mask is None or tuple(losses.shape[:1]) != tuple(mask.shape):
        return None
    return mask


def scale_regularization_loss(regularization_loss: Any):
    """`sum(regularization_loss) / num_replicas_in_sync`; call it in replica context.

    As `tf.nn.scale_regularization_loss`: summing gradients over replicas then
    applies the regulariser exactly once. Takes a tensor or a list of them
    (such as `model.losses`).

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> per_replica = strategy.run(lambda: ks.scale_regularization_loss([1.0, 3.0]))
        >>> [float(v) for v in strategy.experimental_local_results(per_replica)]
        [2.0, 2.0]
    """
    _check_replica_context("scale_regularization_loss")
    num_replicas = context.get_strategy().num_replicas_in_sync
    if isinstance(regularization_loss, (list, tuple)):  # e.g. `model.losses`
        parts = [ops.sum(_as_float_tensor(part)) for part in regularization_loss]
        total = sum(parts[1:], parts[0]) if parts else _as_float_tensor(0.0)
    else:
        total = ops.sum(_as_float_tensor(regularization_loss))
    return ops.divide(total, ops.cast(num_replicas, total.dtype))
