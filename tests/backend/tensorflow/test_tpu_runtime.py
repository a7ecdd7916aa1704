"""The TensorFlow engine's TPU runtime without a TPU: TensorFlow's own resolver, its errors made plain."""

import pytest
import tensorflow as tf

import keras_strategies as ks


def test_a_tpu_address_resolves_with_tensorflow_s_resolver():
    resolver = ks.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.1:8470")
    assert isinstance(resolver.tf_resolver, tf.distribute.cluster_resolver.TPUClusterResolver)
    assert resolver.master() == "grpc://10.0.0.1:8470"
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:8470"]}


def test_tensorflow_s_runtime_errors_come_without_its_stack():
    resolver = ks.cluster_resolver.TPUClusterResolver(tpu="local")
    with pytest.raises(RuntimeError, match="^TPUs not found in the cluster.") as raised:
        ks.initialize_tpu_system(resolver)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert not isinstance(raised.value, tf.errors.OpError)
