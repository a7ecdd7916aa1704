"""What differs between the supported Keras releases (`keras_strategies/_version.py`), in one place.

The package repeats what Keras' own trainers do, so that a model trains as it
would without a strategy; where they changed between supported releases, the
code that repeats them asks here.
"""

from __future__ import annotations

import re

import keras

KERAS_VERSION = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", keras.__version__).groups())

# From 3.15, `train_on_batch` and `test_on_batch` reset the metrics first and report that
# batch alone; before, they accumulated over every call since the last reset.
ON_BATCH_RESETS_METRICS = KERAS_VERSION >= (3, 15)


def jax_reads_one_batch_ahead(platform: str) -> bool:
    """Whether Keras' JAX trainer reads its input one batch ahead (to start the next copy early).

    It yields the same batches, but an iterator given up early (the one that
    builds the model) has read one more, which a `PyDataset` with `workers` or
    a generator does not give again. 3.14 always reads ahead; from 3.15, not on CPU.
    """
    return KERAS_VERSION < (3, 15) or platform != "cpu"
