"""Device names and virtual CPU devices on every backend."""

import os
import subprocess
import sys

import pytest

import keras_strategies as ks
from keras_strategies.distribute.devices import canonical_device, default_compute_devices, resolve_devices


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cpu:0", "cpu:0"),
        ("/cpu:1", "cpu:1"),
        ("CPU", "cpu:0"),
        ("/device:GPU:1", "gpu:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:3", "cpu:3"),
        ("cuda:2", "gpu:2"),
    ],
)
def test_device_names_are_canonicalized_to_type_and_index(name, expected):
    assert canonical_device(name) == expected


def test_four_virtual_cpu_devices_from_the_environment():
    # tests/conftest.py sets KERAS_STRATEGIES_CPU_DEVICES=4 before the backend starts.
    assert ks.list_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert default_compute_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert resolve_devices(["/cpu:2", "cpu:0"]) == ["cpu:2", "cpu:0"]


def test_duplicate_empty_string_or_unknown_device_lists_are_refused():
    with pytest.raises(ValueError, match="Duplicate devices"):
        resolve_devices(["cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="at least one device"):
        resolve_devices([])
    with pytest.raises(ValueError, match=r"must be a list of device names, e.g. \['cpu:0'\]; got the string"):
        ks.MirroredStrategy("cpu:0")  # not the characters 'c', 'p', ...
    with pytest.raises(ValueError, match=r"Unknown device\(s\) \['cpu:9'\].*set_virtual_cpu_devices"):
        resolve_devices(["cpu:9"])


def test_changing_the_count_after_initialisation_raises_runtime_error():
    ks.list_devices()  # the backend has initialised its devices
    ks.set_virtual_cpu_devices(4)  # asking for what it has is fine
    with pytest.raises(RuntimeError, match="Cannot give .* 2 virtual CPU devices"):
        ks.set_virtual_cpu_devices(2)


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_virtual_cpu_counts_that_are_not_positive_ints_are_refused(count):
    with pytest.raises(ValueError, match="int >= 1"):
        ks.set_virtual_cpu_devices(count)


def _run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


def test_environment_variable_and_function_in_a_fresh_process():
    result = _run_python(
        "import keras_strategies as ks; print(ks.list_devices())", KERAS_STRATEGIES_CPU_DEVICES="3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['cpu:0', 'cpu:1', 'cpu:2']"
    result = _run_python(
        "import keras_strategies as ks; ks.set_virtual_cpu_devices(2); print(ks.list_devices())",
        KERAS_STRATEGIES_CPU_DEVICES="",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['cpu:0', 'cpu:1']"
    # A backend operation before the import: JAX and TensorFlow have fixed their devices (a
    # warning says so and the import goes on); PyTorch's CPU replicas are not fixed yet.
    result = _run_python(
        "import keras; keras.ops.ones((1,)); import keras_strategies as ks; print(ks.list_devices())",
        KERAS_STRATEGIES_CPU_DEVICES="3",
    )
    assert result.returncode == 0, result.stderr
    devices = result.stdout.strip().splitlines()[-1]
    if devices == "['cpu:0']":
        assert "KERAS_STRATEGIES_CPU_DEVICES=3 is set, but the backend had already set up its devices" in result.stderr
        assert "Import keras_strategies before any backend operation runs, or unset" in result.stderr
    else:
        assert devices == "['cpu:0', 'cpu:1', 'cpu:2']" and "already set up" not in result.stderr
    result = _run_python("import keras_strategies", KERAS_STRATEGIES_CPU_DEVICES="four")
    assert result.returncode != 0
    assert "KERAS_STRATEGIES_CPU_DEVICES='four' is invalid" in result.stderr
