"""TensorFlow: a model that reads strings (`TextVectorization`) from a `tf.data` dataset, under a strategy.

`evaluate` and `predict` read the dataset through NumPy's iterator, whose
object arrays of bytes Keras cannot build a model from ("Invalid dtype:
object"); they now read it through `tf.data`, as `fit` does.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_strategies as ks
from trainer.test_loops import TOL

TEXTS = np.array(["a b c", "b c d", "c d e", "d e f", "a a b", "f e d", "b b b"] * 3 + ["a"])


def test_fit_evaluate_and_predict_of_a_text_model_equal_one_device():
    targets = np.random.default_rng(0).normal(size=(len(TEXTS), 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((TEXTS[:, None], targets)).batch(10)  # 10, 10, 2 rows
    vectorize = keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
    vectorize.adapt(TEXTS)

    def build():
        inputs = keras.Input((1,), dtype="string")
        model = keras.Model(inputs, keras.layers.Dense(1)(vectorize(inputs)))
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), metrics=["mae"])
        return model

    reference = build()
    with ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    expected, got = reference.fit(dataset, epochs=2, verbose=0).history, model.fit(dataset, epochs=2, verbose=0).history
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
    np.testing.assert_allclose(model.evaluate(dataset, verbose=0), reference.evaluate(dataset, verbose=0), **TOL)
    np.testing.assert_allclose(model.predict(dataset, verbose=0), reference.predict(dataset, verbose=0), **TOL)
