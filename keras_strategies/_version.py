"""The package's version and the Keras releases it supports.

The package replaces methods inside Keras (`keras.src`), whose internals change
between minor releases. `KERAS_REQUIREMENT` states the releases it is tested on
(`make test` runs the lowest and the highest); pyproject.toml declares the same
range, and importing the API checks the imported Keras against it before
anything else, so an unsupported Keras fails at once with the fix instead of
failing later, or training differently.
"""

from __future__ import annotations

import re

__version__ = "0.1.0"

KERAS_MIN = (3, 14)  # lowest supported release: 3.14.0
KERAS_BELOW = (3, 17)  # first release not yet supported
KERAS_REQUIREMENT = f"keras>={KERAS_MIN[0]}.{KERAS_MIN[1]},<{KERAS_BELOW[0]}.{KERAS_BELOW[1]}"


def keras_version_supported(version: str) -> bool:
    """Whether a Keras version string ("3.14.0", "3.15.1.dev2026...") lies in the supported range."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return bool(match) and KERAS_MIN <= (int(match[1]), int(match[2])) < KERAS_BELOW


def check_keras() -> None:
    """Raises ImportError naming the fix unless the imported Keras is a supported release."""
    import keras

    found = str(getattr(keras, "__version__", "of unknown version"))
    if not keras_version_supported(found):
        where = getattr(keras, "__file__", None) or "an unknown location"
        raise ImportError(
            f"keras-strategies supports {KERAS_REQUIREMENT}; found keras {found} (imported from {where}). "
            f"Install a supported version: pip install '{KERAS_REQUIREMENT}'"
        )
