"""The package's dependency rules: engines use only `backend/`, shared code reads an engine only
through its contract (`backend/contract.py`) and never branches on the backend's name, and no
module imports itself back."""

import ast
import dataclasses
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "keras_strategies"


def _modules() -> dict:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path) -> list:
    """Every `keras_strategies` module named by an import in `path`, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] == "keras_strategies"]


def _resolve(name: str, modules: dict) -> str:
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def test_engines_import_only_the_backend_package():
    for engine in ("tensorflow", "jax", "torch", "common"):
        allowed = "keras_strategies.backend." + ("common" if engine == "common" else "")
        for path in (PACKAGE / "backend" / engine).glob("*.py"):
            for name in _imports(path):
                assert name.startswith(allowed), f"{path.relative_to(PACKAGE.parent)} imports {name}"


def test_no_import_cycles():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(path):
            target = _resolve(name, modules)
            # Importing a.b.c runs the packages a.b and a first.
            while target and target != "keras_strategies":
                if not module.startswith(target + ".") and module != target:
                    targets.add(target)
                target = target.rpartition(".")[0]
        graph[module] = targets

    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_top_level_holds_the_public_api_only():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "_api.py", "_version.py", "experimental.py", "launch.py"]


ENGINE_PACKAGES = ("tensorflow", "jax", "torch")


def _shared_modules() -> list:
    """Every module outside the engine packages (`backend/common` included: it is shared too)."""
    return [path for path in PACKAGE.rglob("*.py")
            if path.relative_to(PACKAGE).parts[:2] not in {("backend", name) for name in ENGINE_PACKAGES}]


def _contract():
    """The contract module, read without importing a backend (`contract.py` imports only `backend/common`)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_contract_for_layout", PACKAGE / "backend" / "contract.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_shared_code_reads_engine_names_only_through_the_contract():
    contract = _contract()
    capabilities = {field.name for field in dataclasses.fields(contract.Capabilities)}
    for path in _shared_modules():
        where = path.relative_to(PACKAGE.parent)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "engine"):
                continue
            module, name = node.value.attr, node.attr
            if module == "capabilities":
                assert name in capabilities, f"{where}:{node.lineno} reads engine.capabilities.{name}, not a capability"
            else:
                assert module in contract.MODULES, f"{where}:{node.lineno} reads engine.{module}, not an engine module"
                assert name in contract.names(module), (
                    f"{where}:{node.lineno} reads engine.{module}.{name}, which the contract does not declare")
        for name in _imports(path):
            assert name.split(".")[:3] not in [["keras_strategies", "backend", engine] for engine in ENGINE_PACKAGES], (
                f"{where} imports {name}: shared code reads engines as `keras_strategies.backend.engine`")
        text = path.read_text()
        for engine in ENGINE_PACKAGES:
            assert not re.search(rf"keras_strategies\.backend\.{engine}\b", text) or where.parts[1:3] == (
                "backend", "common"), f"{where} names the {engine} engine's package"


def _names_a_backend(node: ast.AST) -> bool:
    """`keras.backend.backend()` or `backend_name()`."""
    return any(isinstance(part, ast.Call) and (getattr(part.func, "attr", None) == "backend" or getattr(
        part.func, "id", None) in ("backend", "backend_name")) for part in ast.walk(node))


def _branches_on_a_backend(compare: ast.Compare) -> bool:
    """A comparison of the backend's name, or of a variable called `backend` with a string."""
    sides = [compare.left, *compare.comparators]
    strings = any(isinstance(part, ast.Constant) and isinstance(part.value, str) for side in sides
                  for part in ast.walk(side))
    variable = any(getattr(side, "id", getattr(side, "attr", None)) == "backend" for side in sides)
    return any(_names_a_backend(side) for side in sides) or (variable and strings)


def test_no_branch_on_the_backend_name_outside_the_engines():
    for path in _shared_modules():
        if path == PACKAGE / "backend" / "__init__.py":  # where the engine is chosen
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            assert not _branches_on_a_backend(node), (
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} branches on the backend "
                f"({ast.unparse(node)}): give the engine a capability (backend/contract.py) instead")


# A class past these sizes is split into parts, each in a module of its own (as `ReplicaStep`
# is into `shards`, `replica_program`, `global_update` and `worker_exchange`).
MAX_CLASS_LINES, MAX_CLASS_METHODS = 350, 40


def test_no_class_grows_past_what_a_newcomer_holds_in_mind():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
            assert lines <= MAX_CLASS_LINES and methods <= MAX_CLASS_METHODS, (
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} class {node.name} has {lines} lines and "
                f"{methods} methods (at most {MAX_CLASS_LINES} and {MAX_CLASS_METHODS}): split it into parts")
