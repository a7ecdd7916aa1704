"""The Keras methods this engine replaces: Keras' TF optimizer in cross-replica context.

The replacements themselves live in `optimizer.py`; this module lists them for
the table of `keras_strategies.keras_integration` and installs them.
"""

from __future__ import annotations

from typing import Any

from keras_strategies.backend.tensorflow import optimizer, parameter_server

_WHY = "the summed update is applied in TF's cross-replica context, where Keras' merge call fails"

# (Keras method, why), for the table of `keras_strategies.keras_integration`.
REPLACED = (
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step", _WHY),
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer._apply_weight_decay", _WHY),
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_increment_gradient_accumulators", _WHY),
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer._overwrite_model_variables_with_average_value",
     "use_ema's overwrite assigns directly (TF refuses to nest the optimizer's own strategy)"),
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer.add_variable_from_reference",
     "slot variables made in cross-replica context are placed by their reference variable"),
    ("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply",
     "LossScaleOptimizer applies the summed gradients in cross-replica context"),
    *((f"keras.src.backend.tensorflow.core.Variable.{name}",
       "ParameterServerStrategy: one atomic update on the parameter server (workers lost increments)")
      for name in ("assign_add", "assign_sub")),
    ("keras.src.backend.tensorflow.core.Variable.__array__",
     "ParameterServerStrategy: a variable split by a partitioner reads as one array (saving, get_weights)"),
    ("keras.src.backend.tensorflow.optimizer.TFOptimizer._distributed_tf_update_step",
     "ParameterServerStrategy: a variable split by a partitioner is updated without colocation"),
)


def install(strategy_context: Any) -> None:
    """Replaces the methods of `REPLACED` (idempotent); they need no strategy context."""
    optimizer.install()
    parameter_server.install_keras_hooks()
