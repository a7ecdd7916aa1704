"""`ks.layers`: the Keras layers this package adds.

`SyncBatchNormalization` is `keras.layers.BatchNormalization(synchronized=True)` that can be
built anywhere, on every backend: inside a strategy's scope its statistics are those of the
global batch, on one device those of the batch.

Examples:
    >>> layer = ks.layers.SyncBatchNormalization()
    >>> layer.synchronized
    True
"""

from keras_strategies.layers.sync_batch_normalization import SyncBatchNormalization

__all__ = ["SyncBatchNormalization"]
