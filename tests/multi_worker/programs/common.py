"""What the multi-worker test programs and the single-process references share."""

import keras
import numpy as np
from keras import ops

N, GLOBAL_BATCH = 50, 16  # 50 = 3 full global batches + a partial one of 2


def data(n=N):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def build_model():
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=1.0), loss="mse", metrics=["mae"])
    return model


class BatchPenalty(keras.layers.Layer):
    """A data-dependent `add_loss` term: a mean over the rows the layer sees."""

    def call(self, inputs):
        self.add_loss(0.05 * ops.mean(ops.square(inputs)))
        return inputs


def batch_normalization(synchronized):
    """Keras' layer with `synchronized=True` in a strategy's scope; outside every scope (the
    one-device reference), where Keras refuses the argument off TensorFlow, ks' layer."""
    import keras_strategies as ks

    if synchronized and not ks.has_strategy():
        return ks.layers.SyncBatchNormalization()
    return keras.layers.BatchNormalization(synchronized=synchronized)


def build_penalty_model():
    """Synchronized BatchNormalization and a data-dependent `add_loss` term, which padding rows
    would enter: on JAX its steps on uneven shards run eagerly, on unpadded shards."""
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(8, use_bias=False),
        batch_normalization(True),
        keras.layers.Activation("tanh"),
        BatchPenalty(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def uneven_run(model, x, y):
    """`keras_run` with a global batch of 15: uneven shards at every step (the last batch has 5 rows)."""
    history = model.fit(x, y, batch_size=15, epochs=2, shuffle=False, verbose=0)
    return {
        "loss": history.history["loss"],
        "mae": history.history["mae"],
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=15, verbose=0),
        "predict": np.asarray(model.predict(x, batch_size=15, verbose=0)),
    }


def build_sync_bn_model(synchronized=True):
    """Batch statistics over the whole global batch, i.e. over every replica of every worker."""
    model = keras.Sequential([
        keras.Input((5,)),
        # No bias before BatchNormalization: its gradient is rounding noise, which Adam would amplify.
        keras.layers.Dense(8, use_bias=False),
        batch_normalization(synchronized),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


class OwnSteps(keras.Model):
    """Overrides every step and defers to Keras' own (the signature differs per backend).

    Its inputs are scaled to unit rows first, which is NaN on a row of zeros: a worker
    without rows of a batch must run its placeholder step on a real row.
    """

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3))
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x / ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))))

    def train_step(self, *args):
        return super().train_step(*args)

    def test_step(self, *args):
        return super().test_step(*args)

    def predict_step(self, *args):
        return super().predict_step(*args)


def build_own_steps_model():
    model = OwnSteps()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05, clipnorm=1.0), metrics=["mae"])
    model(np.zeros((1, 5), "float32"))
    return model


def embedding_data(n=N):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 20, size=(n, 6)).astype("int32")  # each batch repeats tokens
    return tokens, rng.normal(size=(n, 1)).astype("float32")


def build_embedding_model():
    """An Embedding trained with Adam. On TensorFlow its gradient is an IndexedSlices, one slice
    per token, which Keras' Adam squares slice by slice: not the same as their dense sum."""
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    return model


def embedding_run(model, x, y):
    """`keras_run` on `embedding_data()` (`x`, `y` are the Dense models' data)."""
    return keras_run(model, *embedding_data())


def scaled_data(n=N):
    """`data()` with targets x10: under a loss scale of 2^122 their gradients overflow."""
    x, y = data(n)
    return x, y * 10.0


def build_scaled_averaged_model():
    """`build_model` with a LossScaleOptimizer around an Adam keeping use_ema's averages: on
    `scaled_data()` the first scales overflow the gradients (those steps are skipped and the scale
    halved) and the scale doubles after 2 finite steps; the averages overwrite the weights every 3
    steps and when `fit` ends."""
    model = build_model()
    inner = keras.optimizers.Adam(0.01, global_clipnorm=1.0, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**122, dynamic_growth_steps=2),
                  loss="mse", metrics=["mae"])
    return model


def build_loss_scaled_model():
    """`build_model` with its Adam in a LossScaleOptimizer whose scale doubles every 2 steps (the
    gradients stay finite): a worker that lost its scale would unscale by another one."""
    model = build_model()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=1.0),
                                                                initial_scale=2.0**8, dynamic_growth_steps=2),
                  loss="mse", metrics=["mae"])
    return model


