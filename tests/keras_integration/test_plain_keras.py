"""Plain Keras with the package imported behaves exactly as without it (never inside a strategy)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras

PROGRAM = Path(__file__).with_name("programs") / "plain_keras.py"


def _run(mode: str) -> dict:
    result = subprocess.run([sys.executable, str(PROGRAM), mode], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_plain_keras_with_the_package_imported_equals_plain_keras_without_it():
    without, with_ks = _run("without-ks"), _run("with-ks")
    assert with_ks == without
    if keras.backend.backend() != "tensorflow":  # Keras' own refusal, unchanged
        assert "synchronized=True is only supported" in without["synchronized_batch_norm"]["error"]
    else:
        assert without["synchronized_batch_norm"]["synchronized"] is True
