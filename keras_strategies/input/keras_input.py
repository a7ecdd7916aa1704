"""Our datasets as input to `fit` / `evaluate` / `predict`, which read global batches.

Keras (like tf-keras) takes a `tf.distribute.DistributedDataset` in `fit`, and
TensorFlow's `make_experimental_numpy_dataset` returns a `tf.data.Dataset`, so
code written for `tf.distribute` passes both to Keras' loops. Ours are not
types Keras knows: a dataset from `experimental_distribute_dataset` gives the
global batches of its source, so the loops read that source; a `NumpyDataset`
is read as a `keras.utils.PyDataset` of its batches in its own order.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from keras.utils import PyDataset

from keras_strategies.input.distributed_dataset import DistributedDatasetsFromFunction, GlobalBatchDataset
from keras_strategies.input.numpy_dataset import NumpyDataset


class NumpyBatches(PyDataset):
    """A batched `NumpyDataset` as Keras reads it: each full pass is the dataset's next iteration.

    As a `tf.data.Dataset` that reshuffles on each iteration, a shuffled
    `NumpyDataset` gives every epoch a new order. Keras peeks at the first
    batches before the first epoch (to build the model): reading from the
    start again before the last batch re-reads the same iteration, so the
    peek moves nothing.
    """

    def __init__(self, dataset: NumpyDataset):
        super().__init__()
        if dataset._batch_size is None:
            raise ValueError(
                "This dataset from `make_experimental_numpy_dataset` is not batched, and Keras' loops "
                "read batches: call `.batch(global_batch_size)` on it first."
            )
        self._dataset = dataset
        self._number: Optional[int] = None  # the iteration being read; None: take the next one
        self._batches: Iterator[Any] = iter(())
        self._position = 0

    @property
    def num_batches(self) -> Optional[int]:
        return None if self._dataset._repeat is None else len(self._dataset)

    def __getitem__(self, index: int) -> Any:
        if self._number is None:
            self._number, self._position = self._dataset.take_iteration(), 0
            self._batches = self._dataset.iteration(self._number)
        elif index < self._position:
            self._batches, self._position = self._dataset.iteration(self._number), 0
        for _ in range(index - self._position):
            next(self._batches, None)
        self._position = index + 1
        batch = next(self._batches, None)
        if batch is None:
            raise IndexError(f"Batch {index} is beyond this dataset's {self.num_batches} batches.")
        if self._position == self.num_batches:
            self._number = None  # the pass is complete
        return batch


def keras_input(strategy: Any, data: Any) -> tuple[Any, bool]:
    """`data` as Keras' loops can read it, and whether it is a dataset that orders its own batches.

    A dataset orders its own batches (as Keras leaves a `tf.data.Dataset`), so
    `fit(shuffle=True)` must not reorder them.
    """
    if isinstance(data, DistributedDatasetsFromFunction):
        raise ValueError(
            "`fit`, `evaluate` and `predict` read global batches and split them across the replicas; "
            "a dataset from `distribute_datasets_from_function` holds per-replica batches, for custom "
            "loops. Pass the dataset of global batches itself (or "
            "`strategy.experimental_distribute_dataset(dataset)`); under several workers, a "
            "`tf.data.Dataset` with `AutoShardPolicy.OFF` is taken as this worker's own share."
        )
    if isinstance(data, GlobalBatchDataset):
        if data._strategy is not strategy:
            raise ValueError(
                f"This distributed dataset was made by another strategy ({type(data._strategy).__name__} "
                f"of {data._strategy.num_replicas_in_sync} replicas) than the model's "
                f"({type(strategy).__name__} of {strategy.num_replicas_in_sync}): distribute it with "
                "the strategy whose scope built the model, or pass the dataset itself."
            )
        data = data._dataset
    if isinstance(data, NumpyDataset):
        return NumpyBatches(data), True
    return data, False
