"""The JAX engine reads a loop's input as Keras' own JAX trainer does, on every supported Keras."""

import keras
import numpy as np
from keras.src.backend.jax.trainer import JAXEpochIterator

from keras_strategies.trainer.loops import _LoopIterator


class CountingBatches(keras.utils.PyDataset):
    """Five batches, each filled with its index; `reads` lists the indices read, in order."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __len__(self):
        return 5

    def __getitem__(self, index):
        self.reads.append(index)
        return np.full((2, 1), index, "float32"), np.zeros((2, 1), "float32")


def _reads_for_first_batch_and_epoch(make_iterator):
    data = CountingBatches()
    iterator = make_iterator(data)
    for _, _, batches in iterator:  # as Keras builds a model: one batch, then the iterator is given up
        first = next(batches) if not isinstance(batches, list) else batches[0]
        break
    reads_for_first = len(data.reads)
    iterator.reset()  # as `fit` does after building
    epoch = []
    for _, _, batches in iterator:  # Keras' JAX iterator hands out its iterator, ours a list of batches
        epoch.append(next(batches) if not isinstance(batches, list) else batches[0])
    return float(first[0][0, 0]), reads_for_first, [float(batch[0][0, 0]) for batch in epoch]


def test_the_first_batch_costs_as_many_reads_as_in_keras_and_the_epoch_is_the_same():
    keras_own = _reads_for_first_batch_and_epoch(lambda data: JAXEpochIterator(x=data, shuffle=False))
    ours = _reads_for_first_batch_and_epoch(lambda data: _LoopIterator(x=data, shuffle=False, backend_batches=False))
    assert ours == keras_own
    assert keras_own[2] == [0.0, 1.0, 2.0, 3.0, 4.0]
