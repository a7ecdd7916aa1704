"""Handling part of a list of values one way and the rest another, keeping the list's order.

Reductions treat TensorFlow's `IndexedSlices` (an Embedding's gradients) apart
from dense tensors: slices are gathered or concatenated, dense tensors packed
and summed. Both parts run in a fixed order (the special part first), so that
every worker issues its collectives in the same sequence.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def apply_partitioned(values: Sequence[Any], predicate: Callable[[Any], bool], special: Callable[[list], list],
                      rest: Callable[[list], list]) -> list:
    """`special` of the values where `predicate` holds, then `rest` of the others, in `values`' order.

    Each function takes a list and returns one result per item; an empty part is not passed.
    """
    chosen = [i for i, value in enumerate(values) if predicate(value)]
    taken = set(chosen)
    others = [i for i in range(len(values)) if i not in taken]
    outputs: list = [None] * len(values)
    for indices, fn in ((chosen, special), (others, rest)):
        if indices:
            for i, result in zip(indices, fn([values[i] for i in indices])):
                outputs[i] = result
    return outputs
