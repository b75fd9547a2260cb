"""``"package.module:attribute"`` strings in a config resolved to Python objects (standard library
only): an environment factory, a module of tools, a reward function.

A module is looked up on ``sys.path`` and then in ``search`` folders (the working directory and
the config file's folder: a console script's ``sys.path`` holds neither), so a user's
``my_env.py`` beside ``my.yaml`` is found from wherever ``agentrl-fast`` runs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Iterable

from agentrl_fast.config.errors import ConfigError


def import_object(spec: str, field: str, search: Iterable[str | Path] = (),
                  attribute_required: bool = True):
    """The object ``spec`` names (``"module:attr"``, ``attr`` may be dotted; a bare
    ``"module"`` when ``attribute_required`` is false: the module itself); a
    :class:`ConfigError` naming ``field`` when it cannot be imported or has no such attribute."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{field}: expected 'package.module:attribute', got {spec!r}")
    module_name, _, attribute = spec.strip().partition(":")
    if attribute_required and not attribute:
        raise ConfigError(f"{field}: {spec!r} names no attribute; write 'package.module:attribute'")
    module = _import_module(module_name, field, search)
    target = module
    for part in attribute.split(".") if attribute else ():
        if not hasattr(target, part):
            raise ConfigError(f"{field}: module {module_name!r} ({module.__file__}) has no "
                              f"attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _import_module(name: str, field: str, search: Iterable[str | Path]):
    folders = [str(Path(folder).resolve()) for folder in search]
    added = [folder for folder in folders if folder not in sys.path]
    sys.path.extend(added)  # after the installed packages: a user file cannot shadow them
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            where = ", ".join(folders) or "sys.path"
            raise ConfigError(f"{field}: no module named {name!r} (looked on sys.path and in "
                              f"{where})") from None
        raise ConfigError(f"{field}: importing {name!r} failed: {error}") from error
    except Exception as error:  # the user's module raised while importing
        raise ConfigError(f"{field}: importing {name!r} failed: "
                          f"{type(error).__name__}: {error}") from error
