"""The API reference: every public name is on a page of docs/reference, with a docstring and an example.

The pages are mkdocstrings directives (`::: keras_strategies.MirroredStrategy`); this
test reads them as text, so it needs no mkdocs. The `>>>` examples of the public
docstrings run here on the current backend, with `ks`, `keras` and `np` imported
and 4 virtual CPU devices (tests/conftest.py), as the reference's index page says.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import linecache
import os
import pathlib
import re
import types

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies import launch as launch_module

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference"
MODULES = {
    "keras_strategies": ks,
    "keras_strategies.experimental": ks.experimental,
    "keras_strategies.experimental.partitioners": ks.experimental.partitioners,
    "keras_strategies.cluster_resolver": ks.cluster_resolver,
    "keras_strategies.layers": ks.layers,
    "keras_strategies.launch": launch_module,
}
PUBLIC = [(module_path, name) for module_path, module in MODULES.items() for name in module.__all__]

# The strategy methods and the like that a custom loop uses: each has its own example.
MEMBERS_WITH_EXAMPLES = {
    ks.Strategy: [
        "scope", "run", "reduce", "gather", "experimental_distribute_dataset",
        "distribute_datasets_from_function", "experimental_local_results", "num_replicas_in_sync",
        "extended", "make_experimental_numpy_dataset", "experimental_distribute_values_from_function",
    ],
    ks.StrategyExtended: ["reduce_to", "batch_reduce_to", "broadcast_to", "update", "worker_devices"],
    ks.ReplicaContext: ["all_reduce", "all_gather", "merge_call", "replica_id_in_sync_group"],
    ks.DistributedIterator: ["get_next", "get_next_as_optional"],
    ks.InputContext: ["get_per_replica_batch_size"],
}


def _has_example(doc: str) -> bool:
    return "```python" in doc or ">>>" in doc


def _resolve(path: str):
    """The object a directive names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(path)


def _directives() -> list[tuple[str, str, object]]:
    """`(page, path, members)` of every `::: path` directive; `members` is None (all), False or a list."""
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = re.match(r"^:::\s+(\S+)\s*$", line)
            if not match:
                continue
            members: object = None
            for option in lines[i + 1:]:
                if option.strip() and not option.startswith(" "):
                    break
                value = re.match(r"^\s+members:\s*(.*)$", option)
                if value:
                    text = value.group(1).strip()
                    members = False if text == "false" else [m.strip().strip("\"'") for m in text.strip("[]").split(",")]
            found.append((page.name, match.group(1), members))
    return found


def _documented() -> tuple[set, list]:
    """The dotted names the directives render, and the objects they render."""
    paths, objects = set(), []
    for _, path, members in _directives():
        obj = _resolve(path)
        paths.add(path)
        objects.append(obj)
        if isinstance(obj, types.ModuleType) and members is not False:
            for name in getattr(obj, "__all__", []) if members is None else members:
                paths.add(f"{path}.{name}")
                objects.append(getattr(obj, name))
    return paths, objects


def _public_object(module_path: str, name: str):
    return getattr(MODULES[module_path], name)


def _documentable(obj) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, types.ModuleType)


def test_every_directive_names_an_object():
    directives = _directives()
    assert len(directives) >= 40, directives
    for page, path, members in directives:
        obj = _resolve(path)  # raises for a stale path
        for name in members or []:
            assert hasattr(obj, name), f"{page}: {path} has no member {name!r}"


def test_reference_pages_are_the_expected_ones():
    expected = {"index.md", "strategies.md", "distribute.md", "training.md", "input.md",
                "multi_worker.md", "cluster_resolver.md", "experimental.md", "launcher.md", "layers.md",
                "keras-patches.md"}
    assert {p.name for p in REFERENCE.glob("*.md")} == expected


@pytest.mark.parametrize("module_path,name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_is_in_the_reference(module_path, name):
    paths, objects = _documented()
    obj = _public_object(module_path, name)
    same_object = _documentable(obj) and any(o is obj for o in objects)
    assert f"{module_path}.{name}" in paths or same_object, (
        f"{module_path}.{name} is on no page of docs/reference: add a `::: {module_path}.{name}` directive."
    )


@pytest.mark.parametrize("module_path,name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_object_has_a_docstring_with_an_example(module_path, name):
    obj = _public_object(module_path, name)
    if not _documentable(obj):  # a constant: documented by its page's text
        text = "\n".join(p.read_text() for p in REFERENCE.glob("*.md"))
        assert name in text
        return
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{module_path}.{name} has no docstring"
    assert _has_example(doc), f"the docstring of {module_path}.{name} has no example (>>> or ```python)"


def _public_classes() -> list[type]:
    classes = {id(o): o for m, n in PUBLIC for o in [_public_object(m, n)] if inspect.isclass(o)}
    return list(classes.values())


def _own_public_members(cls: type):
    """`(name, function or property)` of the public methods and properties this package defines on `cls`."""
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is None or not owner.__module__.startswith("keras_strategies"):
            continue
        raw = vars(owner)[name]
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property) or inspect.isfunction(raw):
            yield name, raw


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_members_have_docstrings(cls):
    missing = [name for name, member in _own_public_members(cls) if not (inspect.getdoc(member) or "").strip()]
    assert not missing, f"{cls.__name__} members without a docstring: {missing}"


@pytest.mark.parametrize(
    "cls,name", [(c, n) for c, names in MEMBERS_WITH_EXAMPLES.items() for n in names],
    ids=lambda v: v.__name__ if inspect.isclass(v) else v,
)
def test_main_members_have_examples(cls, name):
    owner = next(c for c in cls.__mro__ if name in vars(c))  # a mixin's member counts as the class'
    doc = inspect.getdoc(vars(owner)[name]) or ""
    assert _has_example(doc), f"{cls.__name__}.{name} has no example"


def _docstrings_with_doctests() -> list[tuple[str, str]]:
    """`(name, docstring)` of every public object and member whose docstring has `>>>` examples."""
    found: dict[int, tuple[str, str]] = {}

    def add(label: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and ">>>" in doc and id(obj) not in found:
            found[id(obj)] = (label, doc)

    for module_path, name in PUBLIC:
        obj = _public_object(module_path, name)
        if not _documentable(obj):
            continue
        add(f"{module_path}.{name}", obj)
        if inspect.isclass(obj):
            for member_name, member in _own_public_members(obj):
                add(f"{obj.__name__}.{member_name}", member)
    return list(found.values())


DOCTESTS = _docstrings_with_doctests()


@pytest.mark.parametrize("label,doc", DOCTESTS, ids=[label for label, _ in DOCTESTS])
def test_docstring_examples_run(label, doc):
    environ = dict(os.environ)
    test = doctest.DocTestParser().get_doctest(doc, {"ks": ks, "keras": keras, "np": np}, label, f"<{label}>", 0)
    # Register each example's source as a file, as a script or notebook cell has one:
    # TensorFlow's autograph reads the source of the functions `ks.function` compiles.
    sources = {f"<doctest {label}[{i}]>": example.source for i, example in enumerate(test.examples)}
    for filename, source in sources.items():
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    output: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        result = runner.run(test, out=output.append)
    finally:
        for filename in sources:
            linecache.cache.pop(filename, None)
        ks.experimental_set_strategy(None)
        os.environ.clear()
        os.environ.update(environ)
    assert result.failed == 0, "".join(output)


def test_launcher_page_shows_every_command_line_option():
    page = (REFERENCE / "launcher.md").read_text()
    options = [flag for action in launch_module.build_parser()._actions for flag in action.option_strings]
    assert options and all(flag in page for flag in options), [flag for flag in options if flag not in page]
