"""PyTorch gradients: `torch.autograd.grad` over fresh leaves for the trainable values
(`torch.func.grad` inside a vectorised replica program)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from keras import ops
from keras.src import tree

from keras_strategies.backend.torch import vectorized


def value_and_grad(fn: Callable[..., tuple[Any, Any]],
                   hooks: Any = None) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`.

    `hooks` (outside vectorised replicas): `hooks.before_backward(aux)` runs
    after the forward pass, and `hooks.ready(i, grad)` as soon as the
    backward pass has computed gradient `i` (a train step sends gradients
    across workers meanwhile). Gradients the objective does not reach are not
    reported; the caller has them in `grads`.
    """

    def wrapped(trainable, *args):
        if vectorized.active():  # `torch.autograd.grad` cannot run inside `vmap`
            # The other arguments are closed over, not passed: passed, they would be wrapped into new
            # tensor objects (the loss hooks recognise the padding weight by identity).
            objective_of = lambda leaves: fn(leaves, *args)  # noqa: E731
            grads, (objective, aux) = torch.func.grad_and_value(objective_of, has_aux=True)(list(trainable))
            return (objective, aux), list(grads)
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in trainable]
        objective, aux = fn(leaves, *args)
        handles = []
        if hooks is not None:
            hooks.before_backward(aux)
            handles = [leaf.register_hook(functools.partial(_report, hooks.ready, index))
                       for index, leaf in enumerate(leaves) if leaf.requires_grad]
        differentiable = [leaf for leaf in leaves if leaf.requires_grad]
        try:
            found = iter(torch.autograd.grad(objective, differentiable, allow_unused=True))
        finally:
            for handle in handles:  # the hooks refer to the step: no reference cycle through the leaves
                handle.remove()
        grads = []
        for leaf in leaves:
            grad = next(found) if leaf.requires_grad else None
            grads.append(torch.zeros_like(leaf) if grad is None else grad)
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        return (objective.detach(), tree.map_structure(detach, aux)), grads

    return wrapped


def _report(ready: Callable[[int, Any], None], index: int, grad: torch.Tensor) -> None:
    ready(index, grad)  # returns None: the gradient itself is unchanged


def variables_value_and_grad(fn: Callable[..., Any], variables: list, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """`(fn(*args, **kwargs), d fn / d variables)` for Keras variables, with `torch.autograd.grad`."""
    targets = [getattr(v, "value", v) for v in variables]
    with torch.enable_grad():
        output = fn(*args, **kwargs)
        value = output[0] if isinstance(output, tuple) else output
        found = torch.autograd.grad(value, targets, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(targets, found)]
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tree.map_structure(detach, output), grads


# `x + y` of two partial sums (TensorFlow's `IndexedSlices` need more).
add = ops.add


def is_sliced(value: Any) -> bool:
    """Gradients here are always dense (TensorFlow's may be `IndexedSlices`)."""
    return False


def sliced_pieces(value: Any, shape: tuple, num_pieces: int, length: int) -> list:
    """Gradients here are never sliced (`is_sliced`): nothing to cut."""
    raise NotImplementedError("Gradients on this backend are dense; sliced_pieces is never needed.")
