"""`ks.experimental.DatasetCreator`: a dataset function that `Model.fit` builds on each worker."""

from __future__ import annotations

from typing import Any, Callable, Optional


class DatasetCreator:
    """Wraps a dataset function for `Model.fit`, as `tf.keras.utils.experimental.DatasetCreator`.

    Under `ks.ParameterServerStrategy`, `fit` calls `dataset_fn(input_context)`
    on every worker (a `ks.InputContext`, to shard or batch by); its length is
    unknown, so `fit` needs `steps_per_epoch`. A plain function of an input
    context works the same.

    Args:
        dataset_fn: A function of a `ks.InputContext` that returns a dataset.
        input_options: A `ks.InputOptions` for distributing it, or None.

    Examples:
        >>> def dataset_fn(input_context):
        ...     batch_size = input_context.get_per_replica_batch_size(64)
        ...     return make_dataset().batch(batch_size).repeat()
        >>> creator = ks.experimental.DatasetCreator(dataset_fn)
        >>> callable(creator)
        True

        ```python
        model.fit(ks.experimental.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=100)
        ```
    """

    def __init__(self, dataset_fn: Callable[..., Any], input_options: Optional[Any] = None):
        if not callable(dataset_fn):
            raise TypeError(
                "`dataset_fn` for `DatasetCreator` must be a `callable` (a function of an InputContext "
                f"that returns a dataset), got {type(dataset_fn).__name__}: {dataset_fn!r}."
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The dataset: `dataset_fn(*args, **kwargs)`."""
        return self.dataset_fn(*args, **kwargs)
