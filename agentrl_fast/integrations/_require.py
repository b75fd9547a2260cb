"""Optional stacks: import one of their modules or fail with a message naming the package."""

from __future__ import annotations

import importlib

_INSTALL = {
    "verl": "pip install --no-deps verl==0.9.1 plus the packages its modules import "
            "(tools/side-envs/verl.txt lists them)",
    "trl": "pip install trl==1.16.0",
}


def require(package: str, module: str):
    """``importlib.import_module(module)``; ImportError naming ``package`` and how to install
    it when that package is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        missing = getattr(error, "name", None) or ""
        if missing == package or missing.startswith(package + "."):
            raise ImportError(f"agentrl_fast.integrations.{package} needs the {package!r} package, "
                              f"which is not installed: {_INSTALL[package]}") from error
        raise ImportError(f"agentrl_fast.integrations.{package}: importing {module} failed "
                          f"({error}); {package} is installed but a package it imports is "
                          f"missing: {_INSTALL[package]}") from error
