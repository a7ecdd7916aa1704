"""TensorFlow compilation: `tf.function`; the caller's device scope places the ops."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def compile_function(fn: Callable) -> Callable:
    return tf.function(fn, reduce_retracing=True)


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
    return tf.function(fn)


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
