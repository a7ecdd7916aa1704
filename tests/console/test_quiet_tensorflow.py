"""TensorFlow's start-up lines stay out of the console; everything else written to stderr stays."""

import os
import subprocess
import sys

import keras

from keras_strategies.console.quiet_tensorflow import NOISE, stderr_without_noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What TensorFlow 2.21 prints while it loads (twice per process), TF_CPP_MIN_LOG_LEVEL or not.
START_UP_LINES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1796265066.872405   31290 port.cc:153] oneDNN custom operations are on. You may see "
    b"slightly different numerical results due to floating-point round-off errors from different "
    b"computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
    b"I0000 00:00:1796262812.123919    5995 cpu_feature_guard.cc:227] This TensorFlow binary is optimized "
    b"to use available CPU instructions in performance-critical operations.\n"
    b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow "
    b"with the appropriate compiler flags.\n"
)


def test_only_tensorflows_start_up_lines_are_dropped(capfd):
    with stderr_without_noise():
        os.write(2, START_UP_LINES + b"E0000 a real error from a C++ library\n")
    assert capfd.readouterr().err == "E0000 a real error from a C++ library\n"
    assert all(NOISE.search(line) for line in START_UP_LINES.splitlines())


def test_keras_importing_tensorflow_after_keras_strategies_prints_no_start_up_lines():
    # Keras' set_random_seed imports TensorFlow on every backend; TensorFlow's own backend imports it with Keras.
    code = ("import sys, keras_strategies, keras; keras.utils.set_random_seed(1); "
            "print('tensorflow' in sys.modules); print('still printed', file=sys.stderr)")
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode().split() == ["True"]
    assert not [line for line in run.stderr.splitlines() if NOISE.search(line)], run.stderr.decode()
    assert b"still printed" in run.stderr
