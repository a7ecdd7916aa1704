"""The package's dependency rules: engines use only `backend/`, and no module imports itself back."""

import ast
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
