"""The JAX engine's TPU runtime without a TPU: the chips of this host only, and clear refusals."""

import pytest

import keras_strategies as ks
from keras_strategies.backend.jax import tpu


def test_remote_tpu_names_are_refused_and_local_needs_no_connection(monkeypatch):
    for name in ("my-tpu", "grpc://10.0.0.1:8470"):
        with pytest.raises(ValueError, match=f"JAX cannot connect to the TPU '{name}': it runs on the chips"):
            ks.cluster_resolver.TPUClusterResolver(tpu=name)
    monkeypatch.setenv("TPU_NAME", "local")  # no name: TPU_NAME names it, as in TensorFlow
    resolver = ks.cluster_resolver.TPUClusterResolver()
    assert resolver.tf_resolver is None and resolver.num_accelerators() == {}


def test_device_assignment_and_spmd_partitioning_are_refused():
    for assignment, spmd in ((object(), False), (None, True)):
        with pytest.raises(NotImplementedError, match="takes no device assignment and no SPMD partitioning"):
            tpu.replica_devices({"master": "", "local": True}, assignment, spmd)
