"""One-device training loops written without keras_strategies: what the custom-loop tests compare with.

Each backend takes its gradient step its own way: `tf.GradientTape` on TensorFlow,
`jax.value_and_grad` over `model.stateless_call` and `optimizer.stateless_apply` on JAX,
`torch.autograd.grad` on PyTorch. The model and the optimizer must be created outside every
strategy scope, where Keras' own code runs unchanged; no strategy, `ks.function`,
`ks.value_and_grad`, `ks.compute_average_loss` or distributed dataset is involved, so a bug in
those cannot cancel out of a comparison.
"""

import keras
from keras import ops


def train(model, optimizer, loss_fn, batches):
    """Takes one optimizer step per batch on one device and returns each step's loss (floats).

    `batches` are tuples of arrays whose first item is the model's input. `loss_fn(batch,
    predictions, model_losses)` gives the step's scalar loss in `keras.ops` from the batch (as
    backend tensors), the model's predictions in training mode and the losses of that call
    (`model.losses`: regularizers and `add_loss` terms). The model's and the optimizer's
    variables are updated in place (moving statistics included).
    """
    steps = {"tensorflow": _train_tensorflow, "jax": _train_jax, "torch": _train_torch}[keras.backend.backend()]
    return steps(model, optimizer, loss_fn, [tuple(ops.convert_to_tensor(a) for a in batch) for batch in batches])


def _train_tensorflow(model, optimizer, loss_fn, batches):
    import tensorflow as tf

    losses = []
    for batch in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(batch, model(batch[0], training=True), model.losses)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    return losses


def _train_jax(model, optimizer, loss_fn, batches):
    import jax

    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    optimizer_state = [v.value for v in optimizer.variables]

    def loss_and_state(trainable, non_trainable, batch):
        predictions, non_trainable, model_losses = model.stateless_call(
            trainable, non_trainable, batch[0], training=True, return_losses=True)
        return loss_fn(batch, predictions, model_losses), non_trainable

    @jax.jit
    def step(trainable, non_trainable, optimizer_state, batch):
        (loss, non_trainable), grads = jax.value_and_grad(loss_and_state, has_aux=True)(trainable, non_trainable, batch)
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        return loss, trainable, non_trainable, optimizer_state

    losses = []
    for batch in batches:
        loss, trainable, non_trainable, optimizer_state = step(trainable, non_trainable, optimizer_state, batch)
        losses.append(float(loss))
    for variables, values in ((model.trainable_variables, trainable), (model.non_trainable_variables, non_trainable),
                              (optimizer.variables, optimizer_state)):
        for variable, value in zip(variables, values):
            variable.assign(value)
    return losses


def _train_torch(model, optimizer, loss_fn, batches):
    import torch

    losses = []
    for batch in batches:
        loss = loss_fn(batch, model(batch[0], training=True), model.losses)
        variables = model.trainable_variables
        values = [v.value for v in variables]
        grads = torch.autograd.grad(loss, values, allow_unused=True)
        grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, values)]
        with torch.no_grad():
            optimizer.apply(grads, variables)
        losses.append(float(loss.detach()))
    return losses


def binary_crossentropy_from_logits(labels, logits):
    """Per example: the mean over the last axis of `max(z, 0) - z y + log(1 + exp(-|z|))`."""
    labels = ops.cast(labels, logits.dtype)
    return ops.mean(ops.relu(logits) - logits * labels + ops.log1p(ops.exp(-ops.abs(logits))), axis=-1)


def squared_error(labels, predictions):
    """Per example: the mean over the last axis of the squared error."""
    return ops.mean(ops.square(predictions - ops.cast(labels, predictions.dtype)), axis=-1)


def average_loss(per_example, global_batch_size=None, regularization=True):
    """`loss_fn` for `train`: the sum of `per_example(labels, predictions)` over the batch divided
    by `global_batch_size` (the batch's rows if None), plus the call's losses if `regularization`."""

    def loss_fn(batch, predictions, model_losses):
        size = ops.shape(batch[0])[0] if global_batch_size is None else global_batch_size
        loss = ops.sum(per_example(batch[1], predictions)) / size
        if regularization and model_losses:
            loss = loss + ops.sum(ops.stack(model_losses))
        return loss

    return loss_fn


def split(arrays, batch_size, steps=None):
    """`arrays` (a tuple) in consecutive batches of `batch_size` rows, the last one partial;
    with `steps`, that many batches, starting again from the first row after the last batch."""
    rows = len(arrays[0])
    starts = list(range(0, rows, batch_size))
    if steps is not None:
        starts = [starts[i % len(starts)] for i in range(steps)]
    return [tuple(a[start:start + batch_size] for a in arrays) for start in starts]
