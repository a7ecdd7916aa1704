"""`OneDeviceStrategy`: everything on one named device, through the strategy machinery."""

from __future__ import annotations

from keras_strategies.distribute.devices import resolve_devices
from keras_strategies.distribute.strategy import Strategy, StrategyExtended


class OneDeviceStrategy(Strategy):
    """Places variables and computation on one device, as `tf.distribute.OneDeviceStrategy`.

    Unlike the default strategy it enforces placement; results of `fit`,
    `evaluate` and `predict` are those of the same model without a strategy.
    Code written for it runs unchanged under a multi-replica strategy.

    Args:
        device: A device name such as `"gpu:0"`, `"cpu:0"` or `"/device:GPU:0"`.

    Examples:
        >>> strategy = ks.OneDeviceStrategy("cpu:0")
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> strategy.num_replicas_in_sync
        1
    """

    def __init__(self, device: str):
        super().__init__(StrategyExtended(self, resolve_devices([device]), place_variables=True))