def build_mixed_model(policy):
    """`build_model` under a mixed-precision policy: predictions and activations in half floats.

    A loss scale of 2^8, not 2^15: at 2^15 a float16 gradient summed over the whole batch
    overflows in one process where the workers' half-batch sums do not (docs/guide/mixed-precision.md).
    """
    keras.config.set_dtype_policy(policy)
    try:
        model = build_model()
        optimizer = keras.optimizers.Adam(0.01, global_clipnorm=1.0)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**8)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        return model
    finally:
        keras.config.set_dtype_policy("float32")


def keras_run(model, x, y):
    """`fit` (2 unshuffled epochs) / `evaluate` / `predict`: what the tests compare with one process."""
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return {
        "loss": history.history["loss"],
        "mae": history.history["mae"],
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
        "predict": np.asarray(model.predict(x, batch_size=GLOBAL_BATCH, verbose=0), "float32"),  # NumPy cannot save bfloat16
    }


def evaluate_first_run(model, x, y):
    """`evaluate` on a model never trained, then one epoch of `fit`: the first train step comes
    after steps that have already agreed how the workers exchange their rows."""
    return {
        "evaluate_first": model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
        "loss": model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0).history["loss"],
        "weights": model.get_weights(),
    }


def dropout_counts(strategy):
    """One `train_on_batch` of a Dropout model on a row of ones per replica, in `strategy`.

    The zero kernel's SGD(1) update is 4 / B times, per feature, the number of
    rows whose dropout mask kept it. Returns those counts and the weights.
    """
    rows = strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)), keras.layers.Dropout(0.5, seed=5),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(1.0))
    model.train_on_batch(np.ones((rows, 64), "float32"), np.ones((rows, 1), "float32"))
    return np.rint(model.get_weights()[0][:, 0] * rows / 4.0), model.get_weights()


class StopsEarly(keras.callbacks.Callback):
    """Stops `fit` after batch 1 and `evaluate` / `predict` after batch 0, when `active`.

    Active on one worker only, as a time limit would be: every worker must stop at the same step.
    """

    def __init__(self, active=True):
        super().__init__()
        self.active = active

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = self.model.stop_training or (self.active and batch == 1)

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = self.model.stop_evaluating or self.active

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = self.model.stop_predicting or self.active


def stopped_run(model, x, y, active=True):
    """`fit` / `evaluate` / `predict`, each stopped by `StopsEarly(active)` within its first epoch."""
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[StopsEarly(active)])
    return {
        "epochs": len(history.history["loss"]),
        "loss": history.history["loss"],
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[StopsEarly(active)]),
        "predict": model.predict(x, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[StopsEarly(active)]),
    }


def build_two_output_model():
    """Dict outputs, each loss with its own reduction: the torch tree orders dicts two ways."""
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, {"r": keras.layers.Dense(1, name="r")(hidden),
                                 "c": keras.layers.Dense(1, activation="sigmoid", name="c")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.01), metrics={"c": ["accuracy"]},
                  loss={"r": keras.losses.MeanSquaredError(reduction="sum"),
                        "c": keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight")})
    return model


def reshuffled_run(model, x, y):
    """`fit` on a seeded `tf.data` dataset that reshuffles on every pass (each epoch a new order)."""
    import tensorflow as tf

    tf.random.set_seed(7)  # TF's order depends on the global seed too (the workers seeded theirs differently)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=3).batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=3, verbose=0)
    return {"loss": history.history["loss"], "weights": model.get_weights()}


def seeded_shuffle_run(model, x, y, seed):
    """`fit(shuffle=True)` with validation after `keras.utils.set_random_seed(seed)`.

    The workers pass different seeds: every worker draws the chief's order.
    TensorFlow's `tf.data` pipeline shuffles arrays from TF's global seed,
    which must be the same on every worker (as in TF's guide) to be read.
    """
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    tf.random.set_seed(300)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=True, validation_data=(x[:10], y[:10]),
                        verbose=0)
    return {"loss": history.history["loss"], "val_loss": history.history["val_loss"], "weights": model.get_weights()}


