"""TensorFlow's "Multi-worker training with Keras" tutorial with `ks` in place of `tf.distribute`.

Verbatim apart from `s/tf.distribute/ks/`, synthetic MNIST-shaped data (no
download) and fewer steps. https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import keras_strategies as ks
import keras as tf_keras  # the tutorial's `tf.keras`


def mnist_dataset(batch_size):
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, size=(2048, 28, 28)).astype("uint8")
    y_train = (x_train[:, 14, :14].mean(axis=1) // 26).astype(np.int64) % 10
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf_keras.Sequential([
        tf_keras.layers.InputLayer(shape=(28, 28)),
        tf_keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf_keras.layers.Conv2D(32, 3, activation='relu'),
        tf_keras.layers.Flatten(),
        tf_keras.layers.Dense(128, activation='relu'),
        tf_keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf_keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])
    return model


per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

strategy = ks.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()

multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=8)

# Model saving, as in the tutorial: the chief saves to the real path, the others to temporary ones.
model_path = os.path.join(sys.argv[1], 'keras-model.keras')


def _is_chief(task_type, task_id):
    # Note: there are two possible `TF_CONFIG` configurations.
    #   1) In addition to `worker` tasks, a `chief` task type is use;
    #      in this case, the `chief` task should save the model.
    #   2) Only `worker` task type is used; in this case, worker 0 is
    #      regarded as the chief.
    return (task_type == 'chief' or (task_type == 'worker' and task_id == 0))


def _get_temp_dir(dirpath, task_id):
    base_dirpath = 'workertemp_' + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)
multi_worker_model.save(write_model_path)
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

loaded_model = tf_keras.models.load_model(model_path)
np.savez(os.path.join(sys.argv[1], f"weights_{task_id}.npz"), *multi_worker_model.get_weights())
print("RELOADED", len(loaded_model.get_weights()), flush=True)
