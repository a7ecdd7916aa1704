"""TensorFlow's start-up lines, kept out of the console when TensorFlow is first imported.

Keras imports TensorFlow even on JAX and PyTorch (`tf.data` inputs,
`keras.utils.set_random_seed`), and TensorFlow's C++ libraries then print
informational lines (oneDNN, CPU instructions) to stderr, twice, before its
logging is set up, so `TF_CPP_MIN_LOG_LEVEL` cannot hide them. `install()`
makes the first `import tensorflow` of the process run with stderr (file
descriptor 2) captured, and writes back every line except those.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator, Optional, Sequence

# The informational lines TensorFlow's libraries print while they load (nothing else is dropped).
NOISE = re.compile(
    rb"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|port\.cc:\d+\] oneDNN custom operations are on"
    rb"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use available CPU instructions"
    rb"|^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags"
)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def stderr_without_noise() -> Iterator[None]:
    """Runs its block with file descriptor 2 captured; writes back the lines that `NOISE` does not match."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no stderr to capture: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not NOISE.search(line)]
            _write_all(2, b"".join(kept))


class _FirstTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` through the other finders and loads it, once, under `stderr_without_noise`."""

    _finding = False

    def find_spec(self, name: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "tensorflow" or self._finding:
            return None
        self._finding = True  # find it through the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: object) -> None:
            # Only an import loads the module (`importlib.util.find_spec` alone, as torch does, does not).
            uninstall()
            try:
                with stderr_without_noise():
                    original(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the loader's own method again

        loader.exec_module = exec_module
        return spec


_finder = _FirstTensorFlowImport()


def install() -> None:
    """Filters the first `import tensorflow` of this process, unless TensorFlow is already imported."""
    if "tensorflow" not in sys.modules and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_finder)
