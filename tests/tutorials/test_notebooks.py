"""Executes every tutorial notebook (tutorials/*.ipynb) top to bottom on the current backend.

`make test` runs pytest once per KERAS_BACKEND; the notebook kernel inherits
that backend (and the rest of the environment) and runs with this
interpreter, through a temporary "python3" kernelspec that points at
`sys.executable`. A notebook passes when no cell raises and its last code
cell prints the maximum absolute weight difference against a single-device
run, below 1e-4.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import keras
import pytest

import ipykernel  # noqa: F401  (the kernel that runs the notebooks; a missing one must fail, not skip)
import nbclient
import nbformat

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
WEIGHT_DIFFERENCE = re.compile(r"max abs weight difference[^:\n]*:\s*([-+0-9.eE]+|nan|inf)", re.IGNORECASE)
TOLERANCE = 1e-4


@pytest.fixture
def kernel_environment(tmp_path, monkeypatch):
    """A "python3" kernelspec running this interpreter, found first on JUPYTER_PATH."""
    jupyter_dir = tmp_path / "jupyter"
    spec_dir = jupyter_dir / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("KERAS_BACKEND", keras.backend.backend())
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    work_dir = tmp_path / "cwd"
    work_dir.mkdir()
    return work_dir


def _text_outputs(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def test_the_tutorials_directory_holds_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {TUTORIALS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    executed = [i for i, cell in enumerate(notebook.cells)
                if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not executed, f"{path.name}: code cells {executed} are stored with outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_matches_single_device(path, kernel_environment):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, startup_timeout=180, kernel_name="python3",
        resources={"metadata": {"path": str(kernel_environment)}},
    )
    started = time.monotonic()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed on the {keras.backend.backend()} backend:\n{error}", pytrace=False)
    print(f"{path.name} [{keras.backend.backend()}]: {time.monotonic() - started:.1f}s")

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, f"{path.name} has no code cells"
    final_output = _text_outputs(code_cells[-1])
    match = WEIGHT_DIFFERENCE.search(final_output)
    assert match, f"{path.name}: the last code cell must print the max abs weight difference; it printed:\n{final_output}"
    assert float(match.group(1)) < TOLERANCE, final_output
