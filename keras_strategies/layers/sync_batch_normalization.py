"""`SyncBatchNormalization`: batch statistics of the global batch, on every backend, wherever it is built.

`keras.layers.BatchNormalization(synchronized=True)` is accepted on every
backend inside a strategy's scope; outside every scope the package leaves
Keras' own check alone (Keras refuses the argument off TensorFlow). This
layer is the one to build anywhere: under a strategy its statistics are
summed over every replica of every worker, and on one device they are the
batch's own, as plain BatchNormalization computes them.
"""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="keras_strategies")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`BatchNormalization(synchronized=True)` that can be built inside or outside a strategy's scope.

    TensorFlow's counterpart is `tf.keras.layers.experimental.SyncBatchNormalization`. It
    takes BatchNormalization's arguments; `synchronized` is always true.

    Example:
        ```python
        layer = ks.layers.SyncBatchNormalization(momentum=0.9)   # one device: the batch's statistics
        with ks.MirroredStrategy().scope():
            model = keras.Sequential([keras.Input((4,)), ks.layers.SyncBatchNormalization()])
        ```
    """

    def __init__(self, *args: Any, synchronized: bool = True, **kwargs: Any):
        if not synchronized:
            raise ValueError("SyncBatchNormalization always synchronises (synchronized=False was given); "
                             "use keras.layers.BatchNormalization for per-replica statistics.")
        super().__init__(*args, synchronized=False, **kwargs)
        self.synchronized = True
