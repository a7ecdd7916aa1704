"""`OneDeviceStrategy`: everything on one named device, through the strategy machinery."""

from __future__ import annotations

from keras_strategies.distribute.devices import resolve_devices
from keras_strategies.distribute.strategy import Strategy, StrategyExtended


class OneDeviceStrategy(Strategy):
    """Places variables and computation on `device` (e.g. `"gpu:0"`, `"/cpu:0"`).

    Unlike the default strategy it enforces placement; results of `fit`,
    `evaluate` and `predict` are those of the same model without a strategy.
    """

    def __init__(self, device: str):
        super().__init__(StrategyExtended(self, resolve_devices([device]), place_variables=True))
