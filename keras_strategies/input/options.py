"""What input functions are told about the distribution (as in `tf.distribute`)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional


class InputContext:
    """Passed to `dataset_fn` by `distribute_datasets_from_function`: which pipeline this is.

    As `tf.distribute.InputContext`. There is one input pipeline per worker:
    shard the data with `input_pipeline_id` and batch it per replica with
    `get_per_replica_batch_size`.

    Examples:
        >>> context = ks.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        >>> context.get_per_replica_batch_size(64)
        16
        >>> rows = np.arange(8)[context.input_pipeline_id::context.num_input_pipelines]  # this worker's rows
        >>> rows.tolist()
        [1, 3, 5, 7]
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines: one per worker."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index, from 0 to `num_input_pipelines - 1` (the worker's index)."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of all workers, as `Strategy.num_replicas_in_sync`."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`; raises `ValueError` if it does not divide.

        Examples:
            >>> ks.InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
            16
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ks.InputContext(input pipeline id {self._input_pipeline_id}, "
            f"total: {self._num_input_pipelines})"
        )


class ValueContext:
    """Passed to `value_fn` by `experimental_distribute_values_from_function`: which replica this is.

    As `tf.distribute.experimental.ValueContext`.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> def value_fn(context):
        ...     return context.replica_id_in_sync_group / context.num_replicas_in_sync
        >>> strategy.experimental_local_results(strategy.experimental_distribute_values_from_function(value_fn))
        (0.0, 0.5)
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica's id among all replicas of all workers."""
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of all workers."""
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ks.ValueContext(replica id {self._replica_id_in_sync_group}, "
            f"total replicas in sync: {self._num_replicas_in_sync})"
        )


class InputReplicationMode(enum.Enum):
    """One input pipeline per worker, or one per replica, as `tf.distribute.InputReplicationMode`.

    `PER_WORKER` is what this package does: `distribute_datasets_from_function`
    calls `dataset_fn` once per worker in either mode, and
    `experimental_distribute_dataset` refuses `PER_REPLICA`.

    Examples:
        >>> options = ks.InputOptions(experimental_replication_mode=ks.InputReplicationMode.PER_WORKER)
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputOptions(NamedTuple):
    """Options for distributing input, as `tf.distribute.InputOptions`.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> dataset = strategy.make_experimental_numpy_dataset(np.ones((4, 1), "float32")).batch(4)
        >>> options = ks.InputOptions(experimental_fetch_to_device=False)  # leave the shards on the host
        >>> dist_dataset = strategy.experimental_distribute_dataset(dataset, options)
    """

    experimental_fetch_to_device: Optional[bool] = None
    """Copy each replica's shard to its device (`None`: yes); `False` leaves it where the source made it."""
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    """One input pipeline per worker (see `ks.InputReplicationMode`)."""
    experimental_place_dataset_on_device: bool = False
    """Accepted for compatibility; unused."""
    experimental_per_replica_buffer_size: int = 1
    """Accepted for compatibility; unused."""


class RunOptions(NamedTuple):
    """Options for `strategy.run`, as `tf.distribute.RunOptions`; accepted for compatibility, unused.

    In TensorFlow they concern TPUs and XLA.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.run(lambda: 1, options=ks.RunOptions())
        1
    """

    experimental_enable_dynamic_batch_size: bool = True
    """Unused."""
    experimental_bucketizing_dynamic_shape: bool = False
    """Unused."""
    experimental_xla_options: object = None
    """Unused."""
