"""Named plug points (verl's registries, slime's function paths): a user's function is chosen in
the config by its registered name, or by an import path ``"package.module:function"``; the
built-ins are entries of the same registries (advantage estimators:
:mod:`agentrl_fast.train.advantages`; policy losses: :mod:`agentrl_fast.train.losses`)."""

from __future__ import annotations

import importlib
from typing import Callable


class Registry:
    """``name -> function`` for the config field ``field`` (named in errors)."""

    def __init__(self, field: str):
        self.field = field
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator: ``@registry.register("name")`` adds the function under ``name``
        (replacing an earlier entry of that name)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.field}: a registered name must be a non-empty string "
                             f"without ':', got {name!r}")

        def add(function: Callable) -> Callable:
            if not callable(function):
                raise TypeError(f"{self.field}: {name!r} must name a function, got "
                                f"{type(function).__name__}")
            self._entries[name] = function
            return function
        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Callable:
        """The function registered as ``name``, or imported from ``"module:function"``."""
        if not isinstance(name, str):
            raise TypeError(f"{self.field} must be a string, got {type(name).__name__}")
        if ":" in name:
            return _imported(self.field, name)
        if name not in self._entries:
            raise ValueError(f"{self.field}: unknown {name!r}; registered: "
                             f"{', '.join(self.names())} (or give 'package.module:function')")
        return self._entries[name]


def _imported(field: str, path: str) -> Callable:
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{field}: cannot import {path!r}: {type(error).__name__}: "
                         f"{error}") from None
    if not callable(function):
        raise TypeError(f"{field}: {path!r} is a {type(function).__name__}, not a function")
    return function
