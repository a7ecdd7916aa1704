"""The engines' contract (`keras_strategies/backend/contract.py`): every engine satisfies it, and a
broken one fails when it loads, naming what it lacks."""

import ast
import inspect
import types
from pathlib import Path

import pytest

from keras_strategies.backend import contract, engine
from keras_strategies.backend.common.capabilities import Capabilities

BACKEND = Path(contract.__file__).resolve().parent
ENGINES = ("tensorflow", "jax", "torch")


def _top_level_names(path: Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _declared_capabilities(name: str) -> Capabilities:
    """The engine's `CAPABILITIES`, read from its source (the other backends' libraries need not import)."""
    for node in ast.walk(ast.parse((BACKEND / name / "__init__.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Capabilities":
            flags = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords
                     if keyword.arg != "untraceable_errors"}
            return Capabilities(**flags)
    raise AssertionError(f"backend/{name}/__init__.py declares no CAPABILITIES")


def test_the_loaded_engine_satisfies_the_contract():
    assert contract.problems(engine) == []
    assert isinstance(engine.capabilities, Capabilities)
    for module, protocol in contract.MODULES.items():
        assert isinstance(getattr(engine, module), protocol), module
    for module, protocol, required in contract.OPTIONAL:
        if required(engine.capabilities):
            assert isinstance(getattr(engine, module), protocol), (module, protocol.__name__)


@pytest.mark.parametrize("name", ENGINES)
def test_every_engine_defines_every_name_its_capabilities_ask_for(name):
    capabilities = _declared_capabilities(name)
    for module in contract.MODULES:
        path = BACKEND / name / f"{module}.py"
        assert path.exists(), f"backend/{name} has no module {module}"
        missing = contract.names(module, capabilities) - _top_level_names(path)
        assert not missing, f"backend/{name}/{module}.py lacks {sorted(missing)}"
        imported = f"from keras_strategies.backend.{name} import {module}"
        assert imported in (BACKEND / name / "__init__.py").read_text(), f"backend/{name} does not import {module}"


def test_a_name_only_some_engines_have_is_an_optional_capability():
    # Where an engine module lacks a name another engine's has, the contract asks for it only under
    # a capability, and the engines without that capability lack it.
    for module, protocol, required in contract.OPTIONAL:
        havers = [name for name in ENGINES if required(_declared_capabilities(name))]
        assert havers, f"no engine has {protocol.__name__}"
        for name in set(ENGINES) - set(havers):
            present = set(contract.members(protocol)) & _top_level_names(BACKEND / name / f"{module}.py")
            assert present <= set(contract.members(contract.MODULES[module])), (name, module, present)


def test_every_declared_function_has_a_signature_each_engine_accepts():
    for module, protocol in contract.MODULES.items():
        for member in contract.members(protocol):
            declared = vars(protocol).get(member)
            if callable(declared):
                assert list(inspect.signature(declared).parameters)[0] == "self", f"{protocol.__name__}.{member}"


def _engine_namespace(**changes) -> types.SimpleNamespace:
    modules = {module: getattr(engine, module) for module in contract.MODULES}
    namespace = types.SimpleNamespace(CAPABILITIES=engine.capabilities, **modules)
    for key, value in changes.items():
        setattr(namespace, key, value)
    return namespace


def test_an_engine_without_a_declared_name_fails_when_it_loads_and_names_it():
    devices = types.SimpleNamespace(**{name: getattr(engine.devices, name) for name in
                                       contract.members(contract.Devices) if name != "copy_to"})
    with pytest.raises(RuntimeError, match=r"devices\.copy_to is missing \(Devices\)"):
        contract.Engine("broken", _engine_namespace(devices=devices))


def test_an_engine_function_with_other_parameters_fails_when_it_loads():
    def place_each(values):  # the contract's place_each takes (values, names)
        return values

    place_each.__module__ = "keras_strategies.backend.broken.devices"
    devices = types.SimpleNamespace(**{name: getattr(engine.devices, name) for name in
                                       contract.members(contract.Devices)})
    devices.place_each = place_each
    with pytest.raises(RuntimeError, match=r"devices\.place_each\(values\) does not take the parameters"):
        contract.Engine("broken", _engine_namespace(devices=devices))


def test_an_engine_with_a_capability_needs_its_optional_names():
    exchanging = Capabilities(**{**vars(engine.capabilities), "exchanges_in_program": True})
    compiler = types.SimpleNamespace(**{name: getattr(engine.compiler, name) for name in
                                        contract.members(contract.Compiler)})
    problems = contract.problems(types.SimpleNamespace(**{**vars(_engine_namespace(compiler=compiler)),
                                                          "capabilities": exchanging}))
    assert "compiler.run_if is missing (InProgramExchange)" in problems
    with pytest.raises(RuntimeError, match="capabilities is None"):
        contract.Engine("broken", _engine_namespace(CAPABILITIES=None))
