"""A small in-memory dataset of NumPy arrays, for `strategy.make_experimental_numpy_dataset`.

It slices arrays lazily (no large constant is embedded anywhere) and offers
the few `tf.data`-style transformations a custom loop needs, on any backend.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
from keras.src import tree


class NumpyDataset:
    """Elements are rows of the arrays (as `tf.data.Dataset.from_tensor_slices`), or batches after `batch`."""

    def __init__(self, arrays: Any, batch_size: Optional[int] = None, drop_remainder: bool = False,
                 repeat: Optional[int] = 1, shuffle_seed: Optional[int] = None):
        self._arrays = tree.map_structure(np.asarray, arrays)
        sizes = {len(a) for a in tree.flatten(self._arrays)}
        if len(sizes) != 1:
            raise ValueError(f"All arrays must have the same length to be sliced together; got {sorted(sizes)}.")
        self._length = sizes.pop()
        self._batch_size, self._drop_remainder = batch_size, drop_remainder
        self._repeat, self._shuffle_seed = repeat, shuffle_seed
        self._iterations = 0  # each new iteration reshuffles (as tf.data's reshuffle_each_iteration)

    def _with(self, **changes) -> "NumpyDataset":
        settings = dict(batch_size=self._batch_size, drop_remainder=self._drop_remainder,
                        repeat=self._repeat, shuffle_seed=self._shuffle_seed)
        settings.update(changes)
        return NumpyDataset(self._arrays, **settings)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpyDataset":
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        return self._with(batch_size=batch_size, drop_remainder=drop_remainder)

    def repeat(self, count: Optional[int] = None) -> "NumpyDataset":
        """Repeats the elements `count` times (`None`: forever)."""
        return self._with(repeat=count)

    def shuffle(self, buffer_size: int = 0, seed: Optional[int] = None) -> "NumpyDataset":
        """Reshuffles the rows at every pass and every new iteration (the whole dataset is the buffer).

        The orders are a deterministic sequence for a given `seed` (`None`: 0), so every
        worker of a multi-worker job reads the same batches.
        """
        return self._with(shuffle_seed=0 if seed is None else seed)

    def __iter__(self) -> Iterator[Any]:
        return self.iteration(self.take_iteration())

    def take_iteration(self) -> int:
        """The number of the next iteration (each new iteration reshuffles)."""
        self._iterations += 1
        return self._iterations - 1

    def iteration(self, number: int) -> Iterator[Any]:
        """The elements of iteration `number`: read again, it gives the same order."""
        rng = None
        if self._shuffle_seed is not None:
            rng = np.random.default_rng([self._shuffle_seed, number])
        passes = 0
        while self._repeat is None or passes < self._repeat:
            order = rng.permutation(self._length) if rng is not None else np.arange(self._length)
            if self._batch_size is None:
                for index in order:
                    yield tree.map_structure(lambda a: a[index], self._arrays)
            else:
                stop = self._length - (self._length % self._batch_size if self._drop_remainder else 0)
                for start in range(0, stop, self._batch_size):
                    rows = order[start:start + self._batch_size]
                    yield tree.map_structure(lambda a: a[rows], self._arrays)
            passes += 1

    def __len__(self) -> int:
        if self._repeat is None:
            raise TypeError("An infinitely repeated dataset has no length.")
        if self._batch_size is None:
            return self._length * self._repeat
        full, rest = divmod(self._length, self._batch_size)
        return (full + (1 if rest and not self._drop_remainder else 0)) * self._repeat
