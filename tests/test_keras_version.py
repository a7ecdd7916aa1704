"""The supported Keras range: one statement of it, checked on import, declared in pyproject.toml.

The import checks run Python on a small stand-in `keras` package of another
version put first on the path: a real import of a Keras the package does not
support, in a process of its own.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest

from keras_strategies._version import KERAS_BELOW, KERAS_MIN, KERAS_REQUIREMENT, check_keras, keras_version_supported

REPO_ROOT = Path(__file__).resolve().parents[1]


def _python_with_keras(tmp_path, version, *args):
    """Runs `python *args` in a fresh process whose `import keras` finds a package of `version`."""
    package = tmp_path / "keras"
    package.mkdir()
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


@pytest.mark.parametrize("version", ["3.10.0", "3.13.2", "3.17.0", "4.0.0"])
def test_importing_the_package_with_an_unsupported_keras_names_the_version_and_the_fix(tmp_path, version):
    result = _python_with_keras(tmp_path, version, "-c", "import keras_strategies")
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: keras-strategies supports {KERAS_REQUIREMENT}; found keras {version} "
        f"(imported from {tmp_path / 'keras' / '__init__.py'}). "
        f"Install a supported version: pip install '{KERAS_REQUIREMENT}'"
    )


def test_the_check_comes_before_any_other_import_of_keras(tmp_path):
    """The stand-in has no `keras.src`: the check must fail first, not an import of Keras' internals."""
    result = _python_with_keras(tmp_path, "3.10.0", "-c", "import keras_strategies")
    assert "ModuleNotFoundError" not in result.stderr, result.stderr[-2000:]
    assert "keras-strategies supports" in result.stderr


def test_the_launcher_process_needs_no_keras_and_does_not_check_it(tmp_path):
    """The launcher imports no Keras: with an unsupported one installed it still starts (its workers check)."""
    result = _python_with_keras(tmp_path, "3.10.0", "-m", "keras_strategies.launch", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: python -m keras_strategies.launch"), result.stdout[:200]


def test_the_installed_keras_is_supported():
    assert keras_version_supported(keras.__version__), keras.__version__
    check_keras()  # raises if not


@pytest.mark.parametrize(
    "version, supported",
    [("3.13.9", False), ("3.14.0", True), ("3.14.1", True), ("3.15.1", True), ("3.15.2.dev2026010100", True),
     ("3.16.0", True), ("3.16.0.dev2026102704", True), ("3.17.0", False), ("3.17.0rc0", False),
     ("2.15.0", False), ("unknown", False)],
)
def test_version_strings_against_the_range(version, supported):
    assert keras_version_supported(version) is supported


def _pins(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):  # `-r requirements-docs.txt`: tools, not the tested set
            name = re.split(r"[<>=!~ \[]", line, maxsplit=1)[0].lower()
            pins[name] = line
    return pins


def test_pyproject_declares_the_same_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    keras_requirements = [d for d in project["dependencies"] if re.match(r"keras\b", d)]
    assert keras_requirements == [KERAS_REQUIREMENT]


def test_make_test_runs_the_lowest_and_the_highest_supported_keras():
    """requirements-keras-min.txt and requirements-keras-next.txt are requirements-dev.txt with only Keras
    moved: to the lowest supported release, and to a build of the newest supported minor. The dev set has
    the newest release, which is that minor once it is released."""
    dev = _pins(REPO_ROOT / "requirements-dev.txt")
    lowest = _pins(REPO_ROOT / "requirements-keras-min.txt")
    newest = _pins(REPO_ROOT / "requirements-keras-next.txt")
    assert lowest["keras"] == f"keras=={KERAS_MIN[0]}.{KERAS_MIN[1]}.0"
    assert keras_version_supported(dev["keras"].removeprefix("keras=="))
    newest_minor = f"{KERAS_BELOW[0]}.{KERAS_BELOW[1] - 1}."
    newest_pin = newest.get("keras", newest.get("keras-nightly", ""))
    assert newest_pin.split("==")[1].startswith(newest_minor), "requirements-keras-next.txt: the newest supported minor"
    assert keras_version_supported(newest_pin.split("==")[1])
    assert dev["keras"].startswith(f"keras=={KERAS_BELOW[0]}.{KERAS_BELOW[1] - 2}.") or dev["keras"].startswith(
        f"keras=={newest_minor}"), "dev set: the newest supported release"
    for pins in (lowest, newest):
        assert {k: v for k, v in pins.items() if not k.startswith("keras")} == {
            k: v for k, v in dev.items() if k != "keras"}
