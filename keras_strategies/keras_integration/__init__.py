"""Every change keras-strategies makes to Keras, in one place.

`install()` runs once when `keras_strategies` is imported and replaces the
Keras methods listed in `REPLACED` (and in the engine's own `REPLACED`). Each
replacement first checks whether a strategy is involved and otherwise calls
Keras' own code unchanged, so models built outside every strategy scope
behave exactly as without this package. Every replacement keeps Keras'
original as `_ks_original`.

| Keras method (under `keras.src`) | module | why |
|---|---|---|
| `trainers.trainer.Trainer.__init__` | `ownership` | a model remembers the strategy it was created under |
| `trainers.trainer.Trainer.compile` | `ownership` | a model is compiled under the strategy it was created under |
| `backend.common.variables.Variable.__init__` | `ownership` | a variable remembers its strategy; one made inside `strategy.run` is made as in `scope()`, shared by the replicas |
| `layers.layer.Layer._maybe_build` | `ownership` | a layer first called inside `strategy.run` builds as in `scope()` |
| `models.model.Model.fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch`, `predict_on_batch` | `ownership` | they run under the model's strategy: each global batch split across the replicas |
| `layers.normalization.batch_normalization.BatchNormalization.__init__` | `batch_norm` | `synchronized=True` on every backend |
| `layers.normalization.batch_normalization.BatchNormalization._moments` | `batch_norm` | batch statistics leave padding rows out and are synchronised across replicas |
| `optimizers.base_optimizer.BaseOptimizer.apply`, `stateless_apply`, `apply_gradients` | `optimizer_hooks` | called in a replica, they sum the gradients across replicas and apply one update (clipping after the sum) |
| `optimizers.loss_scale_optimizer.LossScaleOptimizer.apply`, `stateless_apply` | `optimizer_hooks` | the same for the loss-scaling optimizer |
| `losses.loss.scale_loss_for_distribution`, `unscale_loss_for_distribution` | `loss_scaling` | Keras' division by the replica count is off in our replica steps, which weight replicas by their rows |
| `losses.loss.reduce_values`, `reduce_weighted_values` | `loss_reduction` | every loss reduction sums over replicas to the global batch's loss, padding rows excluded |
| `metrics.reduction_metrics.Mean.update_state` | `metric_weighting` | a scalar update in a model's own step counts with the replica's share of the batch |
| `saving.saving_api.save_model`, `save_weights` (and the public names bound to them) | `chief_only` | only the chief's file is kept under `MultiWorkerMirroredStrategy` |
| `utils.file_utils.makedirs` | `chief_only` | once a multi-worker cluster is joined, a directory another worker created between Keras' check and its creation is accepted |
| `callbacks.backup_and_restore.BackupAndRestore._save_model` | `backup_and_restore` | a backup is whole or absent: a worker stopped while saving never leaves weights beside the previous epoch's number |
| `callbacks.backup_and_restore.BackupAndRestore.__init__`, `_load_model`, `on_train_begin`, `on_epoch_begin`, `on_train_batch_end`, `on_train_end` | `backup_and_restore` | tf.keras' `save_before_preemption=True`: on SIGTERM every worker backs up at the same step and exits; `fit` resumes after the batches trained |
| `random.seed_generator.SeedGenerator.next` | `replica_seeds` | replicas draw different random numbers, as rows do on one device |
| `backend.tensorflow.optimizer.TFOptimizer` update methods, `LossScaleOptimizer._tf_apply` | TensorFlow engine (`backend/tensorflow/keras_hooks.py`) | the summed update is applied in TF's cross-replica context |
| `backend.tensorflow.core.Variable.assign_add`, `assign_sub`, `__array__`, `TFOptimizer._distributed_tf_update_step` (and its `add_variable_from_reference` again) | TensorFlow engine (`backend/tensorflow/parameter_server.py`) | `ParameterServerStrategy`: increments are atomic on the parameter server; a variable split by a partitioner reads, updates and gets slots as one |
| `utils.torch_utils.TorchModuleWrapper.call` | PyTorch engine (`backend/torch/keras_hooks.py`) | a wrapped `torch.nn.Module` runs on the replica's values of its parameters |
| `backend.torch.nn._maybe_convert_to_channels_last` | PyTorch engine (`backend/torch/keras_hooks.py`) | no memory-layout conversion inside a vectorised replica program, which `vmap` cannot make (the layout changes speed, not values) |

Besides these, a `ParameterServerStrategy` with a partitioner replaces TensorFlow's
`tf.GradientTape.gradient` (a split Keras variable gets one gradient, put together from its
shards), and `chief_only` changes the progress bar and Keras' messages on
non-chief workers through the callbacks it is given, not by replacing methods.
"""

from __future__ import annotations

from keras_strategies.backend import engine
from keras_strategies.distribute import context
from keras_strategies.keras_integration import (
    backup_and_restore,
    batch_norm,
    chief_only,
    loss_reduction,
    loss_scaling,
    metric_weighting,
    optimizer_hooks,
    ownership,
    replica_seeds,
)

_MODEL_METHODS = tuple(f"keras.src.models.model.Model.{name}" for name in ownership.KERAS_METHODS)
_OPTIMIZERS = ("keras.src.optimizers.base_optimizer.BaseOptimizer", "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer")
_BN = "keras.src.layers.normalization.batch_normalization.BatchNormalization"

# Each Keras method replaced on every backend, with the module that replaces it (the table above).
REPLACED = (
    ("keras.src.trainers.trainer.Trainer.__init__", "ownership"),
    ("keras.src.trainers.trainer.Trainer.compile", "ownership"),
    ("keras.src.backend.common.variables.Variable.__init__", "ownership"),
    ("keras.src.layers.layer.Layer._maybe_build", "ownership"),
    *((name, "ownership") for name in _MODEL_METHODS),
    (f"{_BN}.__init__", "batch_norm"),
    (f"{_BN}._moments", "batch_norm"),
    *((f"{cls}.{name}", "optimizer_hooks") for cls in _OPTIMIZERS for name in ("apply", "stateless_apply")),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer.apply_gradients", "optimizer_hooks"),
    ("keras.src.losses.loss.scale_loss_for_distribution", "loss_scaling"),
    ("keras.src.losses.loss.unscale_loss_for_distribution", "loss_scaling"),
    ("keras.src.losses.loss.reduce_values", "loss_reduction"),
    ("keras.src.losses.loss.reduce_weighted_values", "loss_reduction"),
    ("keras.src.metrics.reduction_metrics.Mean.update_state", "metric_weighting"),
    ("keras.src.saving.saving_api.save_model", "chief_only"),
    ("keras.src.saving.saving_api.save_weights", "chief_only"),
    ("keras.src.utils.file_utils.makedirs", "chief_only"),
    *((f"keras.src.callbacks.backup_and_restore.BackupAndRestore.{name}", "backup_and_restore")
      for name in backup_and_restore.REPLACED_METHODS),
    ("keras.src.random.seed_generator.SeedGenerator.next", "replica_seeds"),
)


def replaced() -> tuple:
    """`(Keras method, module or engine)` for every method replaced on the current backend."""
    return REPLACED + tuple((name, "engine") for name, _ in engine.keras_hooks.REPLACED)


def install() -> None:
    """Replaces the Keras methods of `replaced()` (idempotent)."""
    ownership.install()
    batch_norm.install()
    optimizer_hooks.install()
    loss_scaling.install()
    loss_reduction.install()
    metric_weighting.install()
    chief_only.install()
    backup_and_restore.install()
    replica_seeds.install()
    engine.keras_hooks.install(context)
