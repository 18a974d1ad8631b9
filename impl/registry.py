"""One registry mechanism for every pluggable part of the harness, in the shape of lm-eval's registry:
entries by name, with aliases, registered by decorator or as lazy ``"module:attribute"`` strings
(imported on first use, so listing names costs no import), and an optional base-class check.

The registries (each owned by the module whose concept it names):

=========================================  ======================================================
:data:`impl.methods.METHODS`               decoding methods (builders of one decode function)
:data:`impl.tev.verify.VERIFIERS`          exact fixed-tree verifiers
:data:`impl.vskipper.skipper.SKIPPERS`     skip policies (base class ``Skipper``)
:data:`impl.cli.COMMANDS`                  command families of ``python -m impl`` (``register(add)``)
:data:`impl.config.CONFIG_SECTIONS`        optional config sections (schema, defaults, checks)
:data:`impl.report.markdown.REPORT_SECTIONS`  report sections (``report_section(tables, figures, out)``)
=========================================  ======================================================

A registry is a read-only :class:`~collections.abc.Mapping` from canonical names to resolved entries
(``name in R``, ``R[name]``, iteration in registration order), so callers that held plain dicts keep
working.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

__all__ = ["Registry", "RegistryError", "lazy_exports", "resolve"]

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name (the message lists the registered ones), a clash, or an entry of the wrong type."""


def resolve(target: str) -> Any:
    """Import ``"package.module:attr.sub"`` (or a bare ``"package.module"``) and return the object.

    Raises:
        RegistryError: a malformed target; ImportError / AttributeError propagate as they are.
    """
    mod, _, attr = target.partition(":")
    if not mod:
        raise RegistryError(f"bad lazy target {target!r}: use 'package.module:attribute'")
    obj = importlib.import_module(mod)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


class Registry(Mapping, Generic[T]):
    """Named entries of one kind.

    Args:
        kind: what the entries are (``"method"``, ``"skipper"``, ...), used in error messages.
        base: a class (or lazy ``"module:Class"``) every entry must be, or subclass when it is a class;
            None: no check.
    """

    def __init__(self, kind: str, *, base: type | str | None = None):
        self.kind = kind
        self._base = base
        self._entries: dict[str, Any] = {}  # canonical name -> object or lazy target string
        self._lazy: set[str] = set()
        self._aliases: dict[str, str] = {}

    # -------------------------------------------------------------------------------- registering
    def register(self, name: str, obj: Any = None, *, aliases: tuple[str, ...] | list[str] = ()) -> Any:
        """Register ``obj`` under ``name`` (and ``aliases``); without ``obj``, a decorator.

        A string ``obj`` is a lazy target (:func:`resolve`), imported and checked on first use.
        Registering the same object again under the same name is a no-op (module reloads).

        Raises:
            RegistryError: an empty name, or a name / alias already taken by another entry.
        """
        if obj is None:
            def deco(o):
                self.register(name, o, aliases=aliases)
                return o

            return deco
        if not name:
            raise RegistryError(f"{self.kind} name must be non-empty")
        for key in (name, *aliases):
            owner = self._aliases.get(key, key if key in self._entries else None)
            if owner is not None and (owner != name or (key == name and not self._same(name, obj))):
                raise RegistryError(f"{self.kind} name {key!r} is already registered to {self._entries[owner]!r}")
        if not isinstance(obj, str):
            self._check(name, obj)
        self._entries[name] = obj
        if isinstance(obj, str):
            self._lazy.add(name)
        else:
            self._lazy.discard(name)
            try:
                obj.registered_name = name
            except (AttributeError, TypeError):  # builtins, bound methods
                pass
        for a in aliases:
            self._aliases[a] = name
        return obj

    def _same(self, name: str, obj: Any) -> bool:
        old = self._entries[name]
        qual = lambda o: (getattr(o, "__module__", None), getattr(o, "__qualname__", None))  # noqa: E731
        if isinstance(old, str) and not isinstance(obj, str):  # a lazy entry meeting its own object on import
            return old == f"{qual(obj)[0]}:{qual(obj)[1]}"
        return old is obj or old == obj or (qual(old)[1] is not None and qual(old) == qual(obj))

    def _base_class(self) -> type | None:
        if isinstance(self._base, str):
            self._base = resolve(self._base)
        return self._base

    def _check(self, name: str, obj: Any) -> None:
        base = self._base_class()
        if base is None:
            return
        ok = issubclass(obj, base) if isinstance(obj, type) else isinstance(obj, base) or callable(obj)
        if not ok:
            raise RegistryError(f"{self.kind} {name!r}: {obj!r} is not a {base.__name__}")

    # ---------------------------------------------------------------------------------- looking up
    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` or an alias of it.

        Raises:
            RegistryError: an unknown name (listing the registered ones).
        """
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {', '.join(self._entries) or '(none)'}")

    def get_entry(self, name: str) -> T:
        """The entry registered as ``name`` (or an alias), importing a lazy one on first use.

        Raises:
            RegistryError: unknown name or an entry of the wrong type.
        """
        key = self.canonical(name)
        obj = self._entries[key]
        if key in self._lazy:
            obj = resolve(obj)
            self._check(key, obj)
            self._entries[key] = obj
            self._lazy.discard(key)
        return obj

    def names(self) -> list[str]:
        """Canonical names in registration order."""
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        """Alias -> canonical name."""
        return dict(self._aliases)

    def build(self, name: str, *args, **kwargs) -> Any:
        """Call the entry registered as ``name`` (a class or factory) with the arguments."""
        factory: Callable[..., Any] = self.get_entry(name)
        return factory(*args, **kwargs)

    # --------------------------------------------------------------------------------- Mapping API
    def __getitem__(self, name: str) -> T:
        try:
            return self.get_entry(name)
        except RegistryError as e:
            raise KeyError(str(e)) from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for a package that exports names lazily (PEP 562): ``exports`` maps a
    name to the relative module defining it, imported on first access and cached in the package.

    Raises (from the returned ``__getattr__``):
        AttributeError: a name the package does not export.
    """

    def __getattr__(name: str):
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
