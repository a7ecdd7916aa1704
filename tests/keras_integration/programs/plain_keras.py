"""Plain Keras, never inside a strategy: prints what it does as JSON (argv[1] == "with-ks" imports keras-strategies first)."""

import json
import os
import sys
import tempfile

if sys.argv[1] == "with-ks":
    import keras_strategies  # noqa: F401

import keras
import numpy as np


def synchronized_batch_norm() -> dict:
    """Keras' own answer to BatchNormalization(synchronized=True): a layer, or its error."""
    try:
        layer = keras.layers.BatchNormalization(synchronized=True)
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return {"error": f"{type(error).__name__}: {error}"}
    return {"synchronized": layer.synchronized, "config": layer.get_config()}


def training() -> dict:
    """A small model with BatchNormalization, Dropout and Adam: fit, evaluate, predict, save and load."""
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(50, 6)).astype("float32")
    y = rng.normal(size=(50, 1)).astype("float32")
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2, seed=3),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
        "predict": np.asarray(model.predict(x, batch_size=16, verbose=0)).tolist(),
        "weights": [w.tolist() for w in model.get_weights()],
        "loaded": np.asarray(loaded.predict(x, batch_size=16, verbose=0)).tolist(),
    }


print(json.dumps({"synchronized_batch_norm": synchronized_batch_norm(), "training": training()}, default=str))