def two_output_run(model, x, y):
    """`fit` and `evaluate` with dict targets (`c` must stay in [0, 1]) and sample weights.

    45 rows in full batches of 15, split unevenly (8 + 7, or 4 + 4 + 4 + 3): on a partial
    batch Keras' TensorFlow trainer logs per-output losses differently (docs/guide/limits.md).
    """
    x, y = x[:45], y[:45]
    targets = {"r": y, "c": (y > 0).astype("float32")}
    weights = np.random.default_rng(3).uniform(0.2, 2.0, size=(len(x),)).astype("float32")
    history = model.fit(x, targets, sample_weight=weights, batch_size=15, epochs=2, shuffle=False, verbose=0)
    return {
        **{key: history.history[key] for key in ("loss", "c_loss", "r_loss", "c_accuracy")},
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, targets, sample_weight=weights, batch_size=15, verbose=0),
    }


def global_batch_sizes(n=N, batch=GLOBAL_BATCH):
    return [batch] * (n // batch) + ([n % batch] if n % batch else [])


def guide_loop(strategy, model, optimizer, dataset, ks, n=N):
    """The distributed-training guide's custom loop, passing each step's actual global batch size
    to `compute_average_loss` so that the partial last batch is exact too."""
    loss_object = keras.losses.MeanSquaredError(reduction="none")
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs, global_batch_size):
        features, labels = inputs

        def loss_fn():
            per_example = loss_object(labels, model(features, training=True))
            loss = ks.compute_average_loss(per_example, global_batch_size=global_batch_size)
            if model.losses:
                loss = loss + ks.scale_regularization_loss(ops.sum(ops.stack(model.losses)))
            return loss

        loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @ks.function
    def distributed_train_step(dist_inputs, global_batch_size):
        per_replica_losses = strategy.run(train_step, args=(dist_inputs, global_batch_size))
        return strategy.reduce(ks.ReduceOp.SUM, per_replica_losses, axis=None)

    return [float(ops.convert_to_numpy(distributed_train_step(inputs, size)))
            for inputs, size in zip(dist_dataset, global_batch_sizes(n))]


def sgd():
    return keras.optimizers.SGD(0.05)


def adam():
    return keras.optimizers.Adam(0.05)


# The guide's custom loop, per model: (build, optimizer, data). With Adam, the optimizer's
# slots are created inside the compiled step (`ks.function`) on its first call.
LOOPS = {
    "loop": (build_model, sgd, data),
    "bn_loop": (build_sync_bn_model, sgd, data),
    "embedding_loop": (build_embedding_model, adam, embedding_data),
}


WIDE = 512  # a 512 x 512 float32 kernel is 1 MiB: its gradient is reduced on its own, without a copy


def wide_data(n=N):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, WIDE)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def build_wide_model():
    model = keras.Sequential([keras.Input((WIDE,)), keras.layers.Dense(WIDE, activation="tanh"),
                              keras.layers.Dense(WIDE, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    return model


def collective_values(worker):
    """What worker `worker` sums across workers: large and small, float and int, 0-d and empty."""
    rng = np.random.default_rng(worker)
    return [
        rng.normal(size=(600, 600)).astype("float32"),  # 1.4 MB: on its own
        rng.normal(size=(5,)).astype("float32"),
        rng.integers(-50, 50, size=(7,)).astype("int32"),
        np.array(rng.normal(), "float32"),
        np.zeros((0, 3), "float32"),
        rng.normal(size=(300, 1000)).astype("float32"),  # 1.1 MB: on its own
    ]


def scatter_values(worker):
    """What worker `worker` reduce-scatters: each of `collective_values` as two rows, one per worker."""
    return [np.stack([value * (worker + 1), value - worker]) for value in collective_values(worker)]


PREEMPTION_STEPS = 8  # the custom loop of the preemption test: 2 passes over the 4 batches of `data()`


def loop_step(strategy, model, optimizer, ks):
    """`step(k)`: the guide's distributed step on batch `k % 4` of `data()` (the last has 2 rows)."""
    x, y = data()
    batches = [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]
    loss_object = keras.losses.MeanSquaredError(reduction="none")

    def train_step(inputs, global_batch_size):
        features, labels = inputs

        def loss_fn():
            return ks.compute_average_loss(loss_object(labels, model(features, training=True)),
                                           global_batch_size=global_batch_size)

        loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(k):
        batch = batches[k % len(batches)]
        inputs = next(iter(strategy.experimental_distribute_dataset([batch])))
        return strategy.reduce(ks.ReduceOp.SUM, strategy.run(train_step, args=(inputs, len(batch[0]))), axis=None)

    return step
