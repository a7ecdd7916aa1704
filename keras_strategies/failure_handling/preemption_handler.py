"""`ks.experimental.PreemptionCheckpointHandler`: save at one step on every worker, exit, resume there.

TensorFlow's handler for custom training loops, on every backend. It restores
the newest checkpoint when created, counts the steps run through it
(`total_run_calls`, saved as the checkpoint's number), and on a termination
notice makes every worker save at the same step boundary and exit with a
restart code.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

from keras_strategies.backend import engine
from keras_strategies.failure_handling.checkpoint import Checkpoint, CheckpointManager, checkpoint_number
from keras_strategies.failure_handling.step_agreement import StepAgreement
from keras_strategies.failure_handling.termination import TerminationConfig, TerminationWatch
from keras_strategies.multi_worker.worker_cluster import LOCAL_CLUSTER, WorkerCluster, joined_cluster, resolve


def step_agreement(cluster: WorkerCluster) -> StepAgreement:
    """The agreement of this worker's cluster: through the chief's store when there are several workers."""
    if cluster.num_workers == 1:
        return StepAgreement(cluster)
    if joined_cluster() is None:
        raise RuntimeError(
            f"This process is {cluster.describe(cluster.worker_index)} of a {cluster.num_workers}-worker cluster "
            "but has not joined it: create the ks.MultiWorkerMirroredStrategy first, then the preemption handler."
        )
    return StepAgreement(cluster, engine.collectives.kv_set, engine.collectives.kv_try_get)


class PreemptionPoint:
    """A termination notice and the cluster's agreement on where to act on it.

    `due(step)` is true at the same step boundary on every worker once any
    worker was noticed; `save_and_exit(save)` then runs `save`, tells the other
    workers it is done (they wait for the chief's save), and exits through the
    config's `exit_fn`. Shared by the handler and `BackupAndRestore(save_before_preemption=True)`.
    """

    def __init__(self, cluster: WorkerCluster, config: TerminationConfig):
        self.config = config
        self._agreement = step_agreement(cluster)
        self._watch = TerminationWatch(config)

    def due(self, step: int) -> bool:
        return self._agreement.should_save(step, self._watch.due())

    def save_and_exit(self, save: Callable[[], Any]) -> None:
        started = time.monotonic()
        save()
        self._watch.save_seconds = time.monotonic() - started
        self._agreement.saved()
        self.close()
        self.config.exit_fn()

    def close(self) -> None:
        self._agreement.close()
        self._watch.close()


def _manager(checkpoint_or_checkpoint_manager: Any, checkpoint_dir: Optional[str]) -> CheckpointManager:
    given = checkpoint_or_checkpoint_manager
    if isinstance(given, CheckpointManager):
        if checkpoint_dir is not None:
            raise ValueError(
                "checkpoint_dir is for a ks.experimental.Checkpoint; a CheckpointManager has its own "
                f"directory ({given.directory!r}). Pass one or the other."
            )
        return given
    if isinstance(given, Checkpoint):
        if not checkpoint_dir:
            raise ValueError("With a ks.experimental.Checkpoint, pass checkpoint_dir: where the handler keeps it.")
        return CheckpointManager(given, checkpoint_dir, max_to_keep=1)
    raise ValueError(
        "PreemptionCheckpointHandler saves a ks.experimental.Checkpoint or CheckpointManager (tf.train's "
        f"checkpoints exist only on TensorFlow); got {type(given).__name__!r}. Use "
        "ks.experimental.Checkpoint(model=model, optimizer=optimizer)."
    )


class PreemptionCheckpointHandler:
    """Saves a checkpoint at the same step on every worker when one is preempted, then exits.

    As `tf.distribute.experimental.PreemptionCheckpointHandler`. Created after
    the strategy, it restores the newest checkpoint of `checkpoint_dir` (so a
    restarted job resumes). Run each training step through `run` (or call
    `save_checkpoint_if_preempted` after each step): when any worker receives
    SIGTERM (or the `termination_config`'s notice), every worker saves at the
    same step boundary, only the chief writes, and all exit with code 42 (the
    launcher's `--max-restarts` restarts them). All workers must see
    `checkpoint_dir` (a shared file system, or one machine).

    Args:
        cluster_resolver: The strategy's `cluster_resolver` (None for a one-process strategy).
        checkpoint_or_checkpoint_manager: A `ks.experimental.Checkpoint` (then
            `checkpoint_dir` is required) or `ks.experimental.CheckpointManager`.
        checkpoint_dir: Where the handler keeps its checkpoint (the newest only).
        termination_config: A `ks.experimental.TerminationConfig`.

    Examples:
        ```python
        checkpoint = ks.experimental.Checkpoint(model=model, optimizer=optimizer)
        handler = ks.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, "/shared/ckpt")
        while handler.total_run_calls < STEPS:
            handler.run(distributed_train_step, next(iterator))
        ```
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Any,
                 checkpoint_dir: Optional[str] = None, termination_config: Optional[TerminationConfig] = None):
        if termination_config is None:
            termination_config = TerminationConfig()
        if not isinstance(termination_config, TerminationConfig):
            raise ValueError(f"termination_config must be a ks.experimental.TerminationConfig, got {termination_config!r}.")
        # None: the strategy's `cluster_resolver` of a one-process strategy (Mirrored, OneDevice, ...).
        self._cluster = LOCAL_CLUSTER if cluster_resolver is None else resolve(cluster_resolver)
        self._manager = _manager(checkpoint_or_checkpoint_manager, checkpoint_dir)
        self._config = termination_config
        self._run_counter = checkpoint_number(self._manager.restore_or_initialize())
        self._preemption = PreemptionPoint(self._cluster, termination_config)

    @property
    def total_run_calls(self) -> int:
        """Steps run through `run` (or `save_checkpoint_if_preempted`), counting those before a restart."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one training step (`distributed_train_function(*args, **kwargs)`), saving and exiting if due."""
        self._check()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        self._check()
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Call after each step instead of `run`: counts the step, then saves and exits if due.

        Arguments go to the checkpoint manager's `save` (e.g. `checkpoint_number=`).
        """
        self._run_counter += 1
        self._check(*args, **kwargs)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """The scope of a loop that calls `save_checkpoint_if_preempted` (TensorFlow's pairing)."""
        yield

    def _check(self, *args: Any, **kwargs: Any) -> None:
        if not self._preemption.due(self._run_counter):
            return

        def save() -> None:
            if self._config.save_fn is not None:
                self._config.save_fn()
            elif self._cluster.is_chief:
                kwargs.setdefault("checkpoint_number", self._run_counter)
                self._manager.save(*args, **kwargs)

        self._preemption.save_and_exit(save)
