"""The table of replaced Keras methods is complete and true on the current backend."""

import importlib
import inspect
import sys

import keras

from keras_strategies import keras_integration


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            owner = inspect.getattr_static(owner, part) if inspect.isclass(owner) else getattr(owner, part)
        return owner
    raise ImportError(dotted)


def _replaced_in_keras() -> set:
    """Every function in Keras' own modules (and their classes) that keeps an original as `_ks_original`."""
    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("keras.src.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) and hasattr(value, "_ks_original"):
                # Listed where Keras defines it; public modules rebind the same function.
                if name == value._ks_original.__module__:
                    found.add(f"{name}.{attr}")
            elif inspect.isclass(value) and value.__module__ == name:
                for method, function in vars(value).items():
                    if hasattr(function, "_ks_original"):
                        found.add(f"{name}.{value.__name__}.{method}")
    return found


def test_every_listed_method_is_replaced_and_keeps_keras_original():
    for dotted, _ in keras_integration.replaced():
        replacement = _resolve(dotted)
        assert hasattr(replacement, "_ks_original"), f"{dotted} is listed but not replaced"
        assert replacement._ks_original is not replacement


def test_every_replaced_method_is_listed():
    listed = {dotted for dotted, _ in keras_integration.replaced()}
    unlisted = _replaced_in_keras() - listed
    assert not unlisted, f"replaced but missing from keras_integration's table: {sorted(unlisted)}"
    assert len(listed) >= 25


def test_install_is_idempotent():
    before = {dotted: _resolve(dotted) for dotted, _ in keras_integration.replaced()}
    keras_integration.install()
    assert {dotted: _resolve(dotted) for dotted, _ in keras_integration.replaced()} == before


def test_the_docstring_table_names_every_module():
    doc = keras_integration.__doc__
    for _, module in keras_integration.REPLACED:
        assert f"`{module}`" in doc
    assert f"backend/{keras.backend.backend()}/keras_hooks.py" in doc or keras.backend.backend() == "jax"
