"""The strategy stack: which strategy is current, and whether code runs per replica.

Mirrors `tf.distribute`: outside every scope the default strategy is current
and code is in its (only) replica context; `strategy.scope()` enters
cross-replica context; `strategy.run(fn)` runs `fn` in a replica context.
The stack is thread-local so that replicas run in threads see their own context.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from keras import ops
from keras.src import tree

from keras_strategies.distribute.reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from keras_strategies.distribute.strategy import Strategy


class _Frame:
    __slots__ = ("strategy", "replica_context")

    def __init__(self, strategy: "Strategy", replica_context: Optional["ReplicaContext"]):
        self.strategy = strategy
        self.replica_context = replica_context


class _Stack(threading.local):
    def __init__(self):
        self.frames: list[_Frame] = []
        # Set by `experimental_set_strategy`: a scope entered without a `with`.
        self.set_scope: Optional[contextlib.AbstractContextManager] = None


_stack = _Stack()

# The default strategy is made on first use by the factory that `distribute.strategy` registers
# when it is imported (it builds on this module, so this module cannot import it).
_default_factory: list = []
_default: list = []


def register_default_strategy(factory: Callable[[], "Strategy"]) -> None:
    """Sets how the default strategy is made (`distribute.strategy` does, once)."""
    _default_factory[:] = [factory]


def default_strategy() -> "Strategy":
    """The singleton default strategy."""
    if not _default:
        _default.append(_default_factory[0]())
    return _default[0]


def is_default(strategy: Any) -> bool:
    return getattr(strategy, "_is_default_strategy", False)


def _top() -> Optional[_Frame]:
    return _stack.frames[-1] if _stack.frames else None


@contextlib.contextmanager
def enter_frame(strategy: "Strategy", replica_context: Optional["ReplicaContext"]) -> Iterator[None]:
    """Pushes a (strategy, context) frame; `replica_context=None` means cross-replica."""
    _stack.frames.append(_Frame(strategy, replica_context))
    try:
        yield
    finally:
        _stack.frames.pop()


def current_frames() -> list:
    """A copy of this thread's frames, to install in a replica thread."""
    return list(_stack.frames)


@contextlib.contextmanager
def frames_installed(frames: list) -> Iterator[None]:
    """Runs code in another thread with the frames of the thread that started it."""
    saved = _stack.frames
    _stack.frames = list(frames)
    try:
        yield
    finally:
        _stack.frames = saved


def strategy_of(obj: Any) -> Optional["Strategy"]:
    """The strategy `obj` (a model or variable) was created under, or `None` (set by the ownership hooks)."""
    return getattr(obj, "_ks_strategy", None)


def get_strategy() -> Strategy:
    """The current strategy: the innermost scope's, else the default strategy.

    As `tf.distribute.get_strategy`. The default strategy runs everything
    as usual, on one replica, so library code can call `get_strategy()`
    without checking `has_strategy()` first.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     print(ks.get_strategy() is strategy)
        True
        >>> ks.get_strategy().num_replicas_in_sync  # the default strategy
        1
    """
    top = _top()
    if top is not None:
        return top.strategy
    return default_strategy()


def has_strategy() -> bool:
    """True when a strategy other than the default one is current, as `tf.distribute.has_strategy`.

    Examples:
        >>> ks.has_strategy()
        False
        >>> with ks.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        ...     print(ks.has_strategy())
        True
    """
    top = _top()
    return top is not None and not is_default(top.strategy)


def in_cross_replica_context() -> bool:
    """True inside a non-default `strategy.scope()` but outside `strategy.run`.

    As `tf.distribute.in_cross_replica_context`: there, code sees all
    replicas at once (`strategy.reduce`); inside `run` it sees one.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     print(ks.in_cross_replica_context())
        ...     print(strategy.run(ks.in_cross_replica_context))
        True
        False
    """
    top = _top()
    return top is not None and top.replica_context is None


def get_replica_context() -> Optional[ReplicaContext]:
    """The replica context, `None` in cross-replica context.

    As `tf.distribute.get_replica_context`. Inside `strategy.run` it gives
    the replica's id and its collectives; outside every scope it is the
    default strategy's context (replica 0 of 1).

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group)
        PerReplica:{
          0: 0,
          1: 1
        }
        >>> with strategy.scope():
        ...     print(ks.get_replica_context())
        None
    """
    top = _top()
    if top is None:
        return default_strategy()._default_replica_context
    return top.replica_context


def get_cross_replica_context() -> Optional["Strategy"]:
    """The current strategy when in cross-replica context, else `None`."""
    top = _top()
    if top is None:
        return None
    return top.strategy if top.replica_context is None else None


def experimental_set_strategy(strategy: Optional[Strategy]) -> None:
    """Makes `strategy` current without a `with` block; `None` clears it.

    As `tf.distribute.experimental_set_strategy`: the same as entering
    `strategy.scope()` until the next call, for notebooks and scripts.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> ks.experimental_set_strategy(strategy)
        >>> ks.get_strategy() is strategy
        True
        >>> ks.experimental_set_strategy(None)
        >>> ks.has_strategy()
        False
    """
    if _stack.set_scope is not None:
        scope, _stack.set_scope = _stack.set_scope, None
        scope.__exit__(None, None, None)
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _stack.set_scope = scope


