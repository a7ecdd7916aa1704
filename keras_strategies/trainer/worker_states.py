"""Keeping a model's states identical across workers after a custom step.

A model's own `train_step` / `test_step` updates metrics (and
BatchNormalization statistics) with its worker's rows only. After the step,
metric variables with `aggregation="sum"` (Keras' default for metric state)
get the sum of every worker's change, and float non-trainable variables (each
worker's holds the mean over its replicas) the mean over all replicas that
had rows, in one cross-worker all-reduce.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import keras

from keras_strategies.trainer.cross_worker import Exchange


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def _parts(model: Any, kind: str) -> tuple[list, list]:
    metrics = [v for v in model.metrics_variables if getattr(v, "aggregation", "sum") == "sum"]
    non_trainable = []
    if kind == "train":
        non_trainable = [v for v in model.non_trainable_variables if "float" in str(v.dtype)
                         and getattr(v, "aggregation", "mean") in ("mean", "none")]
    return metrics, non_trainable


def capture(model: Any, kind: str) -> list:
    """The metric values before the step (their change is what each worker contributes)."""
    metrics, _ = _parts(model, kind)
    return [_numpy(v.value) for v in metrics]


def combine(model: Any, kind: str, extended: Any, before: list, replicas_with_rows: int) -> None:
    """Sums metric changes and averages non-trainable values across workers, weighted by their replicas with rows."""
    metrics, non_trainable = _parts(model, kind)
    exchange = Exchange(extended._start_cross_worker_sum)
    idle = replicas_with_rows == 0
    exchange.add("metrics", [np.zeros_like(old) if idle else _numpy(v.value) - old for v, old in zip(metrics, before)])
    weight = float(replicas_with_rows)
    exchange.add("non_trainable", [_numpy(v.value) * weight for v in non_trainable] + [np.array(weight, "float32")])
    result = exchange.run("metric and state all-reduce")
    for variable, old, delta in zip(metrics, before, result["metrics"]):
        variable.assign(old + _numpy(delta))
    *totals, count = result["non_trainable"]
    for variable, total in zip(non_trainable, totals):
        variable.assign(_numpy(total) / max(float(_numpy(count)), 1.0))
