"""Scalar updates of a Keras `Mean` metric in a model's own step count with the replica's share.

The Keras guide's `train_step` / `test_step` track the loss with
`metric.update_state(loss)`: on one device each batch's mean loss counts once.
Under a strategy the step runs once per replica, on that replica's shard
(`trainer/custom_step.py`), so the same line would count every replica's mean
once: uneven shards would be averaged without regard to their sizes, and a
batch would weigh as much as the number of replicas with rows. Weighted by the
replica's share of the global batch (`rows_i / B`, the weight its gradients
get), the replicas' updates of one step add up to the batch's mean, counted
once, as on one device.

Only a scalar without a sample weight is reweighted: per-sample values
already count their rows, and a sample weight given is the user's. `Sum`
metrics are left alone (a scalar summed there may be a count, not a mean).

In a custom step compiled with padded shards (`distribute/traced_function.py`)
per-row values of the padded shard count with the row mask as (a factor of)
their sample weight, so padding rows count nowhere: every metric built on
`Mean` (accuracies, mean errors, `MeanMetricWrapper`) stays exact.
Outside a model's own step on a replica, Keras' method runs unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from keras import ops

from keras_strategies.backend.common import patches
from keras_strategies.distribute import context


def _replica_share() -> Any:
    """The replica's share of the batch in a model's own step (`ReplicaContext._gradient_weight`), else None."""
    replica_context = context.get_replica_context()
    return None if replica_context is None else replica_context._gradient_weight


def _masked(metric: Any, values: Any, sample_weight: Any) -> Any:
    """The sample weight of `values` in a padded shard: the row mask (times the user's) for
    per-row values; values without rows (a scalar) need none. Either way the update leaves the
    padding rows out (noted on the replica context)."""
    replica_context = context.get_replica_context()
    if replica_context is None or replica_context._rows_left_out is None:
        return sample_weight
    replica_context._leaves_rows_out(metric.variables)
    mask = replica_context._row_mask
    shape = getattr(values, "shape", np.shape(values))
    if not shape or shape[0] != mask.shape[0]:
        return sample_weight
    if sample_weight is None:
        return mask
    weights = ops.convert_to_tensor(sample_weight)
    return weights * ops.reshape(ops.cast(mask, weights.dtype), (-1,) + (1,) * (len(weights.shape) - 1))


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def update_state(self, values, sample_weight=None):
        share = _replica_share()
        if share is not None and sample_weight is None and len(getattr(values, "shape", np.shape(values))) == 0:
            sample_weight = share
        return original(self, values, sample_weight=_masked(self, values, sample_weight))

    return update_state


_UPDATE_STATE = patches.declare("keras.src.metrics.reduction_metrics.Mean.update_state",
                                "a scalar update in a model's own step counts with the replica's share of the batch")


def install() -> None:
    """Installs the hook (idempotent)."""
    _UPDATE_STATE.apply(_wrap)
