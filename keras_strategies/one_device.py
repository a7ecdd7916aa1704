"""`OneDeviceStrategy`: everything on one named device, through the strategy machinery."""

from __future__ import annotations

import contextlib
from typing import Iterator

from keras_strategies.backend import engine
from keras_strategies.devices import resolve_devices
from keras_strategies.strategy import Strategy, StrategyExtended


class _OneDeviceExtended(StrategyExtended):
    @property
    def host_device(self) -> str:
        return self._devices[0]

    @contextlib.contextmanager
    def _scope_placement(self) -> Iterator[None]:
        with engine.devices.device_scope(self._devices[0]):
            yield


class OneDeviceStrategy(Strategy):
    """Places variables and computation on `device` (e.g. `"gpu:0"`, `"/cpu:0"`).

    Unlike the default strategy it enforces placement; results of `fit`,
    `evaluate` and `predict` are those of the same model without a strategy.
    """

    def __init__(self, device: str):
        super().__init__(_OneDeviceExtended(self, resolve_devices([device])))
