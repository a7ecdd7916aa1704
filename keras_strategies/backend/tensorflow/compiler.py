"""TensorFlow compilation: `tf.function`; the caller's device scope places the ops."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import tensorflow as tf
from keras.src import tree
from tensorflow.python.ops import resource_variable_ops


def run_if(condition: Any, fn: Callable[[], Any]) -> Any:
    """Inside a program being traced: `fn()`'s outputs when `condition` holds, else zeros of the
    same structure; `fn`'s updates run only when it holds (`tf.cond`).

    What an engine with `Capabilities.exchanges_in_program` offers its in-program steps, so that a step whose
    workers must stop skips its update without a second program.
    """
    taken: dict = {}

    def when_true() -> Any:
        taken["outputs"] = tree.map_structure(tf.convert_to_tensor, fn())
        return taken["outputs"]

    def when_false() -> Any:  # traced after `when_true` (`cond_v2` traces the true branch first)
        return tree.map_structure(lambda t: tf.zeros([d or 0 for d in t.shape.as_list()], t.dtype), taken["outputs"])

    return tf.cond(condition, when_true, when_false)


def compile_function(fn: Callable) -> Callable:
    return tf.function(fn, reduce_retracing=True, autograph=False)


def compile_replicated_step(fn: Callable, variables: Sequence[Any], devices: Sequence[str],
                            keep_copies: bool, finish: Optional[Callable[[list], None]],
                            any_batch_size: bool = False) -> Callable:
    """Compiles a whole train, test or predict step around the replica program into one `tf.function`.

    `fn` runs the replicas (`make_replicated`), then the optimizer update and the
    metric update, each a `tf.function` of its own, which TensorFlow inlines: one
    dispatch per step instead of four (a 2-replica MLP train step went from about
    8 to 3 ms here). One trace per batch shape, as `compile_stateful`; a partial
    has no `__code__`, so TensorFlow counts the traces of each model's step on
    their own (see `make_replicated`). TensorFlow's variables stay where they
    live: `variables`, `devices` and `keep_copies` matter to JAX's engine only.

    A train step's `fn` returns `(logs, the non-trainable values of each replica
    with rows)`; `finish(those values)` assigns them inside a group of steps
    (`step_group`), where the caller assigns them after a single step.
    `any_batch_size` (a predict step, which no metric weighs by its static batch
    size): after a second batch shape, one trace serves every batch size, as
    Keras' own predict function (`reduce_retracing`), instead of one each.
    """
    step = tf.function(functools.partial(fn), autograph=False, reduce_retracing=any_batch_size)

    def one_step(per_replica: Any, batch: tuple, sizes: tuple) -> Any:
        output = fn(per_replica, batch, sizes)
        if finish is None:
            return output
        output, non_trainable = output
        finish(non_trainable)  # where the next step of the group reads them
        return output

    def steps_in_one_call(stacked_steps: tuple, sizes: tuple) -> Any:
        """The steps of a group (each leaf stacked on a leading step axis): all but the last in a
        `tf.while_loop` (as Keras' TF trainer loops over `steps_per_execution`), then the last,
        whose logs are the group's."""
        count = next(leaf for leaf in tree.flatten(stacked_steps) if leaf is not None).shape[0]
        step_at = lambda i: tree.map_structure(lambda leaf: None if leaf is None else leaf[i], stacked_steps)  # noqa: E731

        def body(i: Any) -> Any:
            one_step(*step_at(i), sizes)
            return i + 1

        tf.while_loop(lambda i: i < count - 1, body, [tf.constant(0)])
        return one_step(*step_at(count - 1), sizes)

    group_program = tf.function(steps_in_one_call, autograph=False)

    def group(steps: Sequence[tuple]) -> Any:
        """`steps` (each `(per_replica, batch, sizes)`, all of one signature) as one call: the logs
        after the last step."""
        stacked = tree.map_structure(
            lambda *leaves: None if leaves[0] is None else tf.stack(leaves), *[(p, b) for p, b, _ in steps]
        )
        return group_program(stacked, tuple(steps[0][2]))

    return _Step(step, group)


class _Step:
    """A whole compiled step (`compile_replicated_step`), and its group of steps (`step_group`)."""

    def __init__(self, step: Callable, group: Callable):
        self._step, self.group = step, group

    def __call__(self, *args: Any) -> Any:
        return self._step(*args)


def with_rows(value: Any, rows: int) -> Any:
    """`value` with a leading dimension of `rows`, also in a trace.

    The replicas of a compiled step see an unknown batch size
    (`replicas._any_batch_size`); the global predictions of a step compiled as
    a whole would keep it, and Keras weighs a per-output loss tracker by the
    static batch size (an unknown one counts a partial batch as one sample).
    """
    if tf.executing_eagerly() or not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
        return value
    return tf.ensure_shape(value, [rows] + value.shape.as_list()[1:])


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step: `tf.function`, as in TensorFlow's guides."""
    return tf.function(fn)


def compile_stateful(fn: Callable, state_variables: Sequence[Any]) -> Callable:
    """Compiles `fn`, which updates Keras variables in place, with `tf.function`.

    One trace per batch shape (as JAX compiles per shape), not a shape-relaxed
    one: Keras weights the per-output loss trackers of a model with several
    outputs by the static batch size (`shape[0]`), which a relaxed trace
    loses, counting a partial last batch as one sample.
    """
    return tf.function(fn, autograph=False)


def outside_compiled() -> Any:
    """Runs its block outside any `tf.function` being traced (TF's `init_scope`).

    Variables created there exist once, eagerly, whichever trace asked for them.
    """
    return tf.init_scope()


def _plain_variable(next_creator: Callable, **kwargs: Any) -> tf.Variable:
    """One `tf.Variable`, whatever `tf.distribute` strategy the caller runs under."""
    kwargs.pop("distribute_strategy", None)
    return resource_variable_ops.ResourceVariable(**kwargs)


@contextlib.contextmanager
def outside_replicas() -> Iterator[None]:
    """Runs its block outside any trace and outside TensorFlow's own replica context.

    A variable created there is one plain `tf.Variable`, as in a strategy's
    `scope()`: created in the replica context of the engine's
    `tf.distribute.MirroredStrategy` it would be a `MirroredVariable`, whose
    assignment from one replica (the chief's values) reaches that replica's
    copy only.
    """
    with tf.init_scope(), tf.variable_creator_scope(_plain_variable):
        yield


def settle(variables: Sequence[Any], device: str) -> None:
    """Nothing to bring back: compiled steps here leave variables where they live."""


def step_group(compiled_step: Callable) -> Optional[Callable]:
    """What runs a group of steps (`steps_per_execution`) as one call of one `tf.function`."""
    return getattr(compiled_step, "group", None)

