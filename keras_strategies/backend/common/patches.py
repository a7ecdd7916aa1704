"""The one registry of every Keras (or backend) function this package replaces.

A module declares each replacement once, at import, with `declare(target,
why)`, and installs it with `Patch.apply(wrap)` (for good, at import) or
`Patch.applied(wrap)` (for the duration of a `with` block). Nothing else in the
package assigns to a Keras attribute, so the registry is the whole list: the
docs' table (`docs/reference/keras-patches.md`) is generated from it by
`scripts/keras_patches.py`, and the suite checks both ways that it is complete.

Each patch fingerprints the function it replaces (its syntax tree, without
docstring). `keras_fingerprints.json` beside this module keeps the
fingerprints of the releases whose code the replacements were reviewed
against; a Keras whose replaced function matches none of them fails
`unreviewed()` with that function's name, instead of silently training
differently.

Lives in `backend/common` so that the engines, which use nothing outside
`keras_strategies.backend`, declare their replacements here too.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import json
import sys
import textwrap
import threading
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Optional

FINGERPRINTS = Path(__file__).with_name("keras_fingerprints.json")

_REGISTRY: dict = {}  # (target, declaring module) -> Patch
_LOCK = threading.Lock()


@dataclasses.dataclass(eq=False)
class Patch:
    """One replacement: `target` is the dotted path of the replaced attribute, `why` its reason.

    `when` says when it is in place ("import" for good; otherwise the
    circumstance); `optional` replacements are skipped where the installed
    release lacks the attribute; `aliases` are public modules whose binding of
    the same function is replaced too; `declared` is the path the module names
    (`target` is where the installed release keeps it, see `declare(moved=...)`).
    """

    target: str
    why: str
    module: str
    when: str = "import"
    optional: bool = False
    aliases: tuple = ()
    declared: str = ""
    _original: Optional[Callable] = dataclasses.field(default=None, repr=False)
    _wrapper: Optional[Callable] = dataclasses.field(default=None, repr=False)
    _depth: int = dataclasses.field(default=0, repr=False)
    _inherited: bool = dataclasses.field(default=False, repr=False)
    _resolved: Optional[tuple] = dataclasses.field(default=None, repr=False)

    # -- where the target lives -------------------------------------------------------------

    def _owner_and_name(self) -> tuple:
        """(the module or class holding the attribute, its name), importing what the path names."""
        if self._resolved is None:
            self._resolved = self._resolve()
        return self._resolved

    def _resolve(self) -> tuple:
        parts = self.target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:-1]:
                owner = getattr(owner, part)
            return owner, parts[-1]
        raise ImportError(f"no module in {self.target!r}")

    def current(self) -> Optional[Callable]:
        """What the target is bound to now (None where the release lacks it)."""
        try:
            owner, name = self._owner_and_name()
        except (ImportError, AttributeError):
            return None
        if inspect.isclass(owner):
            for cls in owner.__mro__:
                if name in vars(cls):
                    return vars(cls)[name]
            return None
        return getattr(owner, name, None)

    def keras_function(self) -> Optional[Callable]:
        """The function Keras itself binds to the target: the innermost of the replacements."""
        function = self._original if self._original is not None else self.current()
        while hasattr(function, "_ks_original"):
            function = function._ks_original
        return function

    def inherited_from(self) -> Optional[str]:
        """The class that defines Keras' method where the target's class only inherits it."""
        if self.current() is None:
            return None
        owner, name = self._owner_and_name()
        if not inspect.isclass(owner):
            return None
        for cls in owner.__mro__:
            if vars(cls).get(name) is self.keras_function():
                return None if cls is owner else f"{cls.__module__}.{cls.__qualname__}"
        return None

    # -- installing ------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return self._wrapper is not None

    def apply(self, wrap: Callable[[Callable], Callable]) -> None:
        """Replaces the target with `wrap(current function)` until `remove()` (idempotent)."""
        with _LOCK:
            if self._depth == 0 and self._wrapper is None:
                self._install(wrap)
            self._depth = max(self._depth, 1)

    def _install(self, wrap: Callable) -> None:
        original = self.current()
        if original is None:
            if self.optional:
                return
            raise AttributeError(f"{self.target} does not exist in this release; {self.module} replaces it")
        owner, name = self._owner_and_name()
        wrapper = wrap(original)
        wrapper._ks_original = original
        self._inherited = inspect.isclass(owner) and name not in vars(owner)
        wrapper._ks_patch = self
        setattr(owner, name, wrapper)
        for alias in self.aliases:
            module = sys.modules.get(alias)
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, wrapper)
        self._original, self._wrapper = original, wrapper

    def remove(self) -> None:
        """Puts back what the target was bound to before `apply` (if it is still this patch's)."""
        with _LOCK:
            self._depth = 0
            self._uninstall()

    def _uninstall(self) -> None:
        if self._wrapper is None:
            return
        owner, name = self._owner_and_name()
        if self.current() is not self._wrapper:
            raise RuntimeError(f"{self.target} was replaced again over {self.module}'s replacement; "
                               "remove the later replacement first")
        if self._inherited:
            delattr(owner, name)  # the class inherits Keras' method again
        else:
            setattr(owner, name, self._original)
        for alias in self.aliases:
            module = sys.modules.get(alias)
            if module is not None and getattr(module, name, None) is self._wrapper:
                setattr(module, name, self._original)
        self._wrapper = None

    @contextlib.contextmanager
    def applied(self, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
        """The target replaced inside the block; nested and concurrent blocks share one replacement."""
        with _LOCK:
            if self._depth == 0:
                self._install(wrap)
            self._depth += 1
        try:
            yield
        finally:
            with _LOCK:
                self._depth -= 1
                if self._depth == 0:
                    self._uninstall()

    # -- reviewing -------------------------------------------------------------------------

    def fingerprint(self) -> Optional[str]:
        """A hash of the replaced Keras function's code (docstring excluded); None if it has no source."""
        return fingerprint(self.keras_function())


def declare(target: str, why: str, *, when: str = "import", optional: bool = False, aliases: tuple = (),
            moved: tuple = ()) -> Patch:
    """Records that the calling module replaces `target` (idempotent per target and module).

    `moved` names where other Keras releases keep the same function: the first path that
    exists in the installed release is the one replaced.
    """
    module = sys._getframe(1).f_globals.get("__name__", "?")
    declared = target
    if moved:
        target = next((path for path in (target, *moved) if Patch(path, why, module).current() is not None), target)
    key = (target, module)
    with _LOCK:
        if key not in _REGISTRY:
            _REGISTRY[key] = Patch(target, why, module, when=when, optional=optional, aliases=tuple(aliases),
                                   declared=declared)
        return _REGISTRY[key]


def registered() -> list:
    """Every declared patch, in declaration order."""
    return list(_REGISTRY.values())


def fingerprint(function: Optional[Callable]) -> Optional[str]:
    """A short hash of `function`'s syntax tree without its docstring (stable across formatting)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:]
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()[:16]


def release_of(target: str) -> str:
    """`package version` of the distribution a target belongs to (`keras 3.15.1`)."""
    package = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}.get(target.split(".")[0], "keras")
    for name in (package, "keras-nightly", f"{package}-cpu") if package in ("keras", "tensorflow") else (package,):
        try:
            return f"{package} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{package} unknown"


def known_fingerprints(path: Path = FINGERPRINTS) -> dict:
    """{target: {fingerprint: [the reviewed releases with that code]}}."""
    return json.loads(path.read_text()) if path.exists() else {}


def unreviewed(known: Optional[dict] = None, patches: Optional[list] = None) -> list:
    """One message for each replaced function whose code matches no reviewed release's."""
    known = known_fingerprints() if known is None else known
    messages = []
    for patch in registered() if patches is None else patches:
        if patch.keras_function() is None:
            continue  # an optional target this release lacks
        seen = known.get(patch.target, {})
        current = patch.fingerprint()
        if current not in seen:
            reviewed = ", ".join(sorted(release for releases in seen.values() for release in releases)) or "none"
            messages.append(
                f"{patch.target} (replaced by {patch.module}) differs in {release_of(patch.target)} from every "
                f"reviewed release ({reviewed}): review the replacement against the new code, then record it "
                "with `python scripts/keras_patches.py --record`"
            )
    return messages
