"""Launch configurations measured by the tuning sweep (``bench/tune_kernels.py``), per GPU.

A kernel's configuration function returns ``tuned(op, key, default)``: the sweep's best
configuration for this GPU where it wrote one, else ``default``. ``op`` and ``key`` name the
launch the way ``aot_specs`` names its compiles (``"varlen_attention_forward"``,
``"bf16_d64"``: spec ``varlen_attention_forward_bf16_d64``), so ``tests/triton_aot.py`` compiles
every tuned configuration too. A tuned entry whose keys differ from the default's (the kernel's
parameters changed since the sweep) is ignored.

The file: ``tuned_configs.json`` beside this module (``AGENTRL_FAST_TUNED_CONFIGS`` overrides the
path), ``{"<GPU name>": {"<op>": {"<key>": {config}}}}``; the GPU name is
``torch.cuda.get_device_name()``. Under the interpreter or without CUDA nothing is tuned.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent / "tuned_configs.json"


def tuned_path() -> Path:
    return Path(os.environ.get("AGENTRL_FAST_TUNED_CONFIGS", DEFAULT_PATH))


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {{GPU name: {{op: {{key: config}}}}}}")
    return data


def device_name() -> str | None:
    """The current CUDA device's name, or None (no CUDA, or the Triton interpreter)."""
    torch = sys.modules.get("torch")  # agentrl_fast/kernels/ imports triton only (the AOT side environment)
    if torch is None or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


@functools.lru_cache(maxsize=None)
def _device_entries(path: str, device: str | None) -> dict:
    return _load(path).get(device, {}) if device is not None else {}


_FORCED: dict[tuple[str, str], dict] = {}


@contextlib.contextmanager
def forced(op: str, key: str, config: dict):
    """Within the block ``tuned(op, key, ...)`` returns ``config``, on any device (how the
    sweep launches its candidates)."""
    _FORCED[(op, key)] = dict(config)
    try:
        yield
    finally:
        _FORCED.pop((op, key), None)


def tuned(op: str, key: str, default: dict) -> dict:
    """The tuned configuration of ``op`` / ``key`` on this GPU, else ``default``."""
    if (op, key) in _FORCED:
        return dict(_FORCED[(op, key)])
    entries = _device_entries(str(tuned_path()), device_name())
    config = entries.get(op, {}).get(key)
    if config is None or set(config) != set(default):
        return default
    return dict(config)


def tuned_variants(op: str, key: str) -> list[dict]:
    """Every configuration the file holds for ``op`` / ``key``, on any GPU, once each (what
    ``tests/triton_aot.py`` compiles besides the defaults)."""
    out: list[dict] = []
    for entries in _load(str(tuned_path())).values():
        config = entries.get(op, {}).get(key)
        if config is not None and config not in out:
            out.append(dict(config))
    return out


def write(device: str, op: str, key: str, config: dict, path: Path | None = None) -> None:
    """Record ``config`` as the best for ``op`` / ``key`` on ``device`` (merged into the file)."""
    path = Path(path or tuned_path())
    data = _load(str(path)) if path.exists() else {}
    data = json.loads(json.dumps(data))  # a copy: the cached one stays as loaded
    data.setdefault(device, {}).setdefault(op, {})[key] = config
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
    _device_entries.cache_clear()
