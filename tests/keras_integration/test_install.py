"""The installed replacements are the registry's: complete, each keeping Keras' original."""

import inspect
import sys

from keras_strategies import keras_integration


def _replaced_in_keras() -> set:
    """Every function bound in Keras' own modules (and their classes) that keeps an original as `_ks_original`."""
    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("keras.src.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) and hasattr(value, "_ks_original"):
                # Listed where Keras defines it; public modules rebind the same function.
                if name == value._ks_original.__module__:
                    found.add((f"{name}.{attr}", value))
            elif inspect.isclass(value) and value.__module__ == name:
                for method, function in vars(value).items():
                    if hasattr(function, "_ks_original"):
                        found.add((f"{name}.{value.__name__}.{method}", function))
    return found


def _installed() -> list:
    return [patch for patch in keras_integration.replaced() if patch.when == "import" and patch.keras_function()]


def test_every_replacement_from_import_on_is_in_place_and_keeps_keras_original():
    for patch in _installed():
        assert patch.installed, f"{patch.target} is declared but not replaced"
        replacement = patch.current()
        assert hasattr(replacement, "_ks_original") and replacement._ks_original is not replacement


def test_every_replaced_function_is_a_declared_replacement():
    declared = set(keras_integration.replaced())
    for dotted, function in _replaced_in_keras():
        assert function._ks_patch in declared, f"{dotted} is replaced outside the patch registry"
        # Its target names this binding (or a public module's name of the same class).
        assert function._ks_patch.current() is function, dotted
    assert len(_installed()) >= 33


def test_install_is_idempotent():
    before = {(patch.target, patch.module): patch.current() for patch in _installed()}
    keras_integration.install()
    assert {(patch.target, patch.module): patch.current() for patch in _installed()} == before
