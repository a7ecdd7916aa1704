"""The patch registry: every replaced Keras function is declared, reviewed against a release and in the docs' table."""

import copy
import importlib.util
from pathlib import Path

import keras
import pytest
from keras.src.utils import io_utils

from keras_strategies.backend.common import patches
from keras_strategies.keras_integration import chief_only

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "keras_strategies"


@pytest.fixture(scope="module")
def script():
    """`scripts/keras_patches.py`, with every module of the package this backend uses imported."""
    spec = importlib.util.spec_from_file_location("keras_patches", ROOT / "scripts" / "keras_patches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.import_every_module()
    return module


def test_every_replaced_function_matches_a_reviewed_release(script):
    assert len(patches.registered()) >= 35
    assert patches.unreviewed() == []


def test_a_replaced_function_whose_code_changed_fails_the_review_with_its_name(script):
    target = "keras.src.losses.loss.reduce_values"
    known = copy.deepcopy(patches.known_fingerprints())
    assert known[target]
    known[target] = {"0" * 16: ["keras 3.0.0 (jax)"]}  # as if only an older release were reviewed
    messages = patches.unreviewed(known)
    assert len(messages) == 1
    assert messages[0].startswith(f"{target} (replaced by keras_strategies.keras_integration.loss_reduction) differs")
    assert "keras 3.0.0 (jax)" in messages[0]


def test_the_docs_table_lists_exactly_this_backends_replacements(script):
    backend = keras.backend.backend()
    page = script.page_entries(script.PAGE.read_text())
    # Every declared replacement of this backend, present in the installed release or not (the
    # page is the same whatever the release).
    ours = {(row["declared"], row["module"]): row for row in script.rows()}
    listed = {key for key, (backends, _, _) in page.items() if backends == "all" or backend in backends.split(", ")}
    assert listed == set(ours), "regenerate the page with `python scripts/keras_patches.py`"
    for key, row in ours.items():
        assert page[key][1:] == (script.in_place(row["when"]), row["why"]), key


def test_only_the_registry_assigns_keras_functions():
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "backend" / "common" / "patches.py":
            continue
        assert "_ks_original =" not in path.read_text(), f"{path} replaces a function outside the registry"


def test_a_replacement_in_place_for_a_block_puts_keras_function_back_after_it():
    keras_print = io_utils.print_msg
    with chief_only.quiet(True):
        assert io_utils.print_msg is not keras_print and io_utils.print_msg._ks_original is keras_print
        with chief_only.quiet(True):  # nested blocks share the replacement
            io_utils.print_msg("not shown")
        assert io_utils.print_msg._ks_original is keras_print
    assert io_utils.print_msg is keras_print