class ReplicaContext:
    """What code inside `strategy.run` sees: its replica id and collectives.

    As `tf.distribute.ReplicaContext`; get it with `ks.get_replica_context()`.
    The collectives (`all_reduce`, `all_gather`) run among the replicas of
    one `run` (and every worker); with one replica they return the value unchanged.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> def replica_fn():
        ...     context = ks.get_replica_context()
        ...     return context.all_reduce("sum", keras.ops.ones(()))
        >>> [float(v) for v in strategy.experimental_local_results(strategy.run(replica_fn))]
        [2.0, 2.0]
    """

    def __init__(
        self,
        strategy: "Strategy",
        replica_id_in_sync_group: int,
        row_mask: Any = None,
        in_program: bool = False,
        gradient_weight: Optional[float] = None,
        runs_keras_method: bool = False,
    ):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        # Set by one-replica strategies, which run Keras' own `fit` in a replica context: Keras
        # methods called there (`evaluate` for the validation data) are not inside `strategy.run`.
        self._runs_keras_method = runs_keras_method
        # Set by multi-replica steps: which rows of the replica's (padded) shard are real,
        # whether the replicas run together so that collectives can rendezvous, and (for a
        # custom `train_step`) the replica's share of the global batch, by which the
        # optimizer weights its gradients before summing them and a `Mean` metric counts a
        # scalar update (`metric_weighting.py`).
        self._row_mask = row_mask
        self._in_program = in_program
        self._gradient_weight = gradient_weight
        # Set by Keras' steps on replicas (`loss_reduction.py`): the replica's share of the
        # global batch, and the row mask when it is handed to the loss as the sample weight;
        # whether a loss function returned one value for the whole shard (padding rows would enter it).
        self._loss_share = None
        self._padding_weight = None
        self._scalar_loss = False
        # Set by a custom step compiled with padded shards (`traced_function.py`): the ids of
        # variables whose writes leave the padding rows out (masked metrics and statistics, seeds).
        self._rows_left_out: Optional[set] = None

    def _leaves_rows_out(self, variables: Any) -> None:
        """Notes that this replica's writes of `variables` leave the padding rows out."""
        if self._rows_left_out is not None:
            self._rows_left_out.update(id(v) for v in variables)

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica's id among all replicas of all workers (this worker's come consecutively).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group)
            PerReplica:{
              0: 0,
              1: 1
            }
        """
        extended = self._strategy.extended
        if extended._num_workers == 1:
            return self._replica_id
        return self._replica_id + extended._worker_index * len(extended.worker_devices)

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of all workers, as `Strategy.num_replicas_in_sync`."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple:
        """The device of this replica, as a one-element tuple."""
        local = self._strategy.extended.worker_devices
        return (local[self._replica_id % len(local)],)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Reduces a nested structure across replicas; every replica gets the result.

        Differentiable on every backend: a loss built from it trains like one device.

        Args:
            reduce_op: `ks.ReduceOp.SUM` or `MEAN`, or `"sum"` / `"mean"`.
            value: A tensor or a nested structure of tensors.
            options: Accepted for compatibility; unused.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def replica_fn():
            ...     context = ks.get_replica_context()
            ...     value = keras.ops.convert_to_tensor(float(context.replica_id_in_sync_group + 1))
            ...     return context.all_reduce("sum", {"total": value})
            >>> [float(v["total"]) for v in strategy.experimental_local_results(strategy.run(replica_fn))]
            [3.0, 3.0]
        """
        op = ReduceOp.parse(reduce_op)
        return self._differentiable(lambda v: self._strategy.extended._all_reduce(self, op, v), value)

    def _differentiable(self, reduce: Callable[[Any], Any], value: Any) -> Any:
        """`reduce(value)`, a linear reduction over replicas, with the gradient a custom `train_step` needs.

        There each replica differentiates its shard's mean loss, and the
        optimizer weights its gradients by its share `w` of the batch
        afterwards. The reduction's backward pass must then send `w * dy`
        and return the result over `w` (Keras' own steps scale the loss
        first instead, where the plain reduction of the gradients is right).
        """
        weight = self._gradient_weight
        if weight is None:
            return reduce(value)

        def scaled(tensor: Any, factor: float) -> Any:  # `tensor` itself; its gradient times `factor`
            product = tensor * factor
            return ops.stop_gradient(tensor) + (product - ops.stop_gradient(product))

        sent = tree.map_structure(lambda t: scaled(t, 1.0 / weight if weight > 0 else 0.0), value)
        return tree.map_structure(lambda t: scaled(t, weight), reduce(sent))

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates a nested structure across replicas along `axis` (sizes may differ).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def replica_fn():
            ...     context = ks.get_replica_context()
            ...     rows = keras.ops.ones((context.replica_id_in_sync_group + 1, 2))  # 1 and 2 rows
            ...     return context.all_gather(rows, axis=0)
            >>> [tuple(v.shape) for v in strategy.experimental_local_results(strategy.run(replica_fn))]
            [(3, 2), (3, 2)]
        """
        return self._strategy.extended._all_gather(self, value, axis)

    def merge_call(self, merge_fn: Callable, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Calls `merge_fn(strategy, *args, **kwargs)` once in cross-replica context.

        Every replica passes its own `args`; `merge_fn` gets them as
        `PerReplica` values and its result goes back to every replica. This is
        how an optimizer applies one update for all replicas.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def replica_fn():
            ...     context = ks.get_replica_context()
            ...     return context.merge_call(
            ...         lambda strategy, ids: strategy.experimental_local_results(ids),
            ...         args=(context.replica_id_in_sync_group,))
            >>> strategy.run(replica_fn)
            (0, 1)
        """
        return self._strategy.extended._merge_call(self, merge_fn, args, kwargs or {})

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
