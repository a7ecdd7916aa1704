"""The README's quick start runs as pasted, on the current backend.

The first ```python block after the "Quick start" heading is run in a fresh
interpreter (the backend and the device count are fixed when a process starts)
with 4 virtual CPU devices and this run's KERAS_BACKEND. It must exit cleanly,
train on 4 replicas and print a finite final loss.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import keras

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def quick_start_code() -> str:
    """The first ```python block after the "Quick start" heading of the README."""
    text = README.read_text(encoding="utf-8")
    heading = re.search(r"^#+\s*Quick start\s*$", text, re.MULTILINE | re.IGNORECASE)
    assert heading, "README.md has no 'Quick start' heading"
    block = re.search(r"^```python\n(.*?)^```", text[heading.end():], re.MULTILINE | re.DOTALL)
    assert block, "README.md has no ```python block after its 'Quick start' heading"
    return block.group(1)


def test_the_quick_start_runs_as_pasted(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(quick_start_code(), encoding="utf-8")
    env = dict(
        os.environ,
        KERAS_BACKEND=keras.backend.backend(),
        KERAS_STRATEGIES_CPU_DEVICES="4",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert re.search(r"^replicas: 4$", result.stdout, re.MULTILINE), result.stdout
    final = re.search(r"^final loss: (\S+)$", result.stdout, re.MULTILINE)
    assert final, result.stdout
    assert math.isfinite(float(final.group(1))), final.group(0)
