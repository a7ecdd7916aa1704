"""On JAX, a train or test step on one worker is one program over the replicas' mesh.

Every device runs its replica, the replica sum, the optimizer update and the
metric update (`compiler.compile_replicated_step`); the model's variables stay
on every device of the mesh between steps, so a step sends only its batch, and
come back to one device when the loop ends. With `steps_per_execution`, a group
of steps whose batches have the same shards is one program too (`lax.scan`;
`tests/trainer/test_step_groups.py`). The results stay those of one device
(checked throughout `tests/trainer/`).
"""

import keras
import numpy as np

import keras_strategies as ks
from keras_strategies.backend.jax import optimizer as jax_optimizer
from keras_strategies.backend.jax import replicas
from keras_strategies.trainer import global_update

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data(rows=22):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 4)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def _devices_of(variable):
    return {d.id for d in variable.value.sharding.device_set}


def _count_dispatches(monkeypatch):
    """A dict whose "programs" counts the multi-device programs dispatched from now on."""
    counts = {"programs": 0}
    monkeypatch.setattr(replicas, "dispatch", _counting(replicas.dispatch, counts, "programs"))
    return counts


def _counting(function, calls, key):
    """`function`, counting its calls in `calls[key]` (a method too: `self` is the first argument)."""

    def counted(*args, **kwargs):
        calls[key] += 1
        return function(*args, **kwargs)

    return counted


class _Placement(keras.callbacks.Callback):
    """Where the model's and the optimizer's variables are after each step (without syncing anything)."""

    def __init__(self, model):
        super().__init__()
        self.variables = list(model.trainable_variables) + list(model.optimizer.variables)
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append({frozenset(_devices_of(v)) for v in self.variables})

    on_test_batch_end = on_train_batch_end


def test_between_steps_the_variables_stay_on_every_device_and_after_the_loop_on_the_first():
    x, y = _data()
    with ks.MirroredStrategy(DEVICES).scope():
        model = _model()
    placement = _Placement(model)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[placement],
              validation_data=(x, y))
    everywhere = {frozenset(range(4))}
    assert placement.seen and all(seen == everywhere for seen in placement.seen)
    assert {frozenset(_devices_of(v)) for v in placement.variables} == {frozenset({0})}


def test_central_storage_keeps_one_copy_of_each_variable_on_its_parameter_device():
    x, y = _data()
    with ks.CentralStorageStrategy(compute_devices=DEVICES, parameter_device="cpu:1").scope():
        model = _model()
    placement = _Placement(model)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[placement])
    assert placement.seen and all(seen == {frozenset({1})} for seen in placement.seen)


def test_once_traced_train_and_test_steps_make_no_python_call_to_the_update_or_the_metrics(monkeypatch):
    x, y = _data()
    with ks.MirroredStrategy(DEVICES).scope():
        model = _model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # traces full and partial batches
    first = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    calls = {"update": 0, "metrics": 0}
    for owner, name, key in ((jax_optimizer, "apply_gradients", "update"),
                             (global_update.GlobalUpdate, "update_metrics", "metrics")):
        monkeypatch.setattr(owner, name, _counting(getattr(owner, name), calls, key))
    before = int(model.optimizer.iterations.numpy())
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    again = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert int(model.optimizer.iterations.numpy()) == before + 6  # 3 steps an epoch did run
    assert calls == {"update": 0, "metrics": 0}
    assert history["loss"][1] < history["loss"][0] < first["loss"] and 0 < again["loss"] < history["loss"][1]


def test_a_step_sends_its_shards_each_time_and_the_small_arrays_that_repeat_once(monkeypatch):
    # Each host-to-device transfer costs about as much however small: the replicas' loss weights
    # (4 x 3) and the batch size stay on the mesh from the first step on, while the shards and
    # targets of every step travel (kept by value, shards of at most 64 elements would not).
    x, y = _data(192)
    with ks.MirroredStrategy(DEVICES).scope():
        model = _model()
    shapes = []
    device_put = replicas.jax.device_put

    def recording(values, *args, **kwargs):
        shapes.extend(tuple(np.shape(leaf)) for leaf in replicas.jax.tree_util.tree_leaves(values))
        return device_put(values, *args, **kwargs)

    monkeypatch.setattr(replicas.jax, "device_put", recording)
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    monkeypatch.undo()
    assert shapes.count((4, 16, 4)) == 6  # every step's shards of x
    assert shapes.count((4, 3)) == 1  # the loss weights of the replicas, the same in every step
    reference = _model()
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_custom_loop_after_fit_updates_the_variables_that_fit_left():
    x, y = _data(16)
    strategy = ks.MirroredStrategy(DEVICES)
    with strategy.scope():
        model = _model()
        reference = _model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loss_fn = keras.losses.MeanSquaredError(reduction="none")

    def step(inputs):
        features, targets = inputs

        def loss_of():
            return ks.compute_average_loss(loss_fn(targets, model(features)), global_batch_size=16)

        loss, grads = ks.value_and_grad(loss_of, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset((x, y)).batch(16))
    for batch in dataset:
        strategy.run(step, args=(batch,))
    reference.train_on_batch(x, y)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_every_compiled_step_is_dispatched_one_at_a_time_on_cpu_devices(monkeypatch):
    # Several multi-device programs in flight can deadlock XLA's CPU runtime (see
    # `tests/backend/jax/test_replicas.py`): the whole steps go through `replicas.dispatch` too.
    x, y = _data()
    with ks.MirroredStrategy(DEVICES).scope():
        model = _model()
    dispatched = _count_dispatches(monkeypatch)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(x, y))
    assert dispatched["programs"] == 12  # 3 train and 3 test steps an epoch


def test_on_cpu_devices_a_train_step_meets_once_after_the_backward_pass(monkeypatch):
    # XLA's CPU runtime sums a tuple all-reduce's operands one at a time, and schedules a
    # collective as early as its inputs allow: the gradients travel as one buffer, and the
    # predictions (for metrics on the global batch) as a sum of blocks, which XLA joins to the
    # gradients' sum at the end of the step instead of gathering them between the passes.
    x, y = _data(rows=32)
    with ks.MirroredStrategy(DEVICES).scope():
        model = _model()
    programs = []

    def keep(mesh, program, *args):
        programs.append((program, args))
        return program(*args)

    monkeypatch.setattr(replicas, "dispatch", keep)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    program, args = programs[0]
    hlo = program.lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    collectives = [line for line in entry.splitlines()
                   if any(f" {op}(" in line for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"))]
    assert len(collectives) == 1 and " all-reduce(" in collectives[0], collectives
    assert "f32[4,2,1]" in collectives[0] and "f32[50]" in collectives[0], collectives  # predictions; 49 gradients + loss
