"""PyTorch gradients reported while the backward pass runs (`backend/torch/gradients.py`).

A multi-worker train step sends each bucket of gradients as soon as autograd
has computed it; these are the engine's reports it relies on.
"""

import gc
import weakref

import torch

from keras_strategies.backend.torch import gradients


class _Hooks:
    def __init__(self):
        self.events = []

    def before_backward(self, aux):
        self.events.append(("forward done", aux))

    def ready(self, index, grad):
        # Inside autograd's backward pass, with the gradient as `value_and_grad` returns it.
        self.events.append((index, torch._C._current_graph_task_id() >= 0, grad.clone()))


def _chain(leaves, x):
    """Three layers: the backward pass computes the last layer's gradient first."""
    h = torch.tanh(x @ leaves[0])
    h = torch.tanh(h @ leaves[1])
    out = h @ leaves[2]
    return (out ** 2).sum(), "aux"


def test_each_gradient_is_reported_inside_the_backward_pass_last_layer_first():
    torch.manual_seed(0)
    trainable = [torch.randn(4, 5), torch.randn(5, 6), torch.randn(6, 1)]
    x = torch.randn(3, 4)
    hooks = _Hooks()
    (objective, aux), grads = gradients.value_and_grad(_chain, hooks=hooks)(trainable, x)
    assert hooks.events[0] == ("forward done", "aux")
    reports = hooks.events[1:]
    assert [index for index, _, _ in reports] == [2, 1, 0]
    assert all(inside for _, inside, _ in reports)
    for index, _, grad in reports:
        torch.testing.assert_close(grad, grads[index])
    # The same values as without hooks.
    (plain_objective, _), plain = gradients.value_and_grad(_chain)(trainable, x)
    torch.testing.assert_close(objective, plain_objective)
    for grad, expected in zip(grads, plain):
        torch.testing.assert_close(grad, expected)


def test_a_variable_the_objective_does_not_reach_is_not_reported_and_gets_zeros():
    trainable = [torch.randn(4, 5), torch.randn(5, 6), torch.randn(6, 1), torch.randn(7)]
    hooks = _Hooks()
    _, grads = gradients.value_and_grad(_chain, hooks=hooks)(trainable, torch.randn(3, 4))
    assert sorted(event[0] for event in hooks.events[1:]) == [0, 1, 2]
    torch.testing.assert_close(grads[3], torch.zeros(7))


def _chain_with_output(leaves, x):
    objective, _ = _chain(leaves, x)
    return objective, objective * 1  # the aux keeps the autograd graph, as a step's predictions do


def test_the_hooks_are_removed_after_the_backward_pass():
    # Left on the leaves, they would tie the step's hooks object, which holds the forward pass's
    # outputs and through them the autograd graph and the leaves, into a reference cycle that
    # only the garbage collector frees (a step kept several graphs alive and ran slower).
    hooks = _Hooks()
    gc.disable()
    try:
        gradients.value_and_grad(_chain_with_output, hooks=hooks)(
            [torch.randn(4, 5), torch.randn(5, 6), torch.randn(6, 1)], torch.randn(3, 4))
        alive = weakref.ref(hooks)
        del hooks
        assert alive() is None
    finally:
        gc.enable()
